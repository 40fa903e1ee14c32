"""When to replan, and whether the better plan pays for the switch (pure; the paper's rule,
improved).

Triggers, checked before every step:

- ``infeasible`` (urgent): the running plan's predicted peak for the coming step exceeds the
  memory budget;
- ``world`` (urgent): the number of ranks changed;
- ``drift:<signal>``: a watched signal moved more than ``drift`` (relative) since the last
  replan. Signals: the mean and the longest response length, the measured step's seconds
  (a plan that slows as the work grows), and each model-stage's share of the measured step
  time. After every replan, admitted or not, the references reset —
  before the replan is priced, so that a decision that raises does not fire again on the
  next step nor count a one-step gap (the drift it saw is then absorbed: the failure is
  logged by ``Controller.failed``, and the next drift from the new references fires); on the first measured step of a new plan the step's seconds and the shares
  rebase (``DriftWatch.rebase``: the move itself changed them, which is no drift of the
  work, and would otherwise trigger the next decision and shorten H with a one-step gap);
- ``first``: the first step observed (``Controller``): the running plan was planned before
  any step was measured (for the config's longest responses), never for the observed work.

Admission (the Nereus paper: admit if ΔL > 0 and L_tran / ΔL ≤ γ · H), judged on the gain
accumulated over the horizon rather than per step:

    ΔL   = predicted seconds per step of the running plan − of the best plan
    σ    = the uncertainty of ΔL, seconds per step: √Σ band_k² · (old_k² + new_k²) over the
           model-stages k whose layout or prediction differs (``difference_spread``)
    h    = min(H, steps left)
    G    = h · (ΔL − σ)          (the accumulated gain, less its uncertainty)
    admit  if  urgent
           or  G > 0 and L_tran ≤ γ · G            (it pays for itself, even if the model erred)
           and the best plan was not left within the last ``hysteresis`` steps

Why the difference's band, not the running plan's: the relative error of a prediction is
shared by the pieces the two plans have in common — their predictions are the same numbers,
and cancel in ΔL — so only the model-stages that change carry it, combined as if
independent, each side with its own layout's band (``evidence.LayoutEvidence.band``: for a
layout the job ran, the robust spread of its own out-of-sample errors once corrected, at
least 2%; for one it has not run, the model's error on the first step of every layout the
job entered, the unseen band, 25% before any; ``Controller.stage_bands``). Per stage, not the
whole step's: the stages' errors partly cancel in the step's total, which understates the
error of any one stage that changes. A layout's correction takes out its steady bias; what a
bias on a layout not run says of its sign is nothing, so it is charged on both sides. That
is an estimate, not a bound: a calibration off in opposite directions on two operation
classes makes the old and the new prediction err in opposite directions, and their
difference then errs by more.
Why σ is charged on every step of the horizon (not √h): what the model gets wrong about a
layout is mostly bias — a calibration fitted on the running plan's mix of operations is off
on the classes a new layout leans on, by the same amount every step it runs — so it adds
up over the horizon like the gain does; only the steps' own noise would average out, and it
does not decide whether the move pays. A steady 2%/step gain beyond the band of the pieces
that change is taken over 200 steps; a gain within that band is not, however long the
horizon. (Measured: a 1.5% predicted gain with σ 5% taken under a √h discount turned out
7% slower, and its move back never paid.)

Trials. A plan whose better layout the model cannot vouch for (its gain within σ, or none
predicted) stays untried by the rule above, and the model never learns it: what the model
gets wrong about layouts it has not run (the job's measured error on each layout's first
step, ``evidence.LayoutEvidence.unseen``) is as likely to hide a faster plan as a slower one.
A trial moves to the plan whose layouts not yet run are fastest at the model's prediction
less that error (L_hope), measures it for a few steps k, and moves back unless it is faster
(``trial``): admitted if L_hope < L_old and its risk — the move, the move back and k slower
steps, r = L_tran + L_back + k·max(0, L_new − L_old) — is within γ·h·(L_old − L_hope) and within
what the job's exploration may still spend (``controller.explore`` × the run's time so far
and to come, less what trials spent). Each trial measures a layout: its correction and band
replace the model's guess, and the calibration sees one more layout.

``H`` is the mean of the last gaps between drifts of the signal that triggered, the first gap
counted from the step the signal was first seen (``DriftWatch``), never less than the
lookahead (``Controller``: a plan is chosen to fit that many steps, so it is expected to run
them). Every decision, admitted or not, is returned as a ``Decision`` for
``transitions.jsonl``.
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
        for the first time only sets its reference, and starts its first gap)."""
        out = []
        for name, value in signals.items():
            ref = self.reference.get(name)
            if ref is None:
                self.reference[name] = value
                self.last_drift.setdefault(name, step)
                continue
            if abs(value - ref) > self.drift * max(abs(ref), 1e-12):
                out.append(name)
                if name in self.last_drift:
                    self.gaps.setdefault(name, []).append(step - self.last_drift[name])
                self.last_drift[name] = step
        return out

    def reset(self, signals: dict[str, float]) -> None:
        self.reference = dict(signals)

    def rebase(self, signals: dict[str, float], step: int, *, prefix: str = "share:") -> None:
        """Take ``signals`` (the ``prefix`` ones) as the references without a drift (no
        trigger, no gap): what a change of plan itself moved. A reference of ``prefix`` that
        ``signals`` lacks goes (as ``reset`` drops it): it was the old plan's, and a later
        value is compared with nothing the new plan measured. A signal seen for the first
        time starts its first gap."""
        for name in [k for k in self.reference if k.startswith(prefix) and k not in signals]:
            del self.reference[name]
        for name, value in signals.items():
            self.reference[name] = value
            self.last_drift.setdefault(name, step)

    def horizon(self, name: str, window: int = 5) -> float:
        """H: the mean of the last ``window`` gaps between drifts of ``name``, the first from
        the step it was first seen (1 before any)."""
        gaps = self.gaps.get(name, [])[-window:]
        return sum(gaps) / len(gaps) if gaps else 1.0


