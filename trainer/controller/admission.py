"""When to replan, and whether the better plan pays for the switch (pure; the paper's rule,
improved).

Triggers, checked before every step:

- ``infeasible`` (urgent): the running plan's predicted peak for the coming step exceeds the
  memory budget;
- ``world`` (urgent): the number of ranks changed;
- ``drift:<signal>``: a watched signal moved more than ``drift`` (relative) since the last
  replan. Signals: the mean and the longest response length, and each model-stage's share
  of the measured step time. After every replan, admitted or not, the references reset.

Admission (the Nereus paper: admit if ΔL > 0 and L_tran / ΔL ≤ γ · H), with two additions:

    ΔL   = predicted seconds per step of the running plan − of the best plan
    admit  if  urgent
           or  ΔL > band · predicted(running)            (a gain beyond the model's own error)
           and L_tran ≤ γ · min(H, steps left) · ΔL      (it pays for itself in time)
           and the best plan was not left within the last ``hysteresis`` steps

``band`` is the step-time model's measured mean relative error on this job (``Controller``
keeps it); ``H`` the moving average of the steps between drifts of the signal that
triggered (1 before a second drift). Every decision, admitted or not, is returned as a
``Decision`` for ``transitions.jsonl``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    step: int
    trigger: str
    admitted: bool
    reason: str
    old_plan: dict
    new_plan: dict | None
    old_seconds: float
    new_seconds: float | None
    gain_seconds: float
    horizon: float
    transition_seconds: float | None
    decision_ms: float
    urgent: bool = False


@dataclass(kw_only=True)
class DriftWatch:
    """References of the watched signals and the steps between their drifts."""

    drift: float = 0.3
    reference: dict[str, float] = field(default_factory=dict)
    last_drift: dict[str, int] = field(default_factory=dict)
    gaps: dict[str, list[int]] = field(default_factory=dict)

    def check(self, step: int, signals: dict[str, float]) -> list[str]:
        """The signals that drifted past ``drift`` since their reference (a signal seen
        for the first time only sets its reference)."""
        out = []
        for name, value in signals.items():
            ref = self.reference.get(name)
            if ref is None:
                self.reference[name] = value
                continue
            if abs(value - ref) > self.drift * max(abs(ref), 1e-12):
                out.append(name)
                if name in self.last_drift:
                    self.gaps.setdefault(name, []).append(step - self.last_drift[name])
                self.last_drift[name] = step
        return out

    def reset(self, signals: dict[str, float]) -> None:
        self.reference = dict(signals)

    def horizon(self, name: str, window: int = 5) -> float:
        """H: the mean of the last ``window`` gaps between drifts of ``name`` (1 before any)."""
        gaps = self.gaps.get(name, [])[-window:]
        return sum(gaps) / len(gaps) if gaps else 1.0


def admit(
    *,
    urgent: bool,
    old_seconds: float,
    new_seconds: float,
    transition_seconds: float,
    horizon: float,
    steps_left: int,
    band: float,
    gamma: float,
    recently_left: bool,
) -> tuple[bool, str]:
    """(admitted, reason) by the rule of the module docstring."""
    gain = old_seconds - new_seconds
    if urgent:
        return True, "urgent: the running plan cannot run the coming step"
    if gain <= band * old_seconds:
        return False, f"gain {gain:.4g} s/step is within the model's error band ({band:.0%} of {old_seconds:.4g} s)"
    if recently_left:
        return False, "the best plan was left within the hysteresis window"
    pays = gamma * min(horizon, steps_left) * gain
    if transition_seconds > pays:
        return False, f"transition {transition_seconds:.4g} s > γ·min(H, steps left)·ΔL = {pays:.4g} s"
    return True, f"pays back: transition {transition_seconds:.4g} s <= {pays:.4g} s"
