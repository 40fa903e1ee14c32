"""The model-stage names, and the models' and stages' words, are spelled once, in ``trainer/config/names.py``."""

import ast
from pathlib import Path

import pytest

from nereus.trainer.config import names

ROOT = Path(__file__).resolve().parents[3]
WORDS = {*names.MODELS, names.TRAIN, names.GEN, names.INFER} | {f"{m}." for m in names.MODELS}
"""The models and the stages (bare words, also used as other things' names), and a model's prefix (``"critic."``)."""
SPELLED = {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str) and v != names.OWN_FORWARD} - WORDS
"""Every name and the sync prefix; not the own forward's ``.infer``, which is also a stage's suffix."""
OTHER_MEANINGS = {
    ("trainer/config/checks.py", "critic"): (1, "the config section `critic:` (the trained models' sections)"),
    ("trainer/config/schema.py", "critic"): (2, "the config section `critic:` (MODEL_SECTIONS, stage_model's config key)"),
    ("trainer/simulate/inputs.py", "critic"): (1, "the config section `critic:` of a generated job"),
    ("trainer/metrics/report.py", "reward"): (3, "a plot's label and title"),
    ("trainer/data/datasets.py", "train"): (1, "a HuggingFace dataset split"),
    ("trainer/algos/registry.py", "advantages"): (3, "the batch's key of the advantages tensor, not the step's piece"),
}
"""Where a model's or a stage's word, or a piece's name, means something else, and how many times. The names and
their fragments are looked for in trainer/, cli/, nereus/ and tools/ (``_spelled``: the benchmarks import them too);
the bare words in the package only (``_bare``: trainer/, cli/, nereus/), not in ``tools/``, whose benchmark scripts
write configs and ``--set`` strings by hand. ``reshard/`` and ``store/`` are not scanned: they may not import the trainer."""


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, kinds) and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_the_names_module_defines_every_model_stage_and_piece():
    assert set(names.MODEL_STAGES) <= SPELLED
    assert {names.ACTOR_TRAIN_INFER, names.CRITIC_TRAIN_INFER} == {"actor.train.infer", "critic.train.infer"}
    assert names.sync_piece(names.ACTOR_GEN) == "sync.actor.gen" and names.SYNC in SPELLED
    pieces = {names.sync_piece(names.ACTOR_GEN): names.ACTOR_GEN, names.ACTOR_TRAIN_INFER: names.ACTOR_TRAIN,
              names.CRITIC_TRAIN_INFER: names.CRITIC_TRAIN, names.REF_INFER: names.REF_INFER, "advantages": "advantages"}
    assert {p: names.piece_stage(p) for p in pieces} == pieces
    assert [names.model_of(k) for k in names.MODEL_STAGES] == ["actor", "actor", "critic", "critic", "ref", "reward"]


FRAGMENTS = {".train", ".gen", ".infer", ".train.infer"}
"""The suffixes a model-stage or piece name is built from: ``key.endswith(".train")`` is ``names.is_train``."""


def _spelled(root: Path) -> list[str]:
    files = [p for folder in ("trainer", "cli", "nereus", "tools") for p in sorted((root / folder).rglob("*.py"))]
    found, counts = [], {}
    for path in files:
        if path == root / "trainer" / "config" / "names.py":
            continue
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and (n.value in SPELLED or n.value in FRAGMENTS) and id(n) not in docs:
                counts[rel, n.value] = counts.get((rel, n.value), 0) + 1
                if counts[rel, n.value] > OTHER_MEANINGS.get((rel, n.value), (0, ""))[0]:
                    found.append(f"{rel}:{n.lineno} {n.value!r}")
    return found


def test_no_module_spells_a_model_stage_name_out():
    found = _spelled(ROOT)
    assert not found, f"model-stage names spelled outside trainer/config/names.py: {found}"


def _bare(root: Path) -> list[str]:
    files = [p for folder in ("trainer", "cli", "nereus") for p in sorted((root / folder).rglob("*.py"))]
    found, counts = [], {}
    for path in files:
        rel = str(path.relative_to(root))
        if rel == "trainer/config/names.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and n.value in WORDS and id(n) not in docs:
                counts[rel, n.value] = counts.get((rel, n.value), 0) + 1
                if counts[rel, n.value] > OTHER_MEANINGS.get((rel, n.value), (0, ""))[0]:
                    found.append(f"{rel}:{n.lineno} {n.value!r}")
    return found


def test_no_module_spells_a_model_or_a_stage_out():
    found = _bare(ROOT)
    assert not found, f"a model's or a stage's word spelled outside trainer/config/names.py: {found}"


@pytest.mark.parametrize("planted", ['x = model == "critic"', 'x = {"train": 1}', 'f(mode="infer")', 'x = key.startswith("critic.")'])
def test_the_scan_finds_a_bare_model_or_stage(tmp_path, planted):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "planted.py").write_text(f'"""Docs may say critic."""\n{planted}\n')
    found = _bare(tmp_path)
    assert len(found) == 1 and found[0].startswith("trainer/planted.py:2 "), found


@pytest.mark.parametrize("planted", ['x = "actor.train"', 'x = key.endswith(".gen")', 'x = name.startswith("sync.")',
                                     'x = f"{model}.train"', 'x = stage + ".infer"'])
def test_the_scan_finds_a_name_or_a_fragment_spelled_out(tmp_path, planted):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "planted.py").write_text(f'"""Docs may say actor.train."""\n{planted}\n')
    found = _spelled(tmp_path)
    assert len(found) == 1 and found[0].startswith("trainer/planted.py:2 "), found


def test_a_word_with_another_meaning_is_allowed_only_as_often_as_named(tmp_path):
    (tmp_path / "trainer" / "data").mkdir(parents=True)
    (tmp_path / "trainer" / "data" / "datasets.py").write_text('split = "train"\nif stage == "train":\n    pass\n')
    assert [f.split(" ")[0] for f in _bare(tmp_path)] == ["trainer/data/datasets.py:2"]
