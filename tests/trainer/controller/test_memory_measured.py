"""The memory model against what the stages really allocate (``trainer.memtrace``), and the
logits that stay sharded over the vocabulary under TP."""

from __future__ import annotations

import os

import pytest
import torch

from nereus.trainer.controller.memory import HEADROOM, logits_bytes
from nereus.trainer.metrics.memtrace import tensor_peak
from tests.distributed_harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY_PPO = os.path.join(ROOT, "configs", "tiny_ppo.yaml")

# A vocabulary large enough that logits dominate: 32 rows × 32 tokens × 4096 / tp2 columns.
OVERRIDES = [
    "nproc=2", "model.vocab_size=4096", "model.max_seq_len=32", "rollout.max_new_tokens=27",
    "rollout.prompts_per_step=8", "ppo.minibatch_size=32", "ppo.epochs=1",
    "plan.actor.train.dp=1", "plan.actor.train.tp=2", "plan.actor.gen.dp=2", "plan.actor.gen.tp=1",
    "plan.critic.train.dp=2", "plan.critic.train.tp=1", "plan.critic.train.dp_shard=true",
    "plan.critic.infer.dp=1", "plan.critic.infer.tp=2", "plan.ref.infer.dp=1", "plan.ref.infer.tp=2",
]


def test_tensor_peak_counts_what_is_alive_at_once():
    x = torch.randn(1000, 1000)
    with tensor_peak() as peak:
        a = x @ x  # 4 MB
        b = torch.exp(a)  # 4 MB
        del a
        c = torch.empty(3_000_000)  # 12 MB beside b
        del c, x  # x existed before: freeing it lowers the count, it was never counted up
    assert peak.bytes == 16_000_000
    assert b.shape == (1000, 1000)


def _measure(rank: int, world: int, overrides: list[str]) -> dict:
    import nereus.trainer.runtime.step as loop
    from nereus.trainer.prepare import load_config
    from nereus.trainer.controller.memory import plan_memory
    from nereus.trainer.runtime.stages import infer

    cfg = load_config(TINY_PPO, overrides)
    trainer = loop.Trainer(cfg)
    trainer.run_step()  # gradients and AdamW state exist from here on: resident, not transient
    batch, _ = trainer._rollout()
    measured = {}
    with tensor_peak() as peak:
        infer(trainer.stages["ref.infer"], batch, "logprobs")
    measured["ref.infer"] = peak.bytes
    real = loop.backward_minibatch

    def traced(stage, *args, **kwargs):
        with tensor_peak() as p:
            out = real(stage, *args, **kwargs)
        measured[stage.key] = p.bytes
        return out

    loop.backward_minibatch = traced
    trainer.run_step()
    loop.backward_minibatch = real
    predicted = {s.stage: s.transient for s in plan_memory(cfg)[rank]}
    return {"measured": measured, "predicted": predicted, "shape": tuple(batch["input_ids"].shape)}


# the actor's update under full recompute, the critic's in packs of at most 8 rows' worth of
# tokens; a small vocabulary and a wide MLP, so that the blocks' activations, not the logits,
# peak. Measured within 5% of the model either way (the actor's peak varies ~6% between runs):
# bounded by the model with its 10% headroom. Without the recomputed block's gradient
# temporaries the model was 27% under the actor's peak.
RECOMPUTE_AND_PACKS = ["plan.actor.train.recompute=full", "plan.critic.train.micro_batch_tokens=256",
                       "model.vocab_size=64", "model.num_layers=4", "model.intermediate_size=768"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype, extra, slack", [("float32", [], 1.0), ("bfloat16", [], 1.0), ("float32", RECOMPUTE_AND_PACKS, HEADROOM)],
                         ids=["float32", "bfloat16", "recompute-packed"])
def test_the_memory_model_bounds_the_measured_peak_of_each_stage(tmp_path, dtype, extra, slack):
    results = run_distributed(_measure, 2, [*OVERRIDES, *extra, f"model.dtype={dtype}", f"run_dir={tmp_path}"], timeout=240)
    b, t, v = 32, 32, 4096
    for rank, r in enumerate(results):
        assert r["shape"] == (b, t)
        for stage in ("ref.infer", "actor.train", "critic.train"):  # TP inference, TP training, FSDP training
            got, want = r["measured"][stage], r["predicted"][stage]
            assert 0.7 * want <= got <= slack * want, f"rank {rank} {stage}: measured {got / 2**20:.2f} MiB, model {want / 2**20:.2f} MiB"
        # Vocabulary-parallel: each rank holds its 2,048 columns only; the logits of the whole
        # vocabulary, with their float32 copy and softmax, would be this much alone:
        whole = b * t * v * logits_bytes(dtype, 1.0)
        assert r["measured"]["ref.infer"] < 0.6 * whole
