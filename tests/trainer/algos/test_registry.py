"""The algorithms are named in one place: the config's sections, the registry and the code agree."""

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from nereus.trainer.algos.registry import ALGORITHMS
from nereus.trainer.config import HYPERPARAMETERS, Algorithm, JobConfig, lr_schedules
from nereus.trainer.runtime.lr_schedule import plan_schedule

ROOT = Path(__file__).resolve().parents[3]


def test_the_config_the_sections_and_the_registry_name_the_same_algorithms():
    assert set(typing.get_args(Algorithm)) == set(HYPERPARAMETERS) == set(ALGORITHMS)
    hints = typing.get_type_hints(JobConfig)
    for name, section in HYPERPARAMETERS.items():
        assert hints[name] is section, f"JobConfig.{name} is not the {name} section"
        assert ALGORITHMS[name].critic is section.critic


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, kinds) and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _algorithm_names_used(root: Path, skip: set[str]) -> list[str]:
    """Every place under ``root``'s code that names an algorithm: a string constant equal to
    one (a comparison, a ``match`` case, a dict key, ``getattr(cfg, "ppo")``: all are
    constants; docstrings aside), or a read of a hyperparameter section by its name
    (``cfg.ppo``) outside ``trainer/config``."""
    names, found = set(HYPERPARAMETERS), []
    files = [p for folder in ("trainer", "cli", "nereus", "reshard", "store") for p in sorted((root / folder).rglob("*.py"))]
    for path in files:
        rel = str(path.relative_to(root))
        if rel in skip:
            continue
        tree = ast.parse(path.read_text(), rel)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            named = isinstance(node, ast.Constant) and node.value in names and id(node) not in docs
            read = isinstance(node, ast.Attribute) and node.attr in names and not rel.startswith("trainer/config/")
            if named or read:
                found.append(f"{rel}:{node.lineno}")
    return found


def test_no_code_outside_the_schema_and_the_registry_names_an_algorithm():
    """``cfg.algorithm == "ppo"``, ``cfg.ppo.lr`` or ``{"grpo": ...}`` anywhere else is a rule
    about one algorithm spelled outside it: the code reads ``cfg.algo_hp`` and the registry."""
    found = _algorithm_names_used(ROOT, {"trainer/config/schema.py", "trainer/algos/registry.py"})
    assert not found, f"algorithm names outside the schema and the registry: {found}"


@pytest.mark.parametrize("planted", [
    'if cfg.algorithm == "ppo":\n    pass\n',
    'x = cfg.algorithm in ("grpo",)\n',
    'match cfg.algorithm:\n    case "ppo":\n        pass\n',
    'x = {"ppo": 3}.get(cfg.algorithm)\n',
    'x = getattr(cfg, "grpo")\n',
    'x = cfg.ppo.critic_lr\n',
])
def test_the_scan_finds_each_way_of_naming_an_algorithm(tmp_path, planted):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "planted.py").write_text(f'"""A docstring may say ppo."""\n{planted}')
    found = _algorithm_names_used(tmp_path, set())
    assert found and all(f.startswith("trainer/planted.py:") and not f.endswith(":1") for f in found), found


@pytest.mark.parametrize("name", sorted(HYPERPARAMETERS))
def test_each_algorithm_reads_its_own_section(name):
    hp = dataclasses.replace(HYPERPARAMETERS[name](), minibatch_size=4, epochs=1)
    cfg = dataclasses.replace(_cfg(), algorithm=name, **{name: hp})
    assert cfg.algo_hp is hp
    assert cfg.optimizer_steps_per_step == cfg.batch_size // 4
    trained = hp.optimizers()
    assert [m.stage for m in ALGORITHMS[name].models(cfg)] == list(trained)  # every model the algorithm trains has an optimizer
    assert list(lr_schedules(cfg)) == [f"{name}.{key}" for _, key in trained.values()]
    for stage, (lr, key) in trained.items():
        assert lr_schedules(cfg)[f"{name}.{key}"] is getattr(hp, key)
        assert lr > 0 and plan_schedule(cfg, stage).total == cfg.steps * cfg.optimizer_steps_per_step


def _cfg() -> JobConfig:
    from nereus.trainer.prepare import load_config

    return load_config(ROOT / "configs" / "tiny_ppo.yaml")
