"""One training step on gloo processes: a NaN anywhere stops it before any optimizer steps,
and bf16 compute keeps float32 master weights that a tiny learning rate still moves."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.distributed_harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY_PPO = os.path.join(ROOT, "configs", "tiny_ppo.yaml")


def _state(trainer) -> dict[str, np.ndarray]:
    """This rank's parameters and AdamW state of every training stage (copies)."""
    return {
        f"{key}/{name}": t.detach().clone().float().numpy()
        for key, stage in trainer.stages.items() if key.endswith(".train") and stage.member
        for name, t in stage.buffers().items()
    }


def _poisoned_step(rank: int, world: int, overrides: list[str], poisoned: int, where: str) -> dict:
    """One step with a non-finite value on rank ``poisoned`` only: ``"loss"``, the actor's
    loss of its first micro-batch (mini-batch 1); ``"grad"``, the critic's gradient of one
    parameter once mini-batch 1 has stepped (mini-batch 2; the loss stays finite)."""
    from nereus.trainer.algos import ppo
    from nereus.trainer.prepare import load_config
    from nereus.trainer.runtime.step import Trainer

    trainer = Trainer(load_config(TINY_PPO, overrides))
    before = _state(trainer)
    if rank == poisoned and where == "loss":
        real, calls = ppo.policy_loss, []

        def poison(*args, **kwargs):
            loss, sums = real(*args, **kwargs)
            calls.append(1)
            return (loss * float("nan"), sums) if len(calls) == 1 else (loss, sums)

        ppo.policy_loss = poison
    if rank == poisoned and where == "grad":
        critic = trainer.stages["critic.train"]
        param = next(critic.part.module.parameters())
        stepped = lambda: float(critic.optimizer.state[param]["step"]) >= 1  # noqa: E731
        param.register_hook(lambda g: g * float("inf") if stepped() else g)
    try:
        trainer.run_step()
        error = None
    except FloatingPointError as e:
        error = str(e)
    after = _state(trainer)
    steps = {float(v) for k, v in after.items() if "/optim/step/" in k}
    unchanged = all(np.array_equal(before[k], after[k]) for k in before)
    return {"error": error, "unchanged": unchanged, "optimizer_steps": steps, "step": trainer.step, "tensors": len(before)}


# 24 rollouts; mini-batches of 8 rows, one epoch: 3 mini-batches
THREE_MINIBATCHES = ["rollout.prompts_per_step=6", "ppo.minibatch_size=8", "ppo.epochs=1"]


@pytest.mark.timeout(300)
def test_nan_in_the_first_of_three_minibatches_on_one_rank_stops_every_rank_before_any_step(tmp_path):
    overrides = [*THREE_MINIBATCHES, f"run_dir={tmp_path}", "plan.actor.train.dp=4", "plan.actor.train.tp=1"]
    results = run_distributed(_poisoned_step, 4, overrides, 1, "loss", timeout=240)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} did not stop"
        assert "step 1, mini-batch 1 of 3" in r["error"] and "actor (rank" in r["error"], r["error"]
        assert "no optimizer stepped" in r["error"]
        assert r["unchanged"] and r["tensors"] > 0, f"rank {rank}: parameters or AdamW state changed"
        assert r["optimizer_steps"] == {0.0} and r["step"] == 0
    assert len({r["error"] for r in results}) == 1, "every rank must report the same error"


@pytest.mark.timeout(300)
def test_an_infinite_gradient_in_the_second_minibatch_stops_before_its_step(tmp_path):
    """Only a gradient, only on rank 3, only in mini-batch 2, of a pipelined critic: mini-batch
    1 has stepped both models, mini-batch 2 steps neither."""
    overrides = [*THREE_MINIBATCHES, f"run_dir={tmp_path}", "plan.critic.train.dp=2", "plan.critic.train.pp=2",
                 "plan.critic.train.dp_shard=false"]
    results = run_distributed(_poisoned_step, 4, overrides, 3, "grad", timeout=240)
    for rank, r in enumerate(results):
        assert r["error"] is not None and "step 1, mini-batch 2 of 3" in r["error"], (rank, r["error"])
        assert "critic (rank" in r["error"] and "actor" not in r["error"], r["error"]
        assert r["optimizer_steps"] == {1.0}, f"rank {rank}: optimizer steps {r['optimizer_steps']}"
    assert len({r["error"] for r in results}) == 1


