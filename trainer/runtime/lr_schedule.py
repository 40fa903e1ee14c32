"""Learning-rate schedules: the LR as a pure function of the optimizer step.

Counted in optimizer steps: each RL step takes E·M of them per trained model (E epochs of
M mini-batches, ``JobConfig.optimizer_steps_per_step``), so a run of S steps takes
T = S·E·M. With W warmup steps, the update with index s = 0, 1, …, T−1 (s updates were
taken before it) uses lr · f(s):

    warmup    s < W:  f = (s + 1) / (W + 1)            (never 0: the first update moves)
    decay     s ≥ W:  p = min(1, (s − W) / max(1, T − W − 1))
              constant  f = 1
              linear    f = 1 − (1 − m)·p
              cosine    f = m + (1 − m)·½(1 + cos πp)

with m = ``min_lr_ratio``: the peak at the first update after the warmup, the floor m·lr at
the last update of the run (and after it, should the run be extended). W is ``warmup_steps``
or ⌊``warmup_ratio``·T⌋.

State: the schedule has none of its own. Its position s is AdamW's step count
(``optim/step/<param>``), which every checkpoint saves and every plan transition reshards
with the rest of the optimizer state; ``attach`` builds torch's ``LambdaLR`` at that position
(``last_epoch = s − 1``), so the LR after a resume or a transition is exactly the LR the
uninterrupted run would use. Shortcut: the shape (T, W) comes from the config, so resuming
with a different ``steps`` stretches the decay from there on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import warmup_from_ratio

if TYPE_CHECKING:
    import torch

    from ..config import JobConfig


@dataclass(frozen=True, kw_only=True)  # no slots: LambdaLR.state_dict copies a callable's __dict__
class LRSchedule:
    """f(s) of the module docstring; ``total`` = T, ``warmup`` = W."""

    total: int
    warmup: int = 0
    decay: str = "constant"
    min_lr_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        return lr_factor(step, total=self.total, warmup=self.warmup, decay=self.decay, min_lr_ratio=self.min_lr_ratio)


def lr_factor(step: int, *, total: int, warmup: int = 0, decay: str = "constant", min_lr_ratio: float = 0.0) -> float:
    """The factor f(s) of the module docstring for the update with index ``step``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay == "constant":
        return 1.0
    p = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    if decay == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * p
    if decay == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"decay must be constant, linear or cosine; got {decay!r}")


def plan_schedule(cfg: JobConfig, stage: str) -> LRSchedule:
    """The schedule of a training model-stage (``actor.train``, ``critic.train``); pure."""
    section = getattr(cfg.algo_hp, cfg.algo_hp.optimizers()[stage][1])
    total = cfg.steps * cfg.optimizer_steps_per_step
    warmup = section.warmup_steps if section.warmup_steps is not None else warmup_from_ratio(section.warmup_ratio, total)
    return LRSchedule(total=total, warmup=warmup, decay=section.decay, min_lr_ratio=section.min_lr_ratio)


def optimizer_step_count(optimizer: torch.optim.Optimizer) -> int:
    """Updates this optimizer has taken: AdamW's ``step`` state, the largest over its
    parameters (all equal once every one has stepped; a parameter whose local shard is empty
    holds no state worth trusting); 0 before the first update."""
    steps = [state["step"] for state in optimizer.state.values() if "step" in state]
    return max((int(s.to_local() if hasattr(s, "to_local") else s) for s in steps), default=0)


def attach(optimizer: torch.optim.Optimizer, schedule: LRSchedule, lr: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` of base ``lr`` positioned at the optimizer's own step count: its
    groups' ``lr`` become lr · f(s), the LR of the next update. Call it again whenever that
    count was set from outside (a checkpoint loaded, state resharded into a new layout)."""
    from torch.optim.lr_scheduler import LambdaLR

    done = optimizer_step_count(optimizer)
    for group in optimizer.param_groups:
        group["initial_lr"] = lr
    return LambdaLR(optimizer, schedule, last_epoch=done - 1)