def difference_spread(old: dict[str, float], new: dict[str, float], band: float, changed=(), *,
                      bands: dict[str, float] | None = None, new_bands: dict[str, float] | None = None) -> float:
    """σ of the module docstring: seconds per step, the band of each piece that differs
    between the two plans' per-model-stage predictions (``old``, ``new``; a stage in
    ``changed`` counts even where its prediction happens to be equal): ``bands[key]`` on the
    running plan's side (that stage's layout's own measured error), ``new_bands[key]`` on the
    new plan's (its layout's, or the model's error on layouts it had not run; ``bands`` when
    not given), ``band`` for a stage without one."""
    total = 0.0
    bands = bands or {}
    new_bands = bands if new_bands is None else new_bands
    for key in old.keys() | new.keys():
        a, b = old.get(key, 0.0), new.get(key, 0.0)
        if key in changed or abs(a - b) > 1e-12 * max(abs(a), abs(b), 1e-30):
            total += bands.get(key, band) ** 2 * a * a + new_bands.get(key, band) ** 2 * b * b
    return total ** 0.5


def trial(*, old_seconds: float, optimistic_seconds: float, new_seconds: float, there_seconds: float, back_seconds: float,
          horizon: float, steps_left: int, gamma: float, allowance: float, steps: int = 1) -> tuple[bool, str]:
    """(admitted, reason) of a trial move: to a plan with a layout the job has not run, whose
    gain the model cannot vouch for (it is within σ), to measure it for ``steps`` steps (module
    docstring, "Trials"). ``optimistic_seconds``: the plan with each layout not yet run at the
    model's prediction less the model's error on unseen layouts; ``allowance``: what the job's
    exploration may still spend, seconds."""
    h = max(min(horizon, steps_left), 0.0)
    hope = old_seconds - optimistic_seconds
    risk = there_seconds + back_seconds + steps * max(0.0, new_seconds - old_seconds)  # the move, the move back, slower steps
    if not hope > 0:
        return False, f"no trial: even at the model's unseen error the plan is not faster ({optimistic_seconds:.4g} s vs {old_seconds:.4g} s)"
    if not h > steps:
        return False, "no trial: no step left to use what it would show"
    if not risk <= allowance:
        return False, f"no trial: its risk {risk:.4g} s is over what exploration may still spend ({allowance:.4g} s)"
    if not risk <= gamma * h * hope:
        return False, f"no trial: its risk {risk:.4g} s > γ·h·(L_old − L_hope) = {gamma * h * hope:.4g} s"
    return True, (f"trial: a layout not run yet, {new_seconds:.4g} s predicted, {optimistic_seconds:.4g} s at the model's unseen error "
                  f"(running {old_seconds:.4g} s); risk {risk:.4g} s <= γ·h·(L_old − L_hope) = {gamma * h * hope:.4g} s")


def admit(
    *,
    urgent: bool,
    old_seconds: float,
    new_seconds: float,
    transition_seconds: float,
    horizon: float,
    steps_left: int,
    spread: float,
    gamma: float,
    recently_left: bool,
) -> tuple[bool, str]:
    """(admitted, reason) by the rule of the module docstring (``spread``: σ, s/step)."""
    gain = old_seconds - new_seconds
    if urgent:
        return True, "urgent: the running plan cannot run the coming step"
    h = max(min(horizon, steps_left), 0.0)
    won = h * (gain - spread)
    if not gain > spread:  # (written so that a NaN refuses)
        return False, (f"gain {gain:.4g} s/step is within the model's error on the pieces that change (σ = {spread:.4g} s/step; "
                       f"over min(H, steps left) = {h:.4g} steps, h·(ΔL − σ) = {won:.4g} s)")
    if not won > 0:
        return False, f"no step left to win it back in (min(H, steps left) = {h:.4g})"
    if recently_left:
        return False, "the best plan was left within the hysteresis window"
    pays = gamma * won
    if not transition_seconds <= pays:
        return False, f"transition {transition_seconds:.4g} s > γ·h·(ΔL − σ) = {pays:.4g} s"
    return True, f"pays back: transition {transition_seconds:.4g} s <= γ·h·(ΔL − σ) = {pays:.4g} s"
