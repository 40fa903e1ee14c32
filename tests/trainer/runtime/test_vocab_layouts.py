"""A vocabulary no TP degree divides, in a real job: a verl-format GRPO job on a 21-token
Llama that transformers saved (its own tokenizer: the 16 ids of ``tools/make_dataset.py``
plus 5 added tokens) runs its rollout, reference and update at tp=2 — the vocabulary in
shards of 11 and 10 rows, no padding — and gives the step the tp=1 plan gives.

One 2-process launch (``trainer.runtime.layout_check.run_layouts``) runs both plans from the
same seeded state, in float64 so that the band is the layout-invariance tests' (1e-10 on
every metric, parameter and AdamW tensor: the layout only reorders roundings).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from nereus.trainer.prepare import load_config
from nereus.trainer.runtime.layout_check import compare, run_layouts, state_kind

from tests.store.models import odd_vocabulary_llama

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))
import make_dataset

EXTRA = [f"<|extra_{i}|>" for i in range(5)]  # 16 + 5 = 21 tokens


def odd_vocabulary_job(out: Path) -> dict:
    """tiny_text's GRPO job (verl parquet, chat template, reward file) on the 21-token model."""
    from tokenizers import Tokenizer

    made = make_dataset.make_dataset(out, seed=0, train=64, val=8)
    model = Path(made["model"])
    for name in ("config.json", "model.safetensors"):
        os.unlink(model / name)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.add_tokens(EXTRA)
    tok.save(str(model / "tokenizer.json"))
    odd_vocabulary_llama(model)  # config.json and model.safetensors, by transformers
    with open(ROOT / "configs" / "tiny_text.yaml") as f:
        cfg = yaml.safe_load(f)
    cfg["model"] = {"path": str(model), "dtype": "float64"}
    cfg["data"] = {**cfg["data"], "train_files": made["train"], "val_files": []}
    cfg["reward"] = {"function": f"{ROOT / 'tools' / 'repeat_reward.py'}:compute_score", "workers": 1}
    cfg.update(nproc=2, steps=1, checkpoint_every=0, run_dir=str(out / "run"), validation={"every": 0})
    cfg["rollout"] = {**cfg["rollout"], "prompts_per_step": 4}
    cfg["grpo"] = {**cfg["grpo"], "minibatch_size": 8, "epochs": 2}
    return cfg


def plan(tp: int) -> list[str]:
    dp = 2 // tp
    return [f"plan.{stage}={{dp: {dp}, tp: {tp}}}" for stage in ("actor.train", "actor.gen", "ref.infer")]


@pytest.mark.timeout(600)
def test_a_grpo_job_on_a_21_token_vocabulary_trains_at_tp2_as_at_tp1(tmp_path):
    cfg = load_config(odd_vocabulary_job(tmp_path), plan(2))
    assert cfg.model.vocab_size == 21 and cfg.plan.actor.gen.tp == 2  # refused before: 2 does not divide 21
    with open(Path(cfg.model.path) / "config.json") as f:
        assert json.load(f)["vocab_size"] == 21
    results = run_layouts(cfg, [plan(1), plan(2)])
    one, two = results
    assert "tp: 2" in two.plan[0]
    assert {"actor/loss", "actor/grad_norm", "kl"} <= set(one.metrics)
    assert one.metrics["actor/loss"] != 0.0
    vocab = [k for k in one.state if "lm_head" in k or "embed_tokens" in k]
    assert {state_kind(k) for k in vocab} == {"param", "exp_avg", "exp_avg_sq", "step"}
    assert all(one.state[k].shape[0] == 21 for k in vocab if state_kind(k) != "step")  # the real V, gathered
    for plan_name, worst in compare(results).items():
        for kind, (err, where) in worst.items():
            assert err <= 1e-10, f"{plan_name}: {kind} differs by {err:.2e} at {where}"
