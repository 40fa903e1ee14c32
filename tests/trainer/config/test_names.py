"""The model-stage names are spelled once, in ``trainer/config/names.py``."""

import ast
from pathlib import Path

from trainer.config import names

ROOT = Path(__file__).resolve().parents[3]
SPELLED = {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str) and v != names.OWN_FORWARD}
"""Every name and the sync prefix; not the own forward's ``.infer``, which is also a stage's suffix."""


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


def test_no_module_spells_a_model_stage_name_out():
    files = [p for folder in ("trainer", "cli", "nereus", "tools") for p in sorted((ROOT / folder).rglob("*.py"))]
    found = []
    for path in files:
        if path.name == "names.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        found += [f"{path.relative_to(ROOT)}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in SPELLED and id(n) not in docs]
    assert not found, f"model-stage names spelled outside trainer/config/names.py: {found}"
