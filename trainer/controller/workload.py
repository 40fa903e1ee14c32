"""What one step asks of the model-stages: rows, prompt and response lengths (pure).

A step samples ``batch`` responses (prompts × samples per prompt), ``prompt`` tokens each,
and the batch is as wide as its longest response (``response_max``: the trainer trims the
padding columns no response reached), ``response_mean`` tokens long on average, with mean
square ``response_sq_mean`` (what decoding through a KV cache costs: a row of ℓ tokens
attends over Σ_s (P + s) ≈ P·ℓ + ℓ²/2 cached tokens, and a stopped row leaves the batch).
Training runs ``epochs`` passes over mini-batches of ``minibatch`` rows.

``Workload.from_config`` is the planner's view before any step (responses as long as
``rollout.max_new_tokens``, or, at a given step of a length curriculum, as that step's cap);
``Workload.observed`` the controller's, from recorded steps:
the last step's lengths, extrapolated by their recent trend (a robust slope over the last 30
steps) and capped by the config, so that a plan is chosen for the steps about to run, not the
one just done; the mean square keeps the last step's shape (``sq_shape``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..config import JobConfig

TREND_WINDOW = 30
"""Steps the length forecast fits its trend on (``Workload.observed``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    batch: int
    prompt: int
    response_max: int
    response_mean: float
    minibatch: int
    epochs: int
    prompt_mean: float | None = None
    """Real prompt tokens of a row on average (None: ``prompt``, every prompt as long as the longest)."""
    response_sq_mean: float | None = None
    """E[ℓ²] of a response's length ℓ (None: unknown, priced at its bound ``response_mean ·
    response_max``, which is ``response_max²`` when every row is as long as the longest)."""

    @property
    def sq_mean(self) -> float:
        """E[ℓ²]: measured, or its upper bound from the mean and the longest (ℓ ≤ M: ℓ² ≤ M·ℓ)."""
        bound = self.response_mean * self.response_max
        return bound if self.response_sq_mean is None else min(self.response_sq_mean, bound)

    @property
    def sq_shape(self) -> float:
        """E[ℓ²] ÷ (mean · longest), in (0, 1]: how much of the longest row's decoding the
        other rows share (1: every row as long as the longest)."""
        bound = self.response_mean * self.response_max
        return self.sq_mean / bound if bound > 0 else 1.0

    @property
    def width(self) -> int:
        """Tokens per row of the step's batch."""
        return self.prompt + self.response_max

    @property
    def row_mean(self) -> float:
        """Real tokens of a row on average (what packing runs: ``candidates.micro_batching``)."""
        return (self.prompt if self.prompt_mean is None else self.prompt_mean) + self.response_mean

    @property
    def minibatches(self) -> int:
        """Optimizer steps of one training stage in the step."""
        return self.epochs * max(1, self.batch // self.minibatch)

    @classmethod
    def from_config(cls, cfg: JobConfig, step: int | None = None) -> Workload:
        """The longest step of the job, or the longest step ``step`` (0-based) can be: the
        trainer caps a length curriculum's rollouts at that step's answer length."""
        from ..data.tasks import build_task

        hp = cfg.algo_hp
        task = build_task(cfg.task)
        longest = cfg.rollout.max_new_tokens
        if step is not None and cfg.task.grow_to is not None:
            longest = min(longest, build_task(cfg.task, step).max_answer_len)
        prompt = task.prompt_len if cfg.data is None else cfg.data.max_prompt_length  # a dataset: its longest prompt
        return cls(
            batch=cfg.batch_size, prompt=prompt, response_max=longest,
            response_mean=float(longest), minibatch=hp.minibatch_size, epochs=hp.epochs,
        )

    def at(self, response_max: int, response_mean: float | None = None, response_sq_mean: float | None = None) -> Workload:
        return replace(self, response_max=int(response_max), response_mean=float(response_mean or response_max),
                       response_sq_mean=None if response_sq_mean is None else float(response_sq_mean))

    @classmethod
    def observed(cls, cfg: JobConfig, lengths: Sequence[tuple], *, window: int = TREND_WINDOW, ahead: int = 1,
                 prompt_mean: float | None = None) -> Workload:
        """The workload ``ahead`` steps on from the ``(response_max, response_mean[,
        response_sq_mean])`` of the steps so far (oldest first): the last one plus ``ahead``
        times its growth per step, the robust slope of the last ``window`` steps (``trend``),
        never below the last, never above ``rollout.max_new_tokens``; the mean square at the
        last step's ``sq_shape``; before any step, the first step's (``from_config``).
        ``prompt_mean``: the prompts' mean real tokens seen (None: the longest prompt's).

        A one-step jump J of the last longest response moves the forecast by J (the last step
        is its floor) plus ``ahead`` times the slope's shift, which one point among ``window``
        barely moves (``trend``); the endpoint slope over 5 steps it replaces moved it by
        J · (1 + ahead / 5)."""
        base = replace(cls.from_config(cfg), prompt_mean=prompt_mean)
        if not lengths:
            return replace(cls.from_config(cfg, step=0), prompt_mean=prompt_mean)
        recent = list(lengths[-window:])
        last_max, last_mean = recent[-1][:2]
        cap = cfg.rollout.max_new_tokens
        longest = min(cap, round(last_max + ahead * trend([m[0] for m in recent])))
        mean = min(float(cap), last_mean + ahead * trend([m[1] for m in recent]), float(longest))
        sq = recent[-1][2] if len(recent[-1]) > 2 else None
        shape = base.at(last_max, last_mean, sq).sq_shape
        return base.at(longest, mean, None if sq is None else shape * mean * longest)


def trend(values: Sequence[float]) -> float:
    """Growth per step of ``values`` (one per step, oldest first), never below 0: the
    Theil–Sen slope, the median of the slopes between every pair of points. A point that jumps
    changes only the pairs it is in (n − 1 of n(n − 1)/2), which shift the median by a few
    ranks at most: on a clean ramp not at all. Fewer than two points: 0."""
    n = len(values)
    if n < 2:
        return 0.0
    slopes = sorted((values[j] - values[i]) / (j - i) for i in range(n) for j in range(i + 1, n))
    mid = len(slopes) // 2
    median = slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2
    return max(0.0, median)
