"""A plan transition inside a running job: the state after it equals the state before, element
for element; a transition that fails on one rank leaves the old plan running, intact."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from tests.distributed_harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY_PPO = os.path.join(ROOT, "configs", "tiny_ppo.yaml")
SMALL = ["rollout.prompts_per_step=8", "ppo.minibatch_size=16", "checkpoint_every=0"]


def _state(trainer, rank) -> dict[str, np.ndarray]:
    from nereus.reshard.gather import gather_full

    out = {}
    for key, stage in trainer.stages.items():
        full = gather_full(stage.emus, stage.buffers(), rank)
        out.update({f"{key}/{n}": t.numpy() for n, t in (full or {}).items()})
    return out


def _new_plan(cfg):
    from nereus.trainer.config import StageConfig

    p = cfg.plan
    return dataclasses.replace(
        p,
        actor=dataclasses.replace(p.actor, train=StageConfig(tp=2, pp=2), gen=StageConfig(dp=2, tp=2)),
        critic=dataclasses.replace(p.critic, train=StageConfig(dp=2, tp=2), infer=StageConfig(dp=4)),
        ref=dataclasses.replace(p.ref, infer=StageConfig(dp=1, tp=2, pp=2)),
    )


def _transition(rank: int, world: int, run_dir: str, fail_on: int | None) -> dict:
    import nereus.trainer.runtime.step as loop
    import nereus.trainer.runtime.transition as transition
    from nereus.trainer.prepare import load_config

    cfg = load_config(TINY_PPO, [*SMALL, f"run_dir={run_dir}"])
    trainer = loop.Trainer(cfg)
    trainer.run_step()  # AdamW state is no longer zero
    before = _state(trainer, rank)
    old_plan = trainer.cfg.plan
    error = None
    if fail_on is not None and rank == fail_on:
        real = transition.make_optimizer

        def broken(stage, lr):
            raise MemoryError("no room for the new AdamW state")

        transition.make_optimizer = broken
    try:
        done = trainer.apply_plan(_new_plan(cfg))
    except RuntimeError as e:
        error, done = str(e), None
    if fail_on is not None and rank == fail_on:
        transition.make_optimizer = real
    after = _state(trainer, rank)
    metrics = trainer.run_step()  # the job goes on, in whichever plan it is in
    plan_kept, back = trainer.cfg.plan == old_plan, None
    if fail_on is None:  # and back: the old layout's groups were released on every rank alike
        before_back = _state(trainer, rank)
        trainer.apply_plan(old_plan)
        after_back = _state(trainer, rank)
        back = {"equal": rank != 0 or all(np.array_equal(before_back[k], after_back[k]) for k in before_back),
                "loss": trainer.run_step()["actor/loss"], "plan_back": trainer.cfg.plan == old_plan}
    return {
        "before": before if rank == 0 else None, "after": after if rank == 0 else None, "error": error, "done": done,
        "plan_kept": plan_kept, "loss": metrics["actor/loss"], "back": back,
    }


@pytest.mark.timeout(300)
def test_every_parameter_and_adamw_tensor_survives_a_transition_exactly(tmp_path):
    results = run_distributed(_transition, 4, str(tmp_path), None, timeout=240)
    r = results[0]
    assert r["error"] is None and not r["plan_kept"]
    assert sorted(r["done"]["stages"]) == ["actor.gen", "actor.train", "critic.infer", "critic.train", "ref.infer"]
    before, after = r["before"], r["after"]
    trained = [k for k in before if k.startswith(("actor.train/", "critic.train/"))]
    assert any("/optim/exp_avg/" in k for k in trained) and set(after) == set(before)
    for key in before:
        assert before[key].dtype == after[key].dtype and np.array_equal(before[key], after[key]), key
    assert np.isfinite(r["loss"])
    for rank, other in enumerate(results):  # a second transition, back to the first plan
        assert other["back"]["plan_back"] and other["back"]["equal"] and np.isfinite(other["back"]["loss"]), rank


@pytest.mark.timeout(300)
def test_a_transition_that_fails_on_one_rank_leaves_the_old_plan_running(tmp_path):
    results = run_distributed(_transition, 4, str(tmp_path), 2, timeout=240)
    for rank, r in enumerate(results):
        assert r["error"] is not None and "refused before any state moved" in r["error"], (rank, r["error"])
        assert r["plan_kept"], rank
    assert "rank 2: MemoryError: no room for the new AdamW state" in results[2]["error"]
    before, after = results[0]["before"], results[0]["after"]
    for key in before:
        assert np.array_equal(before[key], after[key]), key