def _bf16_step(rank: int, world: int, overrides: list[str]) -> dict:
    from nereus.reshard.gather import gather_full
    from nereus.trainer.prepare import load_config
    from nereus.trainer.runtime.step import Trainer

    trainer = Trainer(load_config(TINY_PPO, overrides))
    train = {k: s for k, s in trainer.stages.items() if k.endswith(".train")}
    before = {k: gather_full(s.emus, s.buffers(), rank) for k, s in train.items()}
    outputs = set()  # what the training stages' forwards compute in: their logits and values
    for key, stage in train.items():
        stage.part.module.register_forward_hook(lambda _m, _a, out, key=key: outputs.add((key, str(out.dtype))))
    trainer.run_step()
    after = {k: gather_full(s.emus, s.buffers(), rank) for k, s in train.items()}
    gen = trainer.stages["actor.gen"]
    trainer.syncs[0]()  # the step's weights, cast to bf16 in the reshard copy
    synced_after = gather_full(gen.emus, gen.param_buffers(), rank)
    if rank != 0:
        return {}
    out = {"dtypes": {}, "changed": {}, "bf16_would_change": {}, "sync": None, "outputs": outputs}
    for key in train:
        for name, t in after[key].items():
            out["dtypes"][f"{key}/{name}"] = str(t.dtype)
            if name.startswith("optim/"):
                continue
            g = after[key][f"optim/exp_avg/{name}"]  # (1 − β1)·g after one step: g ≠ 0 where it is ≠ 0
            moved = g.abs() > 1e-6 * float(g.abs().max())  # Adam moves these by ≈ lr (g ≫ ε)
            old, new = before[key][name], t
            out["changed"][f"{key}/{name}"] = (int((new[moved] != old[moved]).sum()), int(moved.sum()))
            held = old[moved].bfloat16()  # the same update applied to bf16 weights, in bf16
            out["bf16_would_change"][f"{key}/{name}"] = int((held + (new[moved] - old[moved]).bfloat16() != held).sum())
    out["gen_dtypes"] = {str(t.dtype) for t in synced_after.values()}
    out["sync"] = all(torch.equal(synced_after[n], after["actor.train"][n].bfloat16()) for n in synced_after)
    return out


@pytest.mark.timeout(300)
def test_bf16_training_keeps_float32_masters_that_a_1e_6_step_moves(tmp_path):
    overrides = [
        "nproc=2", "model.dtype=bfloat16", "ppo.lr=1e-6", "ppo.critic_lr=1e-6", "ppo.epochs=1", "ppo.minibatch_size=16",
        "rollout.prompts_per_step=4", f"run_dir={tmp_path}",
        "plan.actor.train.dp=2", "plan.actor.train.tp=1", "plan.actor.train.dp_shard=true",  # FSDP2's mixed precision
        "plan.critic.train.dp=1", "plan.critic.train.tp=2", "plan.critic.train.dp_shard=false",  # casts in the model
        "plan.critic.infer.dp=2", "plan.critic.infer.tp=1", "plan.ref.infer.dp=2", "plan.ref.infer.tp=1",
        "plan.actor.gen.dp=1", "plan.actor.gen.tp=2",
    ]
    r = run_distributed(_bf16_step, 2, overrides, timeout=240)[0]
    assert set(r["dtypes"].values()) == {"torch.float32"}, "masters and AdamW state are float32"
    assert r["outputs"] == {("actor.train", "torch.bfloat16"), ("critic.train", "torch.bfloat16")}, "the forward computes in bf16"
    for name, (changed, moved) in r["changed"].items():
        assert moved > 0 and changed == moved, f"{name}: {changed} of {moved} elements with a gradient moved"
    # what bf16 weights would have kept of that update: almost nothing
    assert sum(r["bf16_would_change"].values()) < 0.01 * sum(m for _, m in r["changed"].values())
    assert r["gen_dtypes"] == {"torch.bfloat16"} and r["sync"], "the weight sync casts the masters to bf16 exactly"
