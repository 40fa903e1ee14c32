"""The baselines a reader can trust: the best static plan, the paper's fixed plan, a Viterbi
oracle and a greedy, all priced on the world in hindsight (pure).

**The candidate pool** (``pool``): the controller's search (``controller.search``, its prior
step-time model, the world unseen) asked for its ``top`` plans (beam ``beam``) at four
lengths of the trace (the quartiles of its longest responses, each with its step's
mean-to-longest ratio) × three memory budgets (the device's memory × 1, 0.75, 0.5, so that
lean layouts the controller's memory model would reject at the full budget are offered
too) × the trace's first, smallest and largest device counts; plus the initial plan and,
after they ran, every plan the loop policies ran (pinned). Every plan of it is a *template*: its
TP/PP kept on other device counts, DP scaled to the devices there (``scale``: the largest DP
the rows divide; a stage's ranks scaled in proportion). The pool covers packing (token
budgets), recompute, micro-batches, both placements (colocated, split) and every TP/PP/FSDP
layout the search enumerates — but as the search's beam ranks them by the controller's
priors, not every combination of stage layouts: a plan the beam drops is not in it.

**The table** (``Table``): per template k and step s, ``raw[k, s]`` = the world's expected
seconds of the template scaled to step s's devices (``World.expected_trace``, noise-free:
persistent device speeds, no stragglers, no step noise), ``inf`` where it holds no replica on
them; ``feasible[k, s]``: every rank's peak within the device's memory (``World.feasible_trace``).
Every path is booked as the loop (``run.py``) books its policies:

- a step: ``cost = where(feasible, raw, 2·raw + restart_seconds)`` — over the memory (or a step
  the trace fails) a restart and the step again, booked under restarts; a plan with such
  steps is allowed, and pays;
- a wait: a step no template runs within the memory (not ``runnable``) is waited out by
  every table policy, at the pace of its last step that ran (0 s before any ran), as the
  loop's ``_prepare`` books a wait; ``Table.booked`` adds those waits to the step before
  them; they are recorded as waits (``skipped_steps`` in the run's info). No runnable step
  at all: a SimulateError naming the trace;
- a move between two plans: the cheaper of the world's own (``World.transition``,
  noise-free; on a change of the devices a world move, both plans on explicit ranks of a
  world holding both) and a restart into the new plan (``restart_seconds``, the loop's
  restart path) — ``Table.move``.

**Refined** (``refine``): from the pool's best static plan and the initial plan, a coordinate
descent on the world over each model-stage's whole candidate space (``search.stage_candidates``:
every layout, micro-batch, token budget and recompute the search enumerates, no beam, no prior),
priced on a sample of the trace's steps; the plans it keeps join the table. Its result is a
local optimum of the whole space — no one-stage change improves it
(``tests/trainer/simulate/test_baselines.py`` checks every one) — not a global one.

- ``best_static``: the template minimising the booked Σ + its own world moves, with a replica
  at every runnable step (exact over the pool: templates are taken in order of the booked Σ
  and the scan stops once the next one's Σ alone exceeds the best total). A template with
  no replica on some runnable step (a split stage's share of an odd or small device count
  below its TP × PP) is out rather than waiting there: the loop waits only where the
  controller finds no plan at all, and a static plan waiting where others run would not
  be bounded by the oracle, whose plans must run every runnable step.
- ``initial_fixed``: the paper's baseline — the initial plan (``initial_plan``: the
  controller's search at the job's declared prompt and response means, packing allowed),
  TP/PP kept, DP scaled. A step over the memory fails: a restart (``restart_seconds``) and
  the step again, as the loop books it — every step, where the plan deterministically does
  not fit (the run's ``oom_steps`` counts them per policy).
- ``oracle``: dynamic programming over the steps (Viterbi) on a stated candidate set — the
  best static plan, the initial plan, every template that is the fastest at some step, the
  loop policies' plans as they ran (``pinned``), then the fastest by Σ cost up to ``ORACLE_SET`` — with the
  moves (``Table.move``) between every pair. Exact over that set: no sequence of its plans,
  booked as above, is faster (``tests/trainer/simulate/test_baselines.py`` checks it by
  enumeration, with infeasible cells and device changes); ``run.py`` checks it bounds every
  table baseline and every loop policy whose plans are in the set (a SimulateError if not).
- ``greedy``: each step the set's fastest plan for that step, its transitions paid.

``free_moves``: Σ over steps of the whole pool's fastest plan, transitions free — what no
sequence of the pool's plans can beat (a ceiling on ``oracle_over_best_static`` over the pool).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from ..config import ConfigError, JobConfig, PlanConfig, StageConfig
from ..config.names import is_train, split_key
from ..controller.pieces import plan_key
from ..controller.search import search, stage_candidates
from ..controller.transition import move_order
from ..controller.workload import Workload
from .inputs import SimulateError
from .traces import TraceStep
from .world.shapes import response_sq_mean

ORACLE_SET = 32
"""The oracle's candidate set, at most (its transitions: ORACLE_SET² per world)."""
BUDGETS = (1.0, 0.75, 0.5)
LENGTHS = (0.25, 0.5, 0.75, 1.0)


