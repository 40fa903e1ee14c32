"""The policies that run through the step loop (``run.py``), each driving a JobConfig through the trace.

The loop's policies are the controller's; the baselines (``best_static``, ``initial_fixed``,
``oracle``, ``greedy``) are priced on the world in hindsight (``baselines.py``).

- ``adaptive``: Nereus — the live ``Controller`` itself (``trainer/controller/online.py``)
  through the step loop's seam: ``observe(cfg, metrics)`` after every step, ``decide(cfg,
  metrics)`` before the next, ``transitioned(decision, done)`` after an admitted move, as
  ``trainer/runtime/control.py``'s ``JobControl`` calls them. A change of the devices is its ``world``
  trigger (urgent): ``decide(cfg, None, nproc=n)`` on the new world, the running plan's
  stages on explicit ranks (what they hold while the world changes under them); when the
  controller finds a plan but no live move to it fits the memory, the workers restart in
  that plan from the staged state (``nereus resume``'s path: ``world.restart_seconds``, the
  controller's state kept, its calibration with it).
- ``controller_greedy``: the same controller, deciding every step (its drift watch fires on
  every step through the controller's own ``decide``: trigger ``drift:every_step``), and a
  decision whose best plan is predicted faster is taken whatever the admission rule said (no
  error band, no pay-back test, no hysteresis) — unless its transition does not fit the memory.

The controller measures the world (``Ground.world``: device speeds, stragglers, step noise);
what a step and a move are booked at is the same world without stragglers and step noise
(``Ground.exact``), the seconds the baselines are priced at — so that the oracle's bound
holds step by step, not only on average.

A controller that raises (in ``observe``, ``decide`` or its world path) is logged through
``Controller.failed`` and the plan kept, as ``trainer/runtime/control.py``'s ``JobControl`` does; the
policy's ``errors`` record it (the summary's ``controller_errors``).

A world no plan of the job can use (too few devices) makes a policy wait: its steps do
not run until the devices return (``Waiting``); the output says so.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config import JobConfig, PlanConfig, build_tree
from ..controller.admission import DriftWatch
from ..controller.online import Controller
from ..controller.transition import move_order
from .baselines import explicit
from .traces import TraceStep


@dataclass(frozen=True, kw_only=True)
class Ground:
    """The world a simulation runs in: ``world`` what the controller measures, ``exact`` the
    same without stragglers and step noise (what is booked), ``profile`` the controller's
    device profile (the cluster's), ``restart_seconds`` a restart's cost."""

    world: object
    exact: object
    profile: object
    restart_seconds: float

    def transition(self, cfg: JobConfig, old: PlanConfig, new: PlanConfig, step: int) -> tuple[float, float, int, tuple[str, ...]]:
        """(booked seconds, measured seconds, bytes, rebuilt stages) of a move within ``cfg``'s world."""
        booked, nbytes, stages = self.exact.transition(cfg, old, new, step)
        measured = self.world.transition(cfg, old, new, step)[0] if self.world is not self.exact else booked
        return booked, measured, nbytes, stages


@dataclass(frozen=True, kw_only=True, slots=True)
class Move:
    step: int
    kind: str  # "transition" | "world" | "retune" | "restart" (booked as a restart, not a transition)
    trigger: str
    seconds: float  # what it took (the truth's)
    predicted_s: float | None
    nbytes: int
    old: str
    new: str
    devices: int


def label(plan: PlanConfig) -> str:
    return " ".join(f"{k}={'·'.join(sc.label_parts())}" for k, sc in plan.stages().items())


def worlds(devices: int) -> list[int]:
    """World sizes to try on ``devices`` available: all of them, else the largest power of two
    (a batch of 2^k rows splits over 2^k replicas; 1,000 devices may have no plan at all)."""
    p = 1 << int(math.log2(devices)) if devices >= 1 else 0
    return [n for n in dict.fromkeys((devices, p)) if n >= 1]


class Policy:
    """The loop (``run.py``) calls, per trace step: ``resize`` when the devices change,
    ``before`` (the oracle's choice), then runs the step on ``cfg`` and calls ``after``.
    ``waiting``: no plan runs on the devices now (``why`` says so)."""

    name = "policy"
    reads_memory = False  # it reads every rank's measured peak (the controller's memory fit)

    def __init__(self, cfg: JobConfig, ground: Ground) -> None:
        self.cfg, self.ground = cfg, ground
        self.moves: list[Move] = []
        self.decision_ms: list[float] = []
        self.waiting: str | None = None
        self.errors: list[dict] = []  # step, error: a controller failure (logged, the plan kept)

    def resize(self, t: TraceStep) -> Move | None:
        raise NotImplementedError

    def before(self, t: TraceStep) -> None:
        return None

    def after(self, t: TraceStep, metrics: dict) -> Move | None:
        return None


class Adaptive(Policy):
    name = "adaptive"
    reads_memory = True

    def __init__(self, cfg: JobConfig, ground: Ground, *, run_dir: str | None = None) -> None:
        super().__init__(cfg, ground)
        # the live controller as trainer/runtime/control.py's JobControl builds it: its own models
        # (the profile's priors, default link costs), nothing of the world's
        self.controller = self._controller(cfg, run_dir=run_dir)

    def _controller(self, cfg: JobConfig, **kwargs) -> Controller:
        return Controller(cfg, self.ground.profile, **kwargs)

    def _failed(self, step: int, error: Exception) -> None:
        """A controller failure never stops the job: the plan stays (``JobControl.after_step``)."""
        self.controller.failed(step, error)
        self.errors.append({"step": step, "error": f"{type(error).__name__}: {error}"})

    def after(self, t: TraceStep, metrics: dict) -> Move | None:
        ctl = self.controller
        try:
            ctl.observe(self.cfg, metrics)
            decision = ctl.decide(self.cfg, metrics) if t.step < self.cfg.steps else None
        except Exception as e:  # noqa: BLE001 - as the live loop: logged, the plan kept
            self._failed(t.step, e)
            return None
        if decision is None:
            return None
        self.decision_ms.append(decision.decision_ms)
        if not self.admitted(decision):
            return None
        return self._apply(t, decision, self.cfg)

    def admitted(self, decision) -> bool:
        return decision.admitted

    def _apply(self, t: TraceStep, decision, cfg: JobConfig, kind: str = "transition") -> Move:
        new_plan = build_tree(PlanConfig, decision.new_plan, "plan.")
        old = self.cfg
        if kind == "world":
            on = dataclasses.replace(cfg, nproc=max(old.nproc, cfg.nproc))
            a, b = explicit(old.plan, old.nproc), explicit(new_plan, cfg.nproc)
        else:
            on, a, b = cfg, cfg.plan, new_plan
        if not self.ground.exact.move_fits(on, a, b, move_order(on, a, b)):  # the executor's order, on the world's memory
            if kind == "world":  # the devices changed under the old plan: restart in the new one from the staged state
                self.controller.transitioned(decision, {"error": "out of memory during the transition (the world's memory)"})
                return self._restart(t, decision, cfg.nproc)
            return self._failed_move(t, decision, kind)
        seconds, measured, nbytes, stages = self.ground.transition(on, a, b, t.step)
        self.controller.transitioned(decision, {"seconds": measured, "bytes": nbytes, "stages": list(stages), "rebuilt": list(stages)})
        self.cfg = dataclasses.replace(cfg, plan=new_plan)
        self.controller.nproc = cfg.nproc
        move = Move(step=t.step, kind=kind if stages else "retune", trigger=decision.trigger, seconds=seconds,
                    predicted_s=decision.transition_seconds, nbytes=nbytes, old=label(old.plan), new=label(new_plan), devices=cfg.nproc)
        self.moves.append(move)
        return move

    def _failed_move(self, t: TraceStep, decision, kind: str) -> Move:
        """A move the world's memory cannot hold runs out of memory part-way: the workers
        restart from the staged state in the plan they ran (``world.restart_seconds``, booked
        as a restart); the controller hears that the transition failed."""
        self.controller.transitioned(decision, {"error": "out of memory during the transition (the world's memory)"})
        move = Move(step=t.step, kind="restart", trigger=f"{decision.trigger}: the {kind} ran out of memory", seconds=self.ground.restart_seconds,
                    predicted_s=decision.transition_seconds, nbytes=0, old=label(self.cfg.plan), new=label(self.cfg.plan), devices=self.cfg.nproc)
        self.moves.append(move)
        return move

    def resize(self, t: TraceStep) -> Move | None:
        """The world trigger: the controller's urgent path on the new world (module docstring)."""
        try:
            return self._resize(t)
        except Exception as e:  # noqa: BLE001 - as the live loop: logged, the plan kept (it waits if the world cannot hold it)
            self.controller.nproc = self.cfg.nproc
            self._failed(t.step, e)
            if t.devices < self.cfg.nproc:
                self.waiting = f"{t.devices} devices: the controller failed ({type(e).__name__}: {e})"
            return None

    def _resize(self, t: TraceStep) -> Move | None:
        reasons = []
        for n in worlds(t.devices):
            if n == self.cfg.nproc and not self.waiting:
                return None
            cfg = dataclasses.replace(self.cfg, nproc=n, plan=explicit(self.cfg.plan, self.cfg.nproc))
            self.controller.nproc = self.cfg.nproc if n != self.cfg.nproc else -1  # the world trigger fires
            decision = self.controller.decide(cfg, None, nproc=n)
            if decision is not None:
                self.decision_ms.append(decision.decision_ms)
            if decision is not None and decision.admitted:
                self.waiting = None
                return self._apply(t, decision, cfg, kind="world")
            if decision is not None and decision.new_plan is not None and decision.reason.startswith("no better plan's transition fits"):
                self.waiting = None
                return self._restart(t, decision, n)
            reasons.append(f"{n} devices: {decision.reason if decision else 'no decision'}")
        self.controller.nproc = self.cfg.nproc
        self.waiting = "; ".join(reasons)
        return None


    def _restart(self, t: TraceStep, decision, n: int) -> Move:
        """The world changed and no live move fits the memory: the workers restart on ``n``
        devices in the controller's plan for them (``nereus resume``'s path), from the staged
        state; the controller keeps its state (``state_dict``), its calibration with it."""
        old, new_plan = self.cfg, build_tree(PlanConfig, decision.new_plan, "plan.")
        self.cfg = dataclasses.replace(old, nproc=n, plan=new_plan)
        state = self.controller.state_dict()
        self.controller = self._controller(self.cfg, run_dir=self.controller.run_dir, first_step=t.step)
        self.controller.load_state(state)
        move = Move(step=t.step, kind="restart", trigger=decision.trigger, seconds=self.ground.restart_seconds, predicted_s=None,
                    nbytes=0, old=label(old.plan), new=label(new_plan), devices=n)
        self.moves.append(move)
        return move


class EveryStep(DriftWatch):
    """A drift watch that fires every step (``every_step``) besides the live signals' drifts:
    greedy's controller searches before every step through its own ``decide``."""

    def check(self, step: int, signals: dict[str, float]) -> list[str]:
        return super().check(step, signals) or ["every_step"]


class Greedy(Adaptive):
    name = "controller_greedy"

    def _controller(self, cfg: JobConfig, **kwargs) -> Controller:
        ctl = super()._controller(cfg, **kwargs)
        ctl.watch = EveryStep(drift=ctl.watch.drift)
        return ctl

    def admitted(self, decision) -> bool:
        if decision.admitted:
            return True
        fits = decision.new_plan is not None and not decision.reason.startswith(("no better plan's transition fits", "no plan fits"))
        return fits and decision.gain_seconds > 0


POLICIES = {"adaptive": Adaptive, "controller_greedy": Greedy}
"""The loop's policies (the baselines are ``baselines.py``'s)."""
