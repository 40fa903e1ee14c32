"""LR schedules: the LR of every optimizer step against the closed form, and its exact
continuation after a restore (checkpoint, resume) and a plan transition."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from nereus.trainer.config import ConfigError
from nereus.trainer.prepare import load_config
from nereus.trainer.runtime.lr_schedule import LRSchedule, attach, optimizer_step_count, plan_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY_PPO = os.path.join(ROOT, "configs", "tiny_ppo.yaml")
TINY_GRPO = os.path.join(ROOT, "configs", "tiny_grpo.yaml")


def closed_form(s: int, *, lr: float, total: int, warmup: int, decay: str, floor: float) -> float:
    """The module docstring's f, written out again here (not trainer/runtime/lr_schedule.py's code)."""
    if s < warmup:
        return lr * ((s + 1) / (warmup + 1))
    if decay == "constant":
        return lr * 1.0
    p = min(1.0, (s - warmup) / max(1, total - warmup - 1))
    shape = 1.0 - (1.0 - floor) * p if decay == "linear" else floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
    return lr * shape


def adamw(lr: float) -> torch.optim.AdamW:
    torch.manual_seed(0)
    return torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], lr=lr, weight_decay=0.0, foreach=False)


def drive(opt, sched, steps: int) -> list[float]:
    """The LR each of ``steps`` updates used."""
    used = []
    for _ in range(steps):
        opt.param_groups[0]["params"][0].grad = torch.ones(3)
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return used


@pytest.mark.parametrize("decay", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_the_lr_of_every_optimizer_step_is_the_closed_form(decay, warmup):
    total, lr, floor = 30, 3e-4, 0.1
    opt = adamw(lr)
    sched = attach(opt, LRSchedule(total=total, warmup=warmup, decay=decay, min_lr_ratio=floor), lr)
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    used = drive(opt, sched, total + 3)  # and past the run's end: it stays at the floor
    want = [closed_form(s, lr=lr, total=total, warmup=warmup, decay=decay, floor=floor) for s in range(total + 3)]
    assert used == want  # exact: both are lr * f(s) in float64
    assert used[0] == lr / (warmup + 1) and used[warmup] == lr  # the first update moves; the peak follows the warmup
    assert used[total - 1] == pytest.approx(lr if decay == "constant" else floor * lr, rel=1e-12)
    assert optimizer_step_count(opt) == total + 3


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_a_restored_optimizer_continues_the_curve_exactly(decay):
    """An optimizer loaded with saved state (AdamW's step among it), then attached, uses the
    LR the uninterrupted one uses, at every step after the restore."""
    total, lr, cut = 24, 1e-3, 9
    schedule = LRSchedule(total=total, warmup=4, decay=decay, min_lr_ratio=0.05)
    whole = adamw(lr)
    uninterrupted = drive(whole, attach(whole, schedule, lr), total)
    first = adamw(lr)
    drive(first, attach(first, schedule, lr), cut)
    restored = adamw(lr)
    restored.load_state_dict(first.state_dict())
    restored.param_groups[0]["lr"] = lr  # as make_optimizer leaves it: the config's lr
    assert drive(restored, attach(restored, schedule, lr), total - cut) == uninterrupted[cut:]
    attach(restored, schedule, lr)  # attaching twice changes nothing
    assert restored.param_groups[0]["lr"] == schedule(total) * lr


def test_the_schedule_counts_the_runs_optimizer_steps():
    cfg = load_config(TINY_PPO, ["steps=10", "ppo.epochs=3", "ppo.minibatch_size=64",
                                 "ppo.lr_schedule.warmup_ratio=0.25", "ppo.lr_schedule.decay=cosine",
                                 "ppo.critic_lr_schedule.warmup_steps=5", "ppo.critic_lr_schedule.decay=linear"])
    assert cfg.optimizer_steps_per_step == 3 * (256 // 64)
    assert plan_schedule(cfg, "actor.train") == LRSchedule(total=120, warmup=30, decay="cosine", min_lr_ratio=0.0)
    assert plan_schedule(cfg, "critic.train") == LRSchedule(total=120, warmup=5, decay="linear", min_lr_ratio=0.0)
    grpo = load_config(TINY_GRPO, ["grpo.lr_schedule.warmup_ratio=0.1"])
    k = grpo.optimizer_steps_per_step
    assert plan_schedule(grpo, "actor.train").warmup == int(0.1 * grpo.steps * k)


@pytest.mark.parametrize("overrides, message", [
    (["ppo.lr_schedule.warmup_steps=3", "ppo.lr_schedule.warmup_ratio=0.1"],
     "config section 'ppo.lr_schedule' sets both warmup_steps=3 and warmup_ratio=0.1: keep one"),
    (["ppo.lr_schedule.warmup_steps=160"],
     "config key 'ppo.lr_schedule': warmup_steps=160 is not shorter than the run's 160 optimizer steps (steps=40 × 4 per step"),
    (["ppo.critic_lr_schedule.warmup_steps=-1"], "config key 'ppo.critic_lr_schedule.warmup_steps' must be >= 0, got -1"),
    (["ppo.lr_schedule.warmup_ratio=1"], "config key 'ppo.lr_schedule.warmup_ratio' must be in [0, 1), got 1.0"),
    (["ppo.lr_schedule.min_lr_ratio=1.5"], "config key 'ppo.lr_schedule.min_lr_ratio' must be in [0, 1], got 1.5"),
    (["ppo.lr_schedule.decay=exponential"], "config key 'ppo.lr_schedule.decay' must be one of 'constant', 'linear', 'cosine'"),
    (["ppo.lr_schedule.warmup=3"], "unknown key 'ppo.lr_schedule.warmup' (did you mean 'ppo.lr_schedule.warmup_steps'?)"),
])
def test_bad_schedules_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY_PPO, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ in the trainer

SMALL_JOB = ["steps=4", "rollout.prompts_per_step=8", "ppo.minibatch_size=16", "device=cpu"]  # 4 updates per step
SCHEDULE = ["ppo.lr_schedule.warmup_steps=3", "ppo.lr_schedule.decay=cosine", "ppo.lr_schedule.min_lr_ratio=0.1",
            "ppo.critic_lr_schedule.warmup_ratio=0.25", "ppo.critic_lr_schedule.decay=linear"]


def _shape(cfg, model: str) -> dict:
    s = plan_schedule(cfg, f"{model}.train")
    return {"lr": cfg.ppo.lr if model == "actor" else cfg.ppo.critic_lr, "total": s.total, "warmup": s.warmup,
            "decay": s.decay, "floor": s.min_lr_ratio}


def expected(cfg, model: str, step: int) -> float:
    """The LR of RL step ``step``'s last update (what ``<model>/lr`` logs)."""
    return closed_form(step * cfg.optimizer_steps_per_step - 1, **_shape(cfg, model))


def _transition(rank: int, world: int, run_dir: str) -> dict:
    from nereus.trainer.config import StageConfig
    from nereus.trainer.runtime.step import Trainer

    cfg = load_config(TINY_PPO, [*SMALL_JOB, f"run_dir={run_dir}", *SCHEDULE])
    trainer = Trainer(cfg)
    logged = [trainer.run_step()]
    p = cfg.plan
    moved = dataclasses.replace(p, actor=dataclasses.replace(p.actor, train=StageConfig(tp=2, pp=2)),
                                critic=dataclasses.replace(p.critic, train=StageConfig(dp=2, tp=2)))
    trainer.apply_plan(moved)
    actor, critic = trainer.stages["actor.train"], trainer.stages["critic.train"]
    next_lr = {m: s.optimizer.param_groups[0]["lr"] for m, s in (("actor", actor), ("critic", critic)) if s.optimizer is not None}
    logged.append(trainer.run_step())
    trainer.apply_plan(p)  # and back
    logged += [trainer.run_step(), trainer.run_step()]
    counts = {m: optimizer_step_count(s.optimizer) for m, s in trainer.stages.items() if s.optimizer is not None}
    return {"logged": [{k: m[k] for k in ("actor/lr", "critic/lr")} for m in logged], "next_lr": next_lr,
            "counts": counts, "state": trainer.extra_state["lr_schedule"]}


@pytest.mark.timeout(300)
def test_the_lr_continues_exactly_through_plan_transitions(tmp_path):
    from tests.distributed_harness import run_distributed

    cfg = load_config(TINY_PPO, [*SMALL_JOB, *SCHEDULE])
    k = cfg.optimizer_steps_per_step
    results = run_distributed(_transition, 4, str(tmp_path), timeout=280)
    for rank, r in enumerate(results):
        assert r["logged"] == [{"actor/lr": expected(cfg, "actor", s), "critic/lr": expected(cfg, "critic", s)} for s in (1, 2, 3, 4)], rank
        # right after the move, before any update: the new layout's optimizers are at update k
        for model, lr in r["next_lr"].items():
            assert lr == closed_form(k, **_shape(cfg, model)), (rank, model)
        assert r["counts"] == {"actor.train": 4 * k, "critic.train": 4 * k}, rank  # AdamW's step: the schedule's position
        assert r["state"] == {m: {"optimizer_steps": 4 * k, "lr": closed_form(4 * k, **_shape(cfg, m))} for m in ("actor", "critic")}


TWO_PROCESSES = ["nproc=2", "plan.actor.train.dp=2", "plan.actor.train.tp=1", "plan.actor.gen.dp=2", "plan.critic.train.dp=2",
                 "plan.critic.infer.dp=2", "plan.critic.infer.tp=1", "plan.ref.infer.dp=2", "plan.ref.infer.tp=1"]
ONE_PROCESS = ["nproc=1", "plan.actor.train.dp=1", "plan.actor.train.tp=1", "plan.actor.gen.dp=1", "plan.critic.train.dp=1",
               "plan.critic.infer.dp=1", "plan.critic.infer.tp=1", "plan.ref.infer.dp=1", "plan.ref.infer.tp=1"]


def _attempt(rank: int, world: int, run_dir: str, plan: list[str], steps: int, resume: bool) -> dict:
    """``steps`` steps of one 4-step job in ``plan``, after restoring its checkpoint when
    ``resume``; then a checkpoint."""
    from nereus.trainer.runtime.step import Trainer

    cfg = load_config(TINY_PPO, [*plan, *SMALL_JOB, f"run_dir={run_dir}", *SCHEDULE])
    trainer = Trainer(cfg)
    first = trainer.restore() if resume else 0
    logged = [trainer.run_step() for _ in range(steps)]
    trainer.save()
    return {"first": first, "logged": [(m["step"], m["actor/lr"], m["critic/lr"]) for m in logged]}


@pytest.mark.timeout(300)
def test_the_lr_continues_exactly_after_a_restore_on_another_world_size(tmp_path):
    """Two steps on 2 processes, checkpoint; restored on 1 process (another layout of every
    optimizer), two more: the LR of every step is the uninterrupted run's closed form."""
    from nereus.store.checkpoint import CheckpointStore
    from tests.distributed_harness import run_distributed

    cfg = load_config(TINY_PPO, [*SMALL_JOB, *SCHEDULE])
    k = cfg.optimizer_steps_per_step
    before = run_distributed(_attempt, 2, str(tmp_path), TWO_PROCESSES, 2, False, timeout=240)
    saved = CheckpointStore(str(tmp_path / "checkpoints")).manifest(2).state["lr_schedule"]
    assert {m: v["optimizer_steps"] for m, v in saved.items()} == {"actor": 2 * k, "critic": 2 * k}
    assert saved["actor"]["lr"] == closed_form(2 * k, **_shape(cfg, "actor"))  # the next update's
    after = run_distributed(_attempt, 1, str(tmp_path), ONE_PROCESS, 2, True, timeout=240)
    assert after[0]["first"] == 2
    logged = before[0]["logged"] + after[0]["logged"]
    assert logged == [(s, expected(cfg, "actor", s), expected(cfg, "critic", s)) for s in (1, 2, 3, 4)]
    assert before[1]["logged"] == before[0]["logged"]  # every rank logs the same



def test_a_schedule_that_cannot_decay_or_a_floor_without_decay_is_refused():
    from nereus.trainer.config import ConfigError
    from nereus.trainer.prepare import load_config
    from nereus.trainer.runtime.lr_schedule import warmup_from_ratio

    assert warmup_from_ratio(0.29, 100) == 29
    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "configs", "tiny_grpo.yaml")
    total = 40 * 4  # tiny_grpo: 40 steps × 2 epochs × 2 mini-batches
    with pytest.raises(ConfigError, match=r"leaves no update to decay over"):
        load_config(tiny, [f"grpo.lr_schedule.warmup_steps={total - 1}", "grpo.lr_schedule.decay=cosine"])
    with pytest.raises(ConfigError, match=r"min_lr_ratio'=0.1 has no effect with decay: constant"):
        load_config(tiny, ["grpo.lr_schedule.min_lr_ratio=0.1"])
    load_config(tiny, [f"grpo.lr_schedule.warmup_steps={total - 2}", "grpo.lr_schedule.decay=cosine"])