def workload(cfg: JobConfig, t: TraceStep, prompt_mean: float | None = None) -> Workload:
    """The controller's Workload of trace step ``t`` (what its search plans for), with the
    mean square its rows measure on the world (``shapes.response_sq_mean``)."""
    pm = t.prompt_mean if t.prompt_mean is not None else prompt_mean
    sq = float(response_sq_mean(t.response_max, t.response_mean))
    return dataclasses.replace(Workload.from_config(cfg).at(t.response_max, t.response_mean, sq), prompt_mean=pm)


def explicit(plan: PlanConfig, nproc: int) -> PlanConfig:
    """``plan`` with every stage on explicit ranks (``ranks`` None: 0 … nproc−1)."""
    def pin(sc: StageConfig) -> StageConfig:
        return sc if sc.ranks is not None else dataclasses.replace(sc, ranks=tuple(range(nproc)))

    return replace_stages(plan, lambda key, sc: pin(sc))


def replace_stage(plan: PlanConfig, key: str, sc: StageConfig) -> PlanConfig:
    model, stage = split_key(key)
    return dataclasses.replace(plan, **{model: dataclasses.replace(getattr(plan, model), **{stage: sc})})


def replace_stages(plan: PlanConfig, fn) -> PlanConfig:
    for key, sc in plan.stages().items():
        plan = replace_stage(plan, key, fn(key, sc))
    return plan


