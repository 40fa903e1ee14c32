"""The step-time model's features, against the operation counts stated by hand (pure)."""

import dataclasses
from pathlib import Path

import pytest
from nereus.trainer.config.names import ACTOR_GEN
from nereus.trainer.controller.candidates import kept_of
from nereus.trainer.controller.profiles import load_profile
from nereus.trainer.controller.steptime import Placement, candidate_features
from nereus.trainer.controller.workload import Workload
from nereus.trainer.prepare import load_config

MODELS = Path(__file__).resolve().parents[3] / "configs" / "simulate" / "models"


def test_a_small_all_reduce_across_nodes_is_priced_as_a_tree_where_that_beats_a_ring():
    """Decoding's TP all-reduces are small: NCCL runs them as a chain within each node and a
    tree across nodes (2(g−1) intra hops, 2⌈log₂ k⌉ inter ones) where that beats a ring over
    the slowest link (2(n−1) inter hops). Llama-3.3-70B's generation at tp 8 (one MI250X
    node of 8 GCDs) and tp 16 (two): per decode step and the prefill, 2·80 + 1 all-reduces
    and one gather of the logits ((t − 1) hops of the group's slowest link)."""
    profile = load_profile("mi250x")
    intra, inter = profile.links["intra"].latency, profile.links["inter"].latency
    cfg = load_config({"nproc": 32, "device_profile": "mi250x", "run_dir": "unused", "algorithm": "grpo",
                       "model": {"path": str(MODELS / "llama-3.3-70b"), "dtype": "bfloat16", "max_seq_len": 2048},
                       "data": {"train_files": ["unused"], "max_prompt_length": 1024},
                       "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 1000},
                       "plan": {"actor": {"train": {"dp": 2, "tp": 16}, "gen": {"dp": 2, "tp": 16}}, "ref": {"infer": {"dp": 2, "tp": 16}}}})
    work = Workload.from_config(cfg).at(1000, 500.0)
    where = Placement(nproc=cfg.nproc, profile=profile)
    reduces, steps = 2 * 80 + 1, 1 + 1000
    for tp, per_reduce, gather in ((8, 2 * 7 * intra, 7 * intra), (16, 2 * 7 * intra + 2 * 1 * inter, 15 * inter)):
        sc = dataclasses.replace(cfg.plan.actor.gen, dp=32 // tp, tp=tp)
        f = candidate_features(cfg, ACTOR_GEN, kept_of((sc,)), work, where)
        assert f["comm_latency"][0] == pytest.approx(steps * (reduces * per_reduce + gather), rel=1e-12)
    assert 2 * 7 * intra + 2 * inter < 2 * 15 * inter  # the tree is the cheaper one at 16
