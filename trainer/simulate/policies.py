"""The policies a simulation compares, each driving a JobConfig through the trace.

- ``fixed``: the initial plan's TP/PP kept for the whole run, DP scaled to the devices
  available (the paper's baseline); a world it cannot fill (rows that DP does not divide)
  leaves devices idle, a world too small for one replica waits.
- ``adaptive``: Nereus — the live ``Controller`` itself (``trainer/controller/online.py``)
  through the step loop's seam: ``observe(cfg, metrics)`` after every step, ``decide(cfg,
  metrics)`` before the next, ``transitioned(decision, done)`` after an admitted move, as
  ``trainer/runtime/control.py``'s ``JobControl`` calls them. A change of the devices is its ``world``
  trigger (urgent): ``decide(cfg, None, nproc=n)`` on the new world, the running plan's
  stages on explicit ranks (what they hold while the world changes under them); when the
  controller finds a plan but no live move to it fits the memory, the workers restart in
  that plan from the staged state (``nereus resume``'s path: ``truth.restart_seconds``, the
  controller's state kept, its calibration with it).
- ``greedy``: the same controller, deciding every step (its drift watch fires on every step
  through the controller's own ``decide``: trigger ``drift:every_step``), and a decision whose
  best plan is predicted faster is taken whatever the admission rule said (no error band, no
  pay-back test, no hysteresis) — unless its transition does not fit the memory budget.
- ``oracle``: the best plan of every step by the hidden truth's own models (``truth.py``:
  θ*, the real memory), transitions free — a bound no controller can beat. Searches are
  cached per 5% bucket of the longest response (``BUCKET``) and world, planned at the bucket's
  upper edge (so they fit every step in it) with the step's mean-to-longest ratio, and the
  fastest by the truth of their top 3 (``TOP``) taken at each step.
- ``oracle_headroom`` (a reference beside the oracle, not among the default policies): the
  same, its plans' real peaks kept within the device's memory less the 10% headroom the
  controller keeps (``memory.HEADROOM``), as the controller's own plans are. About what a
  controller that keeps the headroom could reach if it knew the truth (not a strict bound:
  the search is a beam, which can do better with less memory on some traces).

A controller that raises (in ``observe``, ``decide`` or its world path) is logged through
``Controller.failed`` and the plan kept, as ``trainer/runtime/control.py``'s ``JobControl`` does; the
policy's ``errors`` record it (the summary's ``controller_errors``).

A world no plan of the job can use (too few devices) makes a policy wait: its steps do
not run until the devices return (``Waiting``); the output says so.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from ..config import ConfigError, JobConfig, PlanConfig, StageConfig, build_tree
from ..controller.memory import HEADROOM
from ..controller.admission import DriftWatch
from ..controller.online import Controller, plan_key
from ..controller.search import search
from .traces import TraceStep
from .truth import Truth


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


def explicit(plan: PlanConfig, nproc: int) -> PlanConfig:
    """``plan`` with every stage on explicit ranks (``ranks`` None: 0 … nproc−1)."""
    def pin(sc: StageConfig) -> StageConfig:
        return sc if sc.ranks is not None else dataclasses.replace(sc, ranks=tuple(range(nproc)))

    return _replace_stages(plan, pin)


def _replace_stages(plan: PlanConfig, fn) -> PlanConfig:
    for key, sc in plan.stages().items():
        model, stage = key.split(".")
        plan = dataclasses.replace(plan, **{model: dataclasses.replace(getattr(plan, model), **{stage: fn(sc)})})
    return plan


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

    def __init__(self, cfg: JobConfig, truth: Truth) -> None:
        self.cfg, self.truth = cfg, truth
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

    def _world_move(self, t: TraceStep, new_cfg: JobConfig, trigger: str, predicted: float | None, free: bool = False) -> Move:
        """Move to ``new_cfg``'s world and plan: the truth's cost on a world holding both."""
        old = self.cfg
        seconds, nbytes = 0.0, 0
        if not free:
            big = dataclasses.replace(old, nproc=max(old.nproc, new_cfg.nproc))
            seconds, nbytes, _ = self.truth.transition(big, explicit(old.plan, old.nproc), explicit(new_cfg.plan, new_cfg.nproc), t.step)
        self.cfg = new_cfg
        move = Move(step=t.step, kind="world", trigger=trigger, seconds=seconds, predicted_s=predicted, nbytes=nbytes,
                    old=label(old.plan), new=label(new_cfg.plan), devices=new_cfg.nproc)
        self.moves.append(move)
        return move


class Fixed(Policy):
    name = "fixed"

    def __init__(self, cfg: JobConfig, truth: Truth) -> None:
        super().__init__(cfg, truth)
        self.initial = cfg

    def scaled(self, n: int) -> JobConfig | None:
        """The initial plan's TP/PP on ``n`` devices, DP as large as the rows allow."""
        base, old = self.initial, self.initial.nproc
        hp = base.ppo if base.algorithm == "ppo" else base.grpo

        def scale(key: str, sc: StageConfig) -> StageConfig | None:
            start, count = (0, n) if sc.ranks is None else (sc.ranks[0] * n // old, len(sc.ranks) * n // old)
            rows = hp.minibatch_size if key.endswith(".train") else base.batch_size
            dp = next((d for d in range(count // (sc.tp * sc.pp), 0, -1) if rows % d == 0), 0)
            if dp == 0:
                return None
            used = dp * sc.tp * sc.pp
            mbs = sc.micro_batch_size if sc.micro_batch_size and (rows // dp) % sc.micro_batch_size == 0 else None
            ranks = None if (start == 0 and used == n) else tuple(range(start, start + used))
            return dataclasses.replace(sc, dp=dp, ranks=ranks, micro_batch_size=mbs)

        plan = base.plan
        for key, sc in base.plan.stages().items():
            new = scale(key, sc)
            if new is None:
                return None
            model, stage = key.split(".")
            plan = dataclasses.replace(plan, **{model: dataclasses.replace(getattr(plan, model), **{stage: new})})
        return dataclasses.replace(base, nproc=n, plan=plan)

    def resize(self, t: TraceStep) -> Move | None:
        new = self.scaled(t.devices)
        if new is None:
            self.waiting = f"{t.devices} devices hold no replica of the fixed plan ({label(self.initial.plan)})"
            return None
        if max(self.truth.peaks(new, self.truth.work(new, t))) > self.truth.profile.memory_gib * (1 << 30):
            self.waiting = f"the fixed plan scaled to {t.devices} devices is over the memory"
            return None
        self.waiting = None
        if plan_key(new.plan) == plan_key(self.cfg.plan) and new.nproc == self.cfg.nproc:
            return None
        return self._world_move(t, new, "world", None)


class Adaptive(Policy):
    name = "adaptive"
    reads_memory = True

    def __init__(self, cfg: JobConfig, truth: Truth, *, run_dir: str | None = None) -> None:
        super().__init__(cfg, truth)
        # the live controller as trainer/runtime/control.py's JobControl builds it: its own transition
        # model (default link costs), nothing of the truth's
        self.controller = self._controller(cfg, run_dir=run_dir)

    def _controller(self, cfg: JobConfig, **kwargs) -> Controller:
        return Controller(cfg, self.truth.profile, **kwargs)

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
            big = dataclasses.replace(cfg, nproc=max(old.nproc, cfg.nproc))
            seconds, nbytes, stages = self.truth.transition(big, explicit(old.plan, old.nproc), explicit(new_plan, cfg.nproc), t.step)
        else:
            seconds, nbytes, stages = self.truth.transition(cfg, cfg.plan, new_plan, t.step)
        self.controller.transitioned(decision, {"seconds": seconds, "bytes": nbytes, "stages": list(stages), "rebuilt": list(stages)})
        self.cfg = dataclasses.replace(cfg, plan=new_plan)
        self.controller.nproc = cfg.nproc
        move = Move(step=t.step, kind=kind if stages else "retune", trigger=decision.trigger, seconds=seconds,
                    predicted_s=decision.transition_seconds, nbytes=nbytes, old=label(old.plan), new=label(new_plan), devices=cfg.nproc)
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
        move = Move(step=t.step, kind="restart", trigger=decision.trigger, seconds=self.truth.spec.restart_seconds, predicted_s=None,
                    nbytes=0, old=label(old.plan), new=label(new_plan), devices=n)
        self.moves.append(move)
        return move


class EveryStep(DriftWatch):
    """A drift watch that fires every step (``every_step``) besides the live signals' drifts:
    greedy's controller searches before every step through its own ``decide``."""

    def check(self, step: int, signals: dict[str, float]) -> list[str]:
        return super().check(step, signals) or ["every_step"]


class Greedy(Adaptive):
    name = "greedy"

    def _controller(self, cfg: JobConfig, **kwargs) -> Controller:
        ctl = super()._controller(cfg, **kwargs)
        ctl.watch = EveryStep(drift=ctl.watch.drift)
        return ctl

    def admitted(self, decision) -> bool:
        if decision.admitted:
            return True
        fits = decision.new_plan is not None and not decision.reason.startswith(("no better plan's transition fits", "no plan fits"))
        return fits and decision.gain_seconds > 0


class Oracle(Policy):
    name = "oracle"
    BUCKET = 1.05
    TOP = 3
    KEPT = 1.0  # the share of the device's memory its plans' real peaks stay within is 1 / KEPT

    def __init__(self, cfg: JobConfig, truth: Truth) -> None:
        super().__init__(cfg, truth)
        self.base = cfg
        self.cache: dict = {}

    def _edge(self, x: float) -> float:
        return self.BUCKET ** math.ceil(math.log(max(x, 1.0), self.BUCKET))

    def choices(self, n: int, t: TraceStep) -> list[PlanConfig]:
        """The best plans (at most ``TOP``) for the bucket of ``t``'s longest response, planned at
        its upper edge with the step's mean-to-longest ratio, every rank's real peak checked."""
        cap = self.base.rollout.max_new_tokens
        edge = min(cap, math.ceil(self._edge(t.response_max)))
        key = (n, edge)
        if key not in self.cache:
            # the truth's peaks are exact: its budget is the device's own (the search keeps 10% headroom)
            memory = self.truth.profile.memory_gib / self.KEPT
            cfg = dataclasses.replace(self.base, nproc=n, device_memory_gib=memory * HEADROOM)
            work = self.truth.work(cfg, dataclasses.replace(t, response_max=edge, response_mean=t.response_mean * edge / t.response_max))
            t0 = time.perf_counter()
            try:
                found = [c.plan for c in search(cfg, work, self.truth.profile, self.truth.model, fit=self.truth.fit, top=3 * self.TOP).plans]
            except ConfigError:
                found = []
            if n == self.base.nproc:  # the initial plan too (the search's beam may have dropped it)
                found.append(self.base.plan)
            # the search prices a pipeline by its first and last stage; a middle one can hold more
            # (selective recompute checkpoints blocks of an even index): the oracle checks every rank
            limit = memory * (1 << 30)
            self.cache[key] = [p for p in found if max(self.truth.peaks(dataclasses.replace(cfg, plan=p), work)) <= limit][: self.TOP]
            self.decision_ms.append((time.perf_counter() - t0) * 1e3)
        return self.cache[key]

    def resize(self, t: TraceStep) -> Move | None:
        for n in worlds(t.devices):
            if self.choices(n, t):
                self.waiting = None
                self.cfg = dataclasses.replace(self.cfg, nproc=n)
                return None
        self.waiting = f"{t.devices} devices: no plan of the job fits"
        return None

    def before(self, t: TraceStep) -> None:
        n = self.cfg.nproc
        cfgs = [dataclasses.replace(self.base, nproc=n, plan=plan) for plan in self.choices(n, t)]
        if not cfgs:
            self.waiting = f"{t.devices} devices: no plan of the job fits step {t.step}"
            return
        seconds = [sum(e.values()) for e in self.truth.expected_many(cfgs, self.truth.work(cfgs[0], t))]
        best = cfgs[seconds.index(min(seconds))]
        if plan_key(best.plan) != plan_key(self.cfg.plan):
            self.moves.append(Move(step=t.step, kind="transition", trigger="oracle", seconds=0.0, predicted_s=0.0, nbytes=0,
                                   old=label(self.cfg.plan), new=label(best.plan), devices=n))
            self.cfg = best


class HeadroomOracle(Oracle):
    """``oracle_headroom`` (module docstring): the oracle within the controller's headroom."""

    name = "oracle_headroom"
    KEPT = HEADROOM


POLICIES = {"fixed": Fixed, "adaptive": Adaptive, "greedy": Greedy, "oracle": Oracle, "oracle_headroom": HeadroomOracle}
