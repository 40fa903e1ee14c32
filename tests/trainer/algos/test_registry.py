"""The algorithms are named in one place: the config's sections, the registry and the code agree."""

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from trainer.algos.registry import ALGORITHMS
from trainer.config import HYPERPARAMETERS, Algorithm, JobConfig, lr_schedules

ROOT = Path(__file__).resolve().parents[3]


def test_the_config_the_sections_and_the_registry_name_the_same_algorithms():
    assert set(typing.get_args(Algorithm)) == set(HYPERPARAMETERS) == set(ALGORITHMS)
    hints = typing.get_type_hints(JobConfig)
    for name, section in HYPERPARAMETERS.items():
        assert hints[name] is section, f"JobConfig.{name} is not the {name} section"
        assert ALGORITHMS[name].critic is section.critic


def test_no_code_outside_the_registry_and_the_schema_branches_on_an_algorithm_name():
    """``cfg.algorithm == "ppo"`` anywhere else is a rule about one algorithm spelled outside it."""
    names = set(HYPERPARAMETERS)
    found = []
    for path in sorted([*(ROOT / "trainer").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Constant) and o.value in names for o in operands):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"branches on an algorithm's name: {found}"


@pytest.mark.parametrize("name", sorted(HYPERPARAMETERS))
def test_each_algorithm_reads_its_own_section(name):
    hp = dataclasses.replace(HYPERPARAMETERS[name](), minibatch_size=4, epochs=1)
    cfg = dataclasses.replace(_cfg(), algorithm=name, **{name: hp})
    assert cfg.algo_hp is hp
    assert cfg.optimizer_steps_per_step == cfg.batch_size // 4
    assert list(lr_schedules(cfg)) == [f"{name}.{key}" for key in hp.schedules()]
    assert all(lr_schedules(cfg)[f"{name}.{key}"] is s for key, s in hp.schedules().items())


def _cfg() -> JobConfig:
    from trainer.prepare import load_config

    return load_config(ROOT / "configs" / "tiny_ppo.yaml")