def scale(cfg: JobConfig, n: int) -> JobConfig | None:
    """``cfg``'s plan on ``n`` devices: TP/PP kept, DP as large as the rows allow, each stage's
    ranks scaled in proportion (None: a stage holds no replica on them)."""
    if n == cfg.nproc:
        return cfg
    old = cfg.nproc
    hp = cfg.algo_hp
    failed = []

    def one(key: str, sc: StageConfig) -> StageConfig:
        start, count = (0, n) if sc.ranks is None else (sc.ranks[0] * n // old, len(sc.ranks) * n // old)
        rows = hp.minibatch_size if is_train(key) else cfg.batch_size
        dp = next((d for d in range(count // (sc.tp * sc.pp), 0, -1) if rows % d == 0), 0)
        if dp == 0:
            failed.append(key)
            return sc
        used = dp * sc.tp * sc.pp
        mbs = sc.micro_batch_size if sc.micro_batch_size and (rows // dp) % sc.micro_batch_size == 0 else None
        ranks = None if (start == 0 and used == n) else tuple(range(start, start + used))
        return dataclasses.replace(sc, dp=dp, ranks=ranks, micro_batch_size=mbs, dp_shard=sc.dp_shard and dp > 1)

    plan = replace_stages(cfg.plan, one)
    return None if failed else dataclasses.replace(cfg, nproc=n, plan=plan)


def initial_plan(cfg: JobConfig, profile, *, prompt_mean: float, response_mean: float | None) -> PlanConfig:
    """The paper's initial plan: the controller's search (its priors) for the job's declared
    workload — the longest response it allows, the declared means (packing offered where the
    mean is below the width)."""
    longest = cfg.rollout.max_new_tokens
    mean = float(longest if response_mean is None else response_mean)
    work = dataclasses.replace(Workload.from_config(cfg).at(longest, mean), prompt_mean=prompt_mean)
    return search(cfg, work, profile, top=1).best.plan


def pool(base: JobConfig, trace: list[TraceStep], profile, *, prompt_mean: float | None, top: int = 64, beam: int = 64,
         memory_gib: float) -> list[JobConfig]:
    """The candidate pool (module docstring), templates on their own device counts."""
    counts = [t.devices for t in trace if t.devices > 0]
    p2 = [1 << int(math.log2(n)) for n in (counts[0], min(counts), max(counts))]  # the worlds the adaptive policy tries too
    devices = list(dict.fromkeys([counts[0], min(counts), max(counts), *p2]))
    picks = _length_picks(trace)
    out: dict[tuple, JobConfig] = {}
    for n in devices:
        at = dataclasses.replace(base, nproc=n, plan=base.plan if n == base.nproc else explicit_free(base.plan))
        for t in picks:
            work = workload(at, t, prompt_mean)
            for share in BUDGETS:
                c = dataclasses.replace(at, device_memory_gib=memory_gib * share)
                try:
                    found = search(c, work, profile, top=top, beam=beam).plans
                except ConfigError:
                    continue
                for choice in found:
                    out.setdefault((n, plan_key(choice.plan)), dataclasses.replace(base, nproc=n, plan=choice.plan))
    return list(out.values())


def _length_picks(trace: list[TraceStep]) -> list[TraceStep]:
    """The trace's steps at the ``LENGTHS`` quantiles of its longest responses."""
    order = sorted(range(len(trace)), key=lambda i: trace[i].response_max)
    return list(dict.fromkeys(trace[order[min(len(order) - 1, int(q * (len(order) - 1)))]] for q in LENGTHS))


def explicit_free(plan: PlanConfig) -> PlanConfig:
    """``plan`` with every stage's ranks dropped (the search places stages itself)."""
    return replace_stages(plan, lambda key, sc: dataclasses.replace(sc, ranks=None))


@dataclass
class Table:
    """Per template the world's seconds at every step (module docstring). ``runnable()``: the
    steps some template runs within the memory (the others are waited out by every table policy,
    at its last step's pace, as the loop waits)."""

    exact: object  # the World, noise-free
    trace: list[TraceStep]
    templates: list[JobConfig] = field(default_factory=list)
    keys: dict = field(default_factory=dict)
    raw: np.ndarray = None  # seconds regardless of the memory (inf: no replica)
    feasible: np.ndarray = None
    scaled: list[dict] = field(default_factory=list)  # per template: devices → its JobConfig there (None: none)
    _moves: dict = field(default_factory=dict)
    _fits: dict = field(default_factory=dict)
    restart_seconds: float = 0.0  # a failed step's restart (the job's world.restart_seconds)
    name: str = "trace"  # the trace's name, in errors

    def __post_init__(self) -> None:
        if not self.restart_seconds >= 0:
            raise SimulateError(f"trace {self.name!r}: restart_seconds must be >= 0, got {self.restart_seconds}")
        self.devices = np.array([t.devices for t in self.trace])
        self.groups = {int(d): [i for i, t in enumerate(self.trace) if t.devices == d] for d in dict.fromkeys(self.devices.tolist())}
        self.subtraces = {d: [self.trace[i] for i in idx] for d, idx in self.groups.items()}
        self.raw = np.zeros((0, len(self.trace)))
        self.feasible = np.zeros((0, len(self.trace)), dtype=bool)

    def add(self, cfgs: list[JobConfig], *, pinned: bool = False) -> list[int]:
        """Price ``cfgs`` (templates) unless priced already; their indices. ``pinned``: on more
        devices than its own a template runs as it is, the others idle (a loop policy's plan as
        it ran), not scaled."""
        out, rows, feas = [], [], []
        for cfg in cfgs:
            key = (cfg.nproc, plan_key(cfg.plan), pinned)
            if key in self.keys:
                out.append(self.keys[key])
                continue
            self.keys[key] = len(self.templates)
            out.append(len(self.templates))
            self.templates.append(cfg)
            raw, ok = np.full(len(self.trace), np.inf), np.zeros(len(self.trace), dtype=bool)
            at: dict = {}
            for d, idx in self.groups.items():
                c = None if d <= 0 else cfg if pinned and cfg.nproc <= d else scale(cfg, d)
                at[d] = c
                if c is None:
                    continue
                sub = self.subtraces[d]
                raw[idx] = sum(self.exact.expected_trace(c, sub).values())
                ok[idx] = self.exact.feasible_trace(c, sub)
            self.scaled.append(at)
            rows.append(raw)
            feas.append(ok)
        if rows:
            self.raw = np.vstack([self.raw, np.array(rows)])
            self.feasible = np.vstack([self.feasible, np.array(feas)])
        return out

    @property
    def cost(self) -> np.ndarray:
        """Seconds per template and step as the loop books them (inf: no replica on the step's
        devices): a step over the memory (or one the trace fails) costs a restart and the step
        again — ``where(feasible, raw, 2·raw + restart)``."""
        failed = np.array([t.failed for t in self.trace], dtype=bool)
        redo = ~self.feasible | failed[None, :]
        return self.raw + np.where(redo, self.raw + self.restart_seconds, 0.0)

    def runnable(self) -> np.ndarray:
        """Steps some template runs within the memory (the loop's policies wait where no plan
        fits; on a runnable step a template over the memory may still run it, and pays)."""
        return (np.isfinite(self.raw) & self.feasible).any(axis=0)

    def waits_after(self) -> np.ndarray:
        """Per step, the waited steps (no template runs them) that follow it before the next
        runnable one, or the trace's end (0 for a waited step; waits before the first runnable
        step are at no pace: 0 s, as the loop books them before any step ran)."""
        runs = self.runnable()
        out = np.zeros(len(self.trace), dtype=np.int64)
        last = None
        for s, r in enumerate(runs):
            if r:
                last = s
            elif last is not None:
                out[last] += 1
        return out

    @property
    def booked(self) -> np.ndarray:
        """``cost`` plus the waits that follow each step at its pace (the step's seconds, as the
        loop's ``_prepare`` books a wait): what a path pays per step, moves apart."""
        w, out = self.waits_after(), self.cost
        at = w > 0
        out[:, at] += self.raw[:, at] * w[at]
        return out

    def run_steps(self) -> list[int]:
        """The runnable steps' indices; a SimulateError naming the trace when there is none."""
        steps = [int(s) for s in np.flatnonzero(self.runnable())]
        if not steps:
            devices = sorted(set(self.devices.tolist()))
            raise SimulateError(f"trace {self.name!r}: no plan of the pool runs any of its {len(self.trace)} steps within the memory "
                                f"(devices {', '.join(map(str, devices[:8]))}{' …' if len(devices) > 8 else ''})")
        return steps

    def transition(self, i: int, j: int, a: int, b: int, step: int = 0) -> float:
        """World seconds of a live move: template i on a devices → template j on b devices (inf:
        either cannot run). Keyed on the step where the world's transitions are noisy."""
        if i == j and a == b:
            return 0.0
        key = (i, j, a, b, step if getattr(self.exact, "noisy", True) else None)
        if key not in self._moves:
            x, y = self.scaled[i].get(a), self.scaled[j].get(b)
            if x is None or y is None:
                self._moves[key] = math.inf
            elif x.nproc == y.nproc:
                self._moves[key] = self.exact.transition(x, x.plan, y.plan, step)[0]
            else:
                big = dataclasses.replace(x, nproc=max(x.nproc, y.nproc))
                self._moves[key] = self.exact.transition(big, explicit(x.plan, x.nproc), explicit(y.plan, y.nproc), step)[0]
        return self._moves[key]

    def fits(self, i: int, j: int, a: int, b: int) -> bool:
        """Whether the world's memory holds the live move, stage by stage in the executor's order
        (``World.move_fits``, ``controller.transition.move_order``), as the loop's moves are checked."""
        key = (i, j, a, b)
        if key not in self._fits:
            x, y = self.scaled[i].get(a), self.scaled[j].get(b)
            if x is None or y is None:
                self._fits[key] = False
            else:
                on = x if x.nproc == y.nproc else dataclasses.replace(x, nproc=max(x.nproc, y.nproc))
                old, new = (x.plan, y.plan) if x.nproc == y.nproc else (explicit(x.plan, x.nproc), explicit(y.plan, y.nproc))
                self._fits[key] = bool(self.exact.move_fits(on, old, new, move_order(on, old, new)))
        return self._fits[key]

    def move(self, i: int, j: int, a: int, b: int, step: int = 0) -> float:
        """A move's seconds: the cheaper of the world's live move (where the memory holds it) and a
        restart into the new plan (``restart_seconds``, ``nereus resume``'s path, at max(old, new);
        inf where either plan has no replica)."""
        t = self.transition(i, j, a, b, step)
        if t == 0.0 or not math.isfinite(t):
            return t
        return min(t, self.restart_seconds) if self.fits(i, j, a, b) else self.restart_seconds

    def move_kind(self, i: int, j: int, a: int, b: int, step: int = 0) -> str:
        """How ``move`` goes: ``restart`` (cheaper than the live move, or the live move does not
        fit the memory), ``world`` (the devices change) or ``transition``."""
        t = self.transition(i, j, a, b, step)
        if math.isfinite(t) and t > 0.0 and (self.restart_seconds < t or not self.fits(i, j, a, b)):
            return "restart"
        x, y = self.scaled[i].get(a), self.scaled[j].get(b)
        return "world" if x is not None and y is not None and x.nproc != y.nproc else "transition"


@dataclass
class Path:
    """A policy of the table: the template per step (-1: waited), its seconds."""

    name: str
    picks: list[int]
    step_seconds: np.ndarray
    moves: list[tuple[int, int, int, float, int, str]]  # (step index, from template, to template, seconds, from devices, kind)
    restarts: list[int] = field(default_factory=list)  # step indices that ran out of memory or failed
    restart_seconds: np.ndarray | None = None  # per step: a restart and the step again (0: none)
    wait_seconds: np.ndarray | None = None  # per step: a waited step at the last step's pace (0: none)
    oom: list[int] = field(default_factory=list)  # step indices over the memory (each also in restarts)

    @property
    def total(self) -> float:
        redo = 0.0 if self.restart_seconds is None else float(self.restart_seconds.sum())
        wait = 0.0 if self.wait_seconds is None else float(self.wait_seconds.sum())
        return float(self.step_seconds.sum() + redo + wait + sum(m[3] for m in self.moves))


def _run_steps(table: Table) -> list[int]:
    return table.run_steps()


def path_of(table: Table, name: str, picks: list[int]) -> Path:
    """A sequence of templates over the runnable steps, booked as the loop books it: its steps'
    seconds (a step over the memory, or failed: a restart and the step again), the waited steps
    at the last step's pace, the moves between its choices (``Table.move``)."""
    steps = _run_steps(table)
    if len(picks) != len(steps):
        raise SimulateError(f"{name}: {len(picks)} plans for the trace's {len(steps)} runnable steps")
    n = len(table.trace)
    secs, redo, wait = np.zeros(n), np.zeros(n), np.zeros(n)
    moves, restarts, oom, prev = [], [], [], None
    full = [-1] * n
    bounds = [*steps[1:], n]
    for s, k, end in zip(steps, picks, bounds):
        full[s] = k
        raw = table.raw[k, s]
        if not np.isfinite(raw):
            raise SimulateError(f"{name}: template {k} cannot run step {s + 1}")
        secs[s] = raw
        if not table.feasible[k, s] or table.trace[s].failed:  # a restart and the step again, booked under restarts
            redo[s] = raw + table.restart_seconds
            restarts.append(s)
            if not table.feasible[k, s]:
                oom.append(s)
        wait[s + 1:end] = raw  # the steps no plan runs, until the next runnable one: at this step's pace
        if prev is not None:
            ps, pk = prev
            a, b = int(table.devices[ps]), int(table.devices[s])
            if pk != k or a != b:
                moves.append((s, pk, k, table.move(pk, k, a, b, s + 1), a, table.move_kind(pk, k, a, b, s + 1)))
        prev = (s, k)
    return Path(name=name, picks=full, step_seconds=secs, moves=moves, restarts=restarts, restart_seconds=redo,
                wait_seconds=wait, oom=oom)


def static_total(table: Table, k: int) -> float:
    steps = _run_steps(table)
    c = table.booked[k, steps]
    if not np.isfinite(c).all():
        return math.inf
    moves = sum(table.move(k, k, int(table.devices[a]), int(table.devices[b])) for a, b in itertools.pairwise(steps)
                if table.devices[a] != table.devices[b])
    return float(c.sum() + moves)


def best_static(table: Table) -> int | None:
    """The template of the least booked Σ + own world moves, with a replica at every runnable
    step (exact: the scan in order of the booked Σ stops once that Σ alone exceeds the best
    total, moves costing ≥ 0). A template with no replica on a step some other template runs is
    out (module docstring)."""
    steps = _run_steps(table)
    sums = table.booked[:, steps].sum(axis=1)
    best, best_total = None, math.inf
    for k in np.argsort(sums, kind="stable"):
        if not np.isfinite(sums[k]) or sums[k] >= best_total:
            break
        total = static_total(table, int(k))
        if total < best_total:
            best, best_total = int(k), total
    return best


def refine(table: Table, starts: list[int], *, prompt_mean: float | None, passes: int = 3, sample: int = 24) -> int | None:
    """Coordinate descent on the world from each of ``starts`` (module docstring): for one
    model-stage at a time, every candidate of the search's space for that stage's ranks
    (``search.stage_candidates`` at the pool's four lengths: every TP/PP/DP/FSDP layout,
    micro-batch, token budget and recompute — no beam, no prior) replaces the stage's
    config, priced on the world over ``sample`` steps of the trace (evenly spaced, with each
    device count's widest step and the pool's lengths); the fastest that runs every one of
    them within the memory is kept, until a pass over the stages changes nothing (at most
    ``passes``). The plans it keeps join ``table``, priced on every step; returns
    ``best_static(table)`` over it."""
    trace, exact = table.trace, table.exact
    widest = [max(idx, key=lambda i: trace[i].response_max) for idx in table.groups.values()]
    chosen = sorted({*np.linspace(0, len(trace) - 1, min(sample, len(trace))).astype(int).tolist(), *widest,
                     *(trace.index(t) for t in _length_picks(trace))})
    groups: dict[int, list[TraceStep]] = {}
    runs = table.runnable()
    for i in chosen:
        if runs[i]:  # the steps some plan of the pool runs (the others are waited out)
            groups.setdefault(trace[i].devices, []).append(trace[i])

    def seconds(cfg: JobConfig) -> float:
        total = 0.0
        for d, steps in groups.items():
            c = scale(cfg, d)
            if c is None:
                return math.inf
            total += float(sum(exact.expected_trace(c, steps).values()).sum())
        return total

    def fits(cfg: JobConfig) -> bool:
        scaled = [(scale(cfg, d), steps) for d, steps in groups.items()]
        return all(c is not None and bool(np.all(exact.feasible_trace(c, steps))) for c, steps in scaled)

    picks, kept = _length_picks(trace), []
    for k in dict.fromkeys(s for s in starts if s is not None):
        cfg = table.templates[k]
        total = seconds(cfg) if fits(cfg) else math.inf
        for _ in range(passes):
            moved = False
            for key in cfg.plan.stages():
                ranks = tuple(cfg.plan.stages()[key].ranks or range(cfg.nproc))
                options = dict.fromkeys(sc for t in picks for sc in stage_candidates(cfg, key, ranks, workload(cfg, t, prompt_mean)).configs())
                variants = [dataclasses.replace(cfg, plan=replace_stage(cfg.plan, key, sc)) for sc in options]
                priced = sorted((seconds(v), n) for n, v in enumerate(variants))
                for t_v, n in priced:  # the fastest that fits, if it beats the current plan
                    if t_v >= total * (1 - 1e-12):
                        break
                    if fits(variants[n]):
                        cfg, total, moved = variants[n], t_v, True
                        kept.append(cfg)
                        break
            if not moved:
                break
    table.add(kept)
    return best_static(table)


def oracle_set(table: Table, must: list[int], size: int = ORACLE_SET) -> list[int]:
    """The oracle's candidate set (module docstring): ``must`` first, every step's fastest, then
    the fastest by Σ cost (over the steps each can run) up to ``size``."""
    steps = _run_steps(table)
    cost = table.booked[:, steps]
    out = list(dict.fromkeys(k for k in must if k is not None))
    winners = [int(k) for k in dict.fromkeys(np.argmin(cost, axis=0).tolist())]
    winners.sort(key=lambda k: -int((np.argmin(cost, axis=0) == k).sum()))  # the most steps won first
    out += [k for k in winners if k not in out]
    finite = np.isfinite(cost)
    score = np.where(finite, cost, 0).sum(axis=1) / np.maximum(finite.sum(axis=1), 1) + 1e30 * (~finite).sum(axis=1)
    for k in np.argsort(score, kind="stable").tolist():
        if len(out) >= size:
            break
        if finite[k].any() and k not in out:
            out.append(int(k))
    return out


def viterbi(table: Table, ks: list[int]) -> list[int]:
    """The least-time sequence of ``ks``'s templates over the runnable steps, booked as
    ``path_of`` books it (``Table.booked``: over the memory a restart and the step again, the
    waits that follow a step at its pace; ``Table.move``: the cheaper of the world's transition
    and a restart; dynamic programming over the steps, the first plan free). Exact with the
    moves priced lazily: a move never costs less than 0 (``restart_seconds`` ≥ 0, the world's
    transitions ≥ 0), so for plan j at a step only the plans whose time so far is below staying
    on j's (its time plus j's own move, 0 unless the devices change) are priced as the step's
    predecessors."""
    steps = _run_steps(table)
    cost = table.booked[np.ix_(ks, steps)]
    value = cost[:, 0].copy()
    back = np.zeros((len(steps), len(ks)), dtype=np.int64)
    for x in range(1, len(steps)):
        a, b = int(table.devices[steps[x - 1]]), int(table.devices[steps[x]])
        order = np.argsort(value, kind="stable")
        best = np.empty(len(ks))
        for j in range(len(ks)):
            arg, low = j, value[j] + table.move(ks[j], ks[j], a, b, steps[x] + 1) if np.isfinite(value[j]) else math.inf
            for i in order:
                if value[i] >= low:
                    break
                if i != j:
                    tot = value[i] + table.move(ks[i], ks[j], a, b, steps[x] + 1)
                    if tot < low:
                        arg, low = int(i), tot
            back[x, j], best[j] = arg, low
        value = best + cost[:, x]
    if not np.isfinite(value).any():
        raise SimulateError(f"oracle: no plan of its candidate set ({len(ks)}) holds a replica on every runnable step of trace {table.name!r}")
    j = int(np.argmin(value))
    seq = [j]
    for x in range(len(steps) - 1, 0, -1):
        j = int(back[x, j])
        seq.append(j)
    return [ks[j] for j in reversed(seq)]


def greedy(table: Table, ks: list[int]) -> list[int]:
    """Each runnable step, the set's fastest template for it."""
    steps = _run_steps(table)
    cost = table.booked[np.ix_(ks, steps)]
    if not np.isfinite(cost).any(axis=0).all():
        raise SimulateError(f"greedy: a runnable step of trace {table.name!r} on which no plan of the oracle's set holds a replica")
    return [ks[int(j)] for j in np.argmin(cost, axis=0)]


def free_moves(table: Table) -> float:
    """Σ over the runnable steps of the pool's fastest (booked: restarts and waits counted),
    moves free: no sequence of the pool's plans beats it."""
    steps = _run_steps(table)
    return float(table.booked[:, steps].min(axis=0).sum())
