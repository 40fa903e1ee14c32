"""The best plans for a job, a world and a workload, under the memory budget (pure).

1. Candidates per model-stage: every (tp, pp, dp, dp_shard) layout that fits the stage's
   ranks and model — tp and pp powers of two (tp dividing heads and MLP width, fitting the KV
   heads, at most the vocabulary, which it need not divide: ``reshard.derive.check_tp``;
   pp at most the layers; generation pp = 1, and only the layouts its rollout engine admits:
   ``rollout.engine.check_rollout_plan``), dp the rest, dp dividing the rows it splits,
   FSDP only for training — run whole, in micro-batches halving the replica's rows down to
   1/16, or — when the workload's rows are shorter than its width on average, padding to
   remove — packed into token budgets of as many longest rows (``micro_batch_tokens``:
   rows … rows/16 of them); training stages also with activation recompute ``selective``
   and ``full`` (``_knobs``). They are arrays (``candidates.Candidates``), a StageConfig
   built only for the plans returned.
2. Each model-stage's candidates are priced at once by the step-time model (``steptime``;
   a weight sync's cost is charged to the stage it fills) and the memory model at the
   workload's width (``memory.candidate_memory``: the largest resident and transient of its
   pipeline stages).
3. Per model-stage, the Pareto frontier of (seconds, resident, transient) per layout kind: a
   candidate slower and no smaller in both memories than another is dropped (first within
   each layout, all layouts at once, then across the kind's layouts).
4. Combined stage by stage (dynamic programming over Pareto sets): a partial plan carries
   its seconds, the resident bytes it puts on each rank group, its largest transient there
   and the kinds of training layout it puts there; a rank's peak is Σ resident + max
   transient (co-located stages run one after another), corrected for its class of layouts
   (``MemoryFit``). Partial plans over the budget, or dominated, are dropped (at most ``beam``
   kept per step, fastest first). Every partial plan and its growth are rows of arrays; the
   pruning scans them fastest first and stops once ``beam`` are kept (and their ties), which
   keeps exactly the rows comparing every pair would (``_pareto``).
5. Placements: ``colocated`` (every model-stage on all ranks, in turn) and ``split``
   (generation on the first half of the ranks, the other stages on the second half).

``search`` returns the plans ranked by predicted step seconds, the best first, each with
its predicted seconds per model-stage and peak bytes per rank group. A job that no plan
fits is a ``ConfigError`` saying the smallest peak found and by how much it misses.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from nereus.reshard.derive import check_tp
from nereus.reshard.errors import LayoutError

from ..config import ConfigError, JobConfig, PlanConfig, StageConfig
from ..config.names import INFER, SYNCED, is_gen, is_train, split_key
from ..data.tasks import longest_row
from ..models.args import model_args
from ..rollout.engine import rollout_plan_ok
from .candidates import RECOMPUTE, Candidates, kept_of
from .classes import ClassRegistry, MemoryFit, layout_kind, rank_class
from .memory import GIB, candidate_memory, gib, priced_peak
from .profiles import DeviceProfile
from .steptime import Placement, StepTimeModel, candidate_features, candidate_sync_features
from .workload import Workload

PLACEMENTS = ("colocated", "split")


@dataclass(frozen=True, kw_only=True)
class PlanChoice:
    plan: PlanConfig
    seconds: float
    stage_seconds: dict[str, float]
    peak_bytes: dict[int, float]
    """Calibrated peak (with headroom) per rank group."""
    placement: str


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    plans: list[PlanChoice]
    candidates: int
    milliseconds: float
    budget: float | None
    smallest_peak: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> PlanChoice:
        return self.plans[0]


def device_budget(cfg: JobConfig, profile: DeviceProfile) -> float | None:
    """A rank's memory budget in bytes: ``device_memory_gib``, else a GPU profile's memory
    (a CPU rank shares the machine's: no default)."""
    if cfg.device_memory_gib is not None:
        return cfg.device_memory_gib * GIB
    return profile.memory_gib * GIB if profile.kind != "cpu" and profile.memory_gib else None


def _pow2(limit: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def stage_options(cfg: JobConfig, key: str, ranks: tuple[int, ...], work: Workload) -> list[StageConfig]:
    """Every stage config of ``key`` on ``ranks`` the trainer can run (module docstring, 1),
    within ``controller.stages``/``max_tp``/``max_pp`` (a stage the controller may not move
    keeps the job's)."""
    return stage_candidates(cfg, key, ranks, work).configs()


def stage_candidates(cfg: JobConfig, key: str, ranks: tuple[int, ...], work: Workload) -> Candidates:
    """``stage_options`` as arrays (``Candidates``), without building a StageConfig each."""
    return _stage_candidates(cfg, key, ranks, work.minibatch if is_train(key) else work.batch, work.row_mean < work.width)


@functools.lru_cache(maxsize=256)
def _stage_candidates(cfg: JobConfig, key: str, ranks: tuple[int, ...], rows: int, packing: bool) -> Candidates:
    """``stage_candidates`` of a stage whose replicas split ``rows`` rows, with token budgets
    when ``packing`` (cached: the options depend on the workload through these only)."""
    limits = cfg.controller
    if limits.stages is not None and key not in limits.stages:
        return Candidates.of([cfg.plan.stages()[key]])
    spec = model_args(cfg, key).spec
    n = len(ranks)
    train, gen = is_train(key), is_gen(key)
    vllm = gen and cfg.rollout.engine == "vllm"
    explicit = None if ranks == tuple(range(cfg.nproc)) else ranks
    longest = longest_row(cfg)
    layouts, knobs = [], []  # per layout: its (micro_batch_size, micro_batch_tokens, recompute) rows
    cpu = cfg.device_profile == "cpu"  # the profile the plan is searched for: vLLM's CPU build where it is a CPU's
    for tp in _pow2(min(n, limits.max_tp or n)):
        try:
            check_tp(spec, tp)
        except LayoutError:
            continue
        for pp in [1] if gen else _pow2(min(spec.num_layers, n // tp, limits.max_pp or n)):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            if rows % dp:
                continue
            per_replica = rows // dp
            for shard in ((False, True) if train and dp > 1 else (False,)):
                sc = StageConfig(dp=dp, tp=tp, pp=pp, ranks=explicit, dp_shard=shard, fused=vllm)
                # the engine's rules; on vLLM's CPU build its tp rule only: a head size it cannot run is the
                # environment check's one-line error (prepare.py), not a search that finds no layout
                if gen and not (rollout_plan_ok(sc, cfg.rollout.engine, spec=spec, world=n) and rollout_plan_ok(sc, cfg.rollout.engine, cpu=cpu)):
                    continue
                layouts.append(sc)
                knobs.append(_knobs(per_replica, longest, gen=gen, train=train, packing=packing))
    table = np.array([k for ks in knobs for k in ks], dtype=np.int64).reshape(-1, 3)
    return Candidates(layouts=tuple(layouts), layout=np.repeat(np.arange(len(layouts)), [len(k) for k in knobs]),
                      micro_batch_size=table[:, 0], micro_batch_tokens=table[:, 1], recompute=table[:, 2])


@functools.lru_cache(maxsize=1024)
def _knobs(rows: int, longest: int, *, gen: bool, train: bool, packing: bool) -> tuple[tuple[int, int, int], ...]:
    """(micro_batch_size, micro_batch_tokens, recompute index) options of a replica of
    ``rows`` rows (module docstring, 1): the rollout runs its whole batch; the others whole,
    or in micro-batches of rows/2 … rows/16 rows, or, when rows are shorter than the batch is
    wide on average (``packing``: padding to remove), packed into budgets of that many
    longest rows (rows … rows/16 of ``longest`` tokens); training also with each recompute."""
    if gen:
        return ((0, 0, 0),)
    splits = [k for k in (1, 2, 4, 8, 16) if rows % k == 0]
    batching = [(0, 0)] + [(rows // k, 0) for k in splits[1:]] + [(0, longest * rows // k) for k in splits if packing]
    return tuple((m, t, r) for r in (range(len(RECOMPUTE)) if train else (0,)) for m, t in batching)


def stage_seconds(cfg: JobConfig, key: str, sc: StageConfig, work: Workload, where: Placement, model: StepTimeModel, args=None) -> float:
    """Predicted seconds of model-stage ``key`` under ``sc``: the weight sync that fills it
    included, and for a training stage its own forward where the step runs one (the actor's
    old log-probs off-policy; the critic's values without a ``critic.infer``)."""
    return float(candidate_seconds(cfg, key, kept_of((sc,)), work, where, model, args)[0])


def candidate_seconds(cfg: JobConfig, key: str, c: Candidates, work: Workload, where: Placement, model: StepTimeModel, args=None) -> np.ndarray:
    """``stage_seconds`` of every candidate of ``c`` at once, each × its layout's correction
    (``StepTimeModel.corrections``: what the job measured of a layout it ran)."""
    seconds = model.predict(candidate_features(cfg, key, c, work, where, args=args))
    if key in SYNCED:
        seconds = seconds + model.predict(candidate_sync_features(cfg, key, c, where, args=args))
    if cfg.own_forward(key):
        seconds = seconds + model.predict(candidate_features(cfg, key, c, work, where, mode=INFER, args=args))
    return seconds * model.layout_factors(key, c, where.nproc)


def plan_seconds(cfg: JobConfig, plan: PlanConfig, work: Workload, where: Placement, model: StepTimeModel) -> dict[str, float]:
    """Predicted seconds per model-stage of ``plan`` (``stage_seconds``)."""
    return {key: stage_seconds(cfg, key, sc, work, where, model) for key, sc in plan.stages().items()}


@dataclass(frozen=True, kw_only=True)
class Priced:
    """A model-stage's candidates on one rank group with their predicted seconds and memory
    (arrays, one entry per candidate) and their layout kinds (``layout_kind``)."""

    key: str
    group: int
    candidates: Candidates
    seconds: np.ndarray
    resident: np.ndarray
    transient: np.ndarray
    kind: np.ndarray
    """Per candidate: its index in ``kinds``."""
    kinds: tuple[str, ...]


def price(cfg: JobConfig, key: str, c: Candidates, work: Workload, where: Placement, model: StepTimeModel, group: int) -> Priced:
    """Every candidate of ``c`` priced by the step-time and memory models at the workload's width."""
    args = model_args(cfg, key)
    resident, transient = candidate_memory(cfg, key, c, seq=work.width, args=args)
    kinds, kind = c.derived(("kinds",), lambda: _kinds(c))  # of the candidates alone: once per Candidates
    return Priced(key=key, group=group, candidates=c, seconds=candidate_seconds(cfg, key, c, work, where, model, args),
                  resident=resident, transient=transient, kinds=kinds, kind=kind)


def _kinds(c: Candidates) -> tuple[tuple[str, ...], np.ndarray]:
    """The layout kinds of ``c``'s candidates (sorted names) and each candidate's index in them."""
    knobs = np.stack([c.layout, c.recompute, c.micro_batch_tokens > 0], axis=1)
    distinct, inverse = np.unique(knobs, axis=0, return_inverse=True)
    names = [_kind(c.layouts[lay], r, packed) for lay, r, packed in distinct.tolist()]
    kinds = tuple(sorted(set(names)))
    return kinds, np.array([kinds.index(k) for k in names], dtype=np.int64)[inverse.ravel()]


@functools.lru_cache(maxsize=4096)
def _kind(layout: StageConfig, recompute: int, packed: bool) -> str:
    return layout_kind(dataclasses.replace(layout, recompute=RECOMPUTE[recompute], micro_batch_tokens=1 if packed else None))


def frontier(p: Priced) -> np.ndarray:
    """Indices of the Pareto-minimal candidates in (seconds, resident, transient) of each
    layout kind (kinds are corrected apart: ``MemoryFit``), fastest first (ties: by kind name,
    then resident, then transient)."""
    order = np.lexsort((p.transient, p.resident, p.seconds))
    mem = np.stack([p.resident[order], p.transient[order]], axis=1).astype(np.float64)
    # first within each layout and kind (all at once): a candidate beaten by one of its own
    # layout and kind is beaten within its kind, so dropping it early changes nothing
    alive = ~_beaten_in_layout(p.candidates.layout[order] * len(p.kinds) + p.kind[order], mem)
    order, mem = order[alive], mem[alive]
    # then within each kind: no quota, so a row is kept iff no earlier row of its kind matches
    # it, whether that row was kept or not (one that was not is matched by an earlier kept one,
    # which then matches this row too) — all pairs at once while the kinds are small
    small = len(order) and np.bincount(p.kind[order]).max() <= GRID
    kept = np.flatnonzero(~_beaten_in_layout(p.kind[order], mem)) if small else _pareto(mem, p.kind[order])
    kept = kept[np.lexsort((kept, p.kind[order][kept], p.seconds[order][kept]))]
    return order[kept]


GRID = 256
"""The most rows of one group ``frontier`` compares all pairs of at once ([groups, GRID, GRID] booleans)."""


def _beaten_in_layout(layout: np.ndarray, mem: np.ndarray) -> np.ndarray:
    """Per row (sorted by time): an earlier row of the same ``layout`` holds no more than it
    in every column of ``mem``. Every layout's rows at once, in a [layouts, n, n] grid."""
    if not len(layout):
        return np.zeros(0, dtype=bool)
    layout = np.unique(layout, return_inverse=True)[1].ravel()  # dense ids
    by = np.argsort(layout, kind="stable")
    counts = np.bincount(layout)
    rank = np.arange(len(by)) - (np.cumsum(counts) - counts)[layout[by]]
    grid = np.full((len(counts), int(counts.max()), mem.shape[1]), np.inf)  # padding beats nothing
    grid[layout[by], rank] = mem[by]
    beaten = np.tri(grid.shape[1], k=-1, dtype=bool)[None]  # [layout, i, j]: j before i
    for col in range(mem.shape[1]):
        beaten = beaten & (grid[:, None, :, col] <= grid[:, :, None, col])
    out = np.zeros(len(layout), dtype=bool)
    out[by] = beaten.any(axis=2)[layout[by], rank]
    return out


BLOCK = 128
"""Rows ``_pareto`` compares at once ([BLOCK, BLOCK] boolean matrices)."""


def _pareto(mem: np.ndarray, group: np.ndarray, *, per_group: int | None = None, cap: int | None = None, until=None) -> np.ndarray:
    """Rows (sorted by time) that no earlier row of their ``group`` matches or beats in every
    column of ``mem``, in row order: the Pareto set in (time, memory...) of each group, of its
    first ``cap`` rows only, at most ``per_group`` of each (the earliest).

    Rows are taken ``BLOCK`` at a time, each checked against the rows kept so far and the
    earlier rows of its block: an earlier row that was dropped is itself matched by an
    earlier kept one, which then matches this row too (``<=`` is transitive); a row past its
    group's cap comes after all the group's others, so it could only match those past it
    too, and a group past its cap or its quota is not scanned further. ``until(kept)``: the
    number of leading rows that must be scanned given the rows kept so far (default all);
    the scan stops past them. Columns equal in every row decide
    nothing and are left out. ``group``: non-negative integers, made dense here (the
    per-group counters are arrays as long as the groups: a partial plan's class pairs can
    number up to classes², of which a few hundred occur)."""
    n = len(mem)
    mem = mem[:, (mem != mem[:1]).any(axis=0)] if n else mem
    if n and int(group.max()) >= 4 * n:  # only equality of groups matters: any one-to-one relabelling keeps the same rows
        group = np.unique(group, return_inverse=True)[1].ravel()
    kept = np.zeros(0, dtype=np.int64)
    counts = np.zeros(int(group.max()) + 1 if n else 0, dtype=np.int64)  # kept per group
    seen = counts.copy()  # rows scanned per group
    todo = np.arange(n)  # the rows of groups that may still keep one, in order
    while len(todo) and (until is None or todo[0] < until(kept)):
        at, todo = todo[:BLOCK], todo[BLOCK:]
        rows, g = mem[at], group[at]
        earlier = np.tri(len(rows), k=-1, dtype=bool) & (g[None, :] == g[:, None])
        no_more = earlier.copy()  # no_more[i, j]: row j, earlier and of i's group, holds no more than row i anywhere
        for col in rows.T:
            no_more &= col[None, :] <= col[:, None]
        alive = ~no_more.any(axis=1)
        if len(kept):
            held = group[kept][None, :] == g[:, None]
            for col, old in zip(rows.T, mem[kept].T):
                held &= old[None, :] <= col[:, None]
            alive &= ~held.any(axis=1)
        if cap is not None:  # the group's first cap rows only
            alive &= seen[g] + earlier.sum(axis=1) < cap
            seen += np.bincount(g, minlength=len(seen))
        if per_group is not None:  # the earliest per_group of each group only
            alive &= counts[g] + (earlier & alive[None, :]).sum(axis=1) < per_group
            counts += np.bincount(g[alive], minlength=len(counts))
        kept = np.concatenate([kept, at[alive]])
        if cap is not None or per_group is not None:  # a group past its cap or its quota keeps no more rows
            done = (seen >= (cap if cap is not None else n + 1)) | (counts >= (per_group if per_group is not None else n + 1))
            todo = todo[~done[group[todo]]]
    return kept


def placement_groups(cfg: JobConfig, placement: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Model-stage -> (rank group id, its ranks) under a placement."""
    everyone = tuple(range(cfg.nproc))
    keys = list(cfg.plan.stages())
    if placement == "colocated" or cfg.nproc < 2:
        return {k: (0, everyone) for k in keys}
    half = cfg.nproc // 2
    return {k: ((0, everyone[:half]) if is_gen(k) else (1, everyone[half:])) for k in keys}


def running_groups(cfg: JobConfig, plan: PlanConfig) -> dict[str, tuple[int, tuple[int, ...]]] | None:
    """``placement_groups`` of ``plan`` as it runs: model-stages on the same ranks share a
    group; None unless its stages run on all ranks or on two disjoint rank sets."""
    everyone = tuple(range(cfg.nproc))
    ranks = {key: tuple(sc.ranks) if sc.ranks is not None else everyone for key, sc in plan.stages().items()}
    sets = list(dict.fromkeys(ranks.values()))
    if len(sets) > 2 or (len(sets) == 2 and set(sets[0]) & set(sets[1])):
        return None
    return {key: (sets.index(r), r) for key, r in ranks.items()}


@dataclass(kw_only=True)
class _Partial:
    """Partial plans as arrays, one row each: seconds, resident bytes and largest transient
    per rank group, the class id per group and the candidate picked per model-stage so far."""

    seconds: np.ndarray
    resident: np.ndarray
    transient: np.ndarray
    classes: np.ndarray
    picks: np.ndarray

    def take(self, idx) -> _Partial:
        return _Partial(seconds=self.seconds[idx], resident=self.resident[idx], transient=self.transient[idx],
                        classes=self.classes[idx], picks=self.picks[idx])

    def grow(self, p: Priced, front: np.ndarray, classes: ClassRegistry, rows: np.ndarray | None = None) -> _Partial:
        """Every partial plan followed by every candidate of ``front`` (partial-major), or only
        the rows ``rows`` (ascending) of that product."""
        n, m, g = len(self.seconds), len(front), p.group
        seconds = (self.seconds[:, None] + p.seconds[front][None, :]).ravel()
        old, new = (np.repeat(np.arange(n), m), np.tile(front, n)) if rows is None else (rows // m, front[rows % m])
        resident, transient, ids = self.resident[old], self.transient[old], self.classes[old]
        resident[:, g] += p.resident[new]
        transient[:, g] = np.maximum(transient[:, g], p.transient[new])
        if is_train(p.key):
            ids[:, g] = classes.grow(ids[:, g], p.key, p.kind[new], p.kinds)
        return _Partial(seconds=seconds if rows is None else seconds[rows], resident=resident, transient=transient, classes=ids,
                        picks=np.hstack([self.picks[old], new[:, None]]))


SUBSET = 2048
"""Rows of a stage's growth ``_extend`` prunes first: the fastest (and their ties)."""


def _extend(partial: _Partial, p: Priced, front: np.ndarray, classes: ClassRegistry, budget: float | None, beam: int,
            *, final: bool) -> tuple[_Partial, float | None]:
    """``partial`` grown by ``p``'s ``front`` and pruned (``_prune``), and the smallest peak
    of the growth (None when not computed: not ``final`` and some rows kept).

    Exact shortcut: a growth of more than ``SUBSET`` rows is first pruned on its rows no
    slower than its ``SUBSET``-th fastest, θ. Those rows are a prefix of what ``_prune``
    scans (fastest first, ties complete), every row's fate depends only on rows before it,
    and once ``beam`` rows are kept the scan never passes the last tie of the beam-th, which
    is ≤ θ — so when the prefix keeps ``beam`` rows, the whole growth keeps the same ones.
    Otherwise (fewer kept) the whole growth is pruned. A complete plan (``final``) is
    always pruned whole: its smallest peak is reported."""
    seconds = (partial.seconds[:, None] + p.seconds[front][None, :]).ravel()
    if not final and len(seconds) > SUBSET:
        theta = np.partition(seconds, SUBSET - 1)[SUBSET - 1]
        grown = partial.grow(p, front, classes, rows=np.flatnonzero(seconds <= theta))
        kept, _ = _prune(grown, classes, budget, beam, final=False)
        if beam and len(kept) == beam:  # (``_prune`` keeps at most beam)
            return grown.take(kept), None
    grown = partial.grow(p, front, classes)
    kept, worst = _prune(grown, classes, budget, beam, final=final)
    return grown.take(kept), worst


def search(
    cfg: JobConfig,
    work: Workload,
    profile: DeviceProfile,
    model: StepTimeModel | None = None,
    *,
    fit: MemoryFit = MemoryFit(),
    placements: tuple[str, ...] = PLACEMENTS,
    top: int = 5,
    beam: int = 48,
    retunes_of: PlanConfig | None = None,
) -> SearchResult:
    """The ``top`` best plans (module docstring). ``cfg`` gives the job and the model-stages
    to place (its plan's keys; its layouts only for the stages the controller may not move).
    ``model``: default the profile's priors. ``retunes_of``: only the plans that keep this
    plan's layouts, retuning micro-batches, token budgets and recompute (no state moves)."""
    t0 = time.perf_counter()
    model = model or StepTimeModel.for_profile(profile)
    where = Placement(nproc=cfg.nproc, profile=profile)
    budget = device_budget(cfg, profile)
    found: list[tuple] = []  # (seconds, placement, priced stages, partial plans, row)
    counted, smallest, notes = 0, math.inf, []
    vllm_fixed = cfg.rollout.engine == "vllm"
    if retunes_of is None:
        tried = [(p, placement_groups(cfg, p)) for p in placements
                 # vLLM runs on every rank (its external launcher); stages kept as they are keep their ranks
                 if not (p == "split" and (cfg.nproc < 2 or vllm_fixed or cfg.controller.stages is not None))]
    else:  # on the ranks each stage runs on now
        groups = running_groups(cfg, retunes_of)
        tried = [("running", groups)] if groups is not None else []
        if groups is None:
            notes.append("running: its model-stages' rank sets overlap in part")
    for placement, groups in tried:
        stages: list[tuple[Priced, np.ndarray]] = []
        for key, (group, ranks) in groups.items():
            cands = stage_candidates(cfg, key, ranks, work)
            if retunes_of is not None:
                sc = retunes_of.stages()[key]
                cands = cands.retunes_of(dataclasses.replace(sc, ranks=None if ranks == tuple(range(cfg.nproc)) else ranks))
            counted += len(cands)
            if not len(cands):
                notes.append(f"{placement}: no layout of {key} fits {len(ranks)} ranks")
                break
            priced = price(cfg, key, cands, work, where, model, group)
            stages.append((priced, frontier(priced)))
        else:
            classes = ClassRegistry(fit)
            partial = _Partial(seconds=np.zeros(1), resident=np.zeros((1, 2), dtype=np.int64), transient=np.zeros((1, 2), dtype=np.int64),
                               classes=np.zeros((1, 2), dtype=np.int64), picks=np.zeros((1, 0), dtype=np.int64))
            for depth, (priced, front) in enumerate(stages, 1):
                partial, worst = _extend(partial, priced, front, classes, budget, beam, final=depth == len(stages))
                if depth == len(stages) or not len(partial.seconds):  # complete plans, or the stage where all went over
                    smallest = min(smallest, worst)
                if not len(partial.seconds):
                    break
            else:
                found += [(float(s), placement, stages, partial, i) for i, s in enumerate(partial.seconds.tolist())]
    found.sort(key=lambda x: x[0])
    choices = [_choice(cfg, fit, *x) for x in found[:top]]
    if retunes_of is not None:  # the stages' ranks as the running plan names them (all ranks: None or named)
        choices = [dataclasses.replace(c, plan=_with_ranks(c.plan, retunes_of)) for c in choices]
    ms = (time.perf_counter() - t0) * 1e3
    if not choices:
        if budget is not None and smallest < math.inf:
            named = f"device_memory_gib={cfg.device_memory_gib:g}" if cfg.device_memory_gib is not None else f"the {profile.name}'s {profile.memory_gib:g} GiB"
            raise ConfigError(
                f"no plan of {cfg.nproc} ranks fits {named}: the smallest peak found "
                f"is {gib(smallest)} GiB with 10% headroom, {gib(smallest - budget)} GiB over"
            )
        raise ConfigError(f"no plan of {cfg.nproc} ranks runs this job: {'; '.join(notes) or 'no layout fits'}")
    return SearchResult(plans=choices, candidates=counted, milliseconds=ms, budget=budget, smallest_peak=smallest, notes=notes)


def _choice(cfg: JobConfig, fit: MemoryFit, seconds: float, placement: str, stages, partial: _Partial, row: int) -> PlanChoice:
    """Complete plan ``row`` of ``partial`` as a PlanChoice."""
    picked = [(p, p.candidates.config(int(partial.picks[row, d]))) for d, (p, _) in enumerate(stages)]
    kinds: dict[int, list] = {}
    for p, sc in picked:
        kinds.setdefault(p.group, []).append((p.key, sc))
    peaks = {g: fit.priced(int(partial.resident[row, g]), int(partial.transient[row, g]), rank_class(kinds[g])) for g in sorted(kinds)}
    return PlanChoice(plan=_plan(cfg, [(p.key, sc) for p, sc in picked]), seconds=seconds, peak_bytes=peaks, placement=placement,
                      stage_seconds={p.key: float(p.seconds[partial.picks[row, d]]) for d, (p, _) in enumerate(stages)})


def _prune(grown: _Partial, classes: ClassRegistry, budget: float | None, beam: int, *, final: bool) -> tuple[np.ndarray, float]:
    """Rows of ``grown`` to keep: drop plans over the budget, then dominated ones; keep the
    ``beam`` fastest of the rest. Also the smallest peak (with headroom) among ``grown``.

    A complete plan (``final``) is judged by its corrected peak (``MemoryFit``) and dominated
    by one no slower, no larger and no more corrected anywhere. A partial plan's correction is
    not known until every training stage has joined its rank classes, so it is judged by its
    uncorrected peak — a lower bound of any completion's, corrections being ≥ 0 — and
    dominated only within its classes so far."""
    if not len(grown.seconds):
        return np.zeros(0, dtype=np.int64), math.inf
    res, tr = grown.resident.astype(np.float64), grown.transient.astype(np.float64)
    if final:
        offset, margin = classes.corrections(grown.classes)
        peak = priced_peak(res, tr, offset, margin)
        mem = np.hstack([res, tr, offset, margin])
    else:
        peak, mem = priced_peak(res, tr, 0.0, 0.0), np.hstack([res, tr])
    worst = peak.max(axis=1)
    idx = np.flatnonzero(worst <= budget) if budget is not None else np.arange(len(worst))
    if not len(idx):
        return idx, float(worst.min())
    idx = idx[np.argsort(grown.seconds[idx], kind="stable")]
    secs = grown.seconds[idx]
    # dominated only within its classes so far (one class when final), among the class's
    # fastest 8·beam (dominance is O(n²) in memory)
    group = np.zeros(len(idx), dtype=np.int64) if final else grown.classes[idx, 0] * len(classes.kinds) + grown.classes[idx, 1]

    def until(kept):  # the beam fastest kept, and every row as fast as the last of them (ties)
        return len(idx) if len(kept) < beam else int(np.searchsorted(secs, secs[kept[beam - 1]], side="right"))

    kept = _pareto(mem[idx], group, per_group=beam, cap=8 * beam, until=until)
    # fastest first; ties by class in the order the classes first appear, then by time
    classes_seen, first = np.unique(group[: kept[-1] + 1], return_index=True)
    kept = kept[np.lexsort((kept, first[np.searchsorted(classes_seen, group[kept])], secs[kept]))]
    return idx[kept[:beam]], float(worst.min())


def _with_ranks(plan: PlanConfig, like: PlanConfig) -> PlanConfig:
    """``plan`` with each stage's ``ranks`` field as ``like`` has it."""
    for key, sc in like.stages().items():
        model, stage = split_key(key)
        part = getattr(plan, model)
        plan = dataclasses.replace(plan, **{model: dataclasses.replace(part, **{stage: dataclasses.replace(getattr(part, stage), ranks=sc.ranks)})})
    return plan


def _plan(cfg: JobConfig, picked: list[tuple[str, StageConfig]]) -> PlanConfig:
    plan = cfg.plan
    for key, sc in picked:
        model, stage = split_key(key)
        sub = getattr(plan, model)
        plan = dataclasses.replace(plan, **{model: dataclasses.replace(sub, **{stage: sc})})
    return plan
