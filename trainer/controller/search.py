"""The best plans for a job, a world and a workload, under the memory budget (pure).

1. Candidates per model-stage: every (tp, pp, dp, dp_shard, micro_batch_size) that fits the
   stage's ranks and model — tp and pp powers of two (tp dividing heads, vocabulary and
   MLP width; pp at most the layers; generation pp = 1), dp the rest, dp dividing the rows it
   splits, FSDP only for training, micro-batches halving the replica's rows down to 1/16.
2. Each candidate is priced by the step-time model (``steptime``; a weight sync's cost is
   charged to the stage it fills) and the memory model at the workload's width
   (``memory.pipeline_memory``: the largest resident and transient of its pipeline stages).
3. Per model-stage, the Pareto frontier of (seconds, resident, transient): a candidate
   slower and no smaller in both memories than another is dropped.
4. Combined stage by stage (dynamic programming over Pareto sets): a partial plan carries
   its seconds, the resident bytes it puts on each rank group, its largest transient there
   and the kinds of training layout it puts there; a rank's peak is Σ resident + max
   transient (co-located stages run one after another), corrected for its class of layouts
   (``MemoryFit``). Partial plans over the budget, or dominated, are dropped (at most ``beam``
   kept per step, fastest first).
5. Placements: ``colocated`` (every model-stage on all ranks, in turn) and ``split``
   (generation on the first half of the ranks, the other stages on the second half).

``search`` returns the plans ranked by predicted step seconds, the best first, each with
its predicted seconds per model-stage and peak bytes per rank group. A job that no plan
fits is a ``ConfigError`` saying the smallest peak found and by how much it misses.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from nereus.reshard.derive import check_tp
from nereus.reshard.errors import LayoutError

from ..config import ConfigError, JobConfig, PlanConfig, StageConfig
from ..stage_args import model_args
from .memory import GIB, HEADROOM, gib, pipeline_memory
from .profiles import DeviceProfile
from .steptime import Placement, StepTimeModel, stage_features, sync_features
from .workload import Workload

PLACEMENTS = ("colocated", "split")
SYNCED = {"actor.gen": "actor.train", "critic.infer": "critic.train"}  # destination <- source of a weight sync


def layout_kind(sc: StageConfig) -> str:
    """What a training layout adds that the memory model may miss: FSDP2's buffers, TP's and
    PP's communication buffers (``MemoryFit`` corrects each kind apart)."""
    kind = ("fsdp" if sc.dp_shard else "") + ("tp" if sc.tp > 1 else "") + ("pp" if sc.pp > 1 else "")
    return kind or "replicated"


def rank_class(stages) -> str:
    """The memory class of a rank: the kinds of the training layouts it holds, e.g.
    ``actor.train:fsdp,critic.train:tp`` (``stages``: (key, StageConfig or its
    ``layout_kind``) pairs)."""
    return ",".join(sorted(f"{key}:{sc if isinstance(sc, str) else layout_kind(sc)}" for key, sc in stages if key.endswith(".train")))


@dataclass(frozen=True, kw_only=True)
class MemoryFit:
    """The memory model's correction, fitted to measured peaks (``online.fit_memory``): a
    rank of class ``c`` (``rank_class``) peaks at ``resident + transient + offsets[c]``. A
    class the job has not run yet gets the largest offset measured plus ``unseen`` of the
    model's own figure: its buffers are unknown until it runs. Before any step: the model."""

    offsets: dict[str, float] = field(default_factory=dict)
    unseen: float = 0.0

    def terms(self, cls: str) -> tuple[float, float]:
        """(offset, margin): the peak is ``(resident + transient) · (1 + margin) + offset``."""
        if cls in self.offsets or not self.offsets:
            return self.offsets.get(cls, 0.0), 0.0
        return max(self.offsets.values()), self.unseen

    def peak(self, resident: float, transient: float, cls: str = "") -> float:
        offset, margin = self.terms(cls)
        return (resident + transient) * (1.0 + margin) + offset


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    key: str
    config: StageConfig
    seconds: float
    resident: int
    transient: int
    group: int  # the rank group it runs on (0, or 1 for split's non-generation stages)
    kind: str = ""  # layout_kind(config)


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
    from ..stage_args import model_args

    limits = cfg.controller
    if limits.stages is not None and key not in limits.stages:
        return [cfg.plan.stages()[key]]
    spec = model_args(cfg, key).spec
    n = len(ranks)
    train, gen = key.endswith(".train"), key.endswith(".gen")
    vllm = gen and cfg.rollout.engine == "vllm"
    explicit = None if ranks == tuple(range(cfg.nproc)) else ranks
    out = []
    max_tp = 1 if vllm and cfg.device_profile == "cpu" else (limits.max_tp or n)  # vLLM's CPU build: tp=1 (config.py)
    for tp in _pow2(min(n, max_tp)):
        try:
            check_tp(spec, tp)
        except LayoutError:
            continue
        for pp in [1] if gen else _pow2(min(spec.num_layers, n // tp, limits.max_pp or n)):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            rows = work.minibatch if train else work.batch
            if rows % dp:
                continue
            per_replica = rows // dp
            for shard in ((False, True) if train and dp > 1 else (False,)):
                micro = [None] if gen else [None] + [per_replica // k for k in (2, 4, 8, 16) if per_replica % k == 0]
                for mbs in micro:
                    out.append(StageConfig(dp=dp, tp=tp, pp=pp, ranks=explicit, dp_shard=shard, fused=vllm, micro_batch_size=mbs))
    return out


def stage_seconds(cfg: JobConfig, key: str, sc: StageConfig, work: Workload, where: Placement, model: StepTimeModel, args=None) -> float:
    """Predicted seconds of model-stage ``key`` under ``sc``: the weight sync that fills it
    included, and for a training stage its own forward where the step runs one (the actor's
    old log-probs off-policy; the critic's values without a ``critic.infer``)."""
    seconds = model.predict(stage_features(cfg, key, sc, work, where, args=args))
    if key in SYNCED:
        seconds += model.predict(sync_features(cfg, key, sc, where, args=args))
    if (key == "actor.train" and not cfg.on_policy) or (key == "critic.train" and "critic.infer" not in cfg.plan.stages()):
        seconds += model.predict(stage_features(cfg, key, sc, work, where, mode="infer", args=args))
    return seconds


def plan_seconds(cfg: JobConfig, plan: PlanConfig, work: Workload, where: Placement, model: StepTimeModel) -> dict[str, float]:
    """Predicted seconds per model-stage of ``plan`` (``stage_seconds``)."""
    return {key: stage_seconds(cfg, key, sc, work, where, model) for key, sc in plan.stages().items()}


def _price(cfg: JobConfig, key: str, sc: StageConfig, work: Workload, where: Placement, model: StepTimeModel, group: int, args) -> Candidate:
    seconds = stage_seconds(cfg, key, sc, work, where, model, args)
    memory = pipeline_memory(cfg, key, sc, seq=work.width, ends=True, args=args)
    return Candidate(key=key, config=sc, seconds=seconds, resident=max(m.resident for m in memory),
                     transient=max(m.transient for m in memory), group=group, kind=layout_kind(sc))


def frontier(candidates: list[Candidate]) -> list[Candidate]:
    """The Pareto-minimal candidates in (seconds, resident, transient) of each layout kind
    (kinds are corrected apart: ``MemoryFit``), fastest first."""
    out = []
    for kind in sorted({c.kind for c in candidates}):
        ordered = sorted((c for c in candidates if c.kind == kind), key=lambda c: (c.seconds, c.resident, c.transient))
        mem = np.array([[c.resident, c.transient] for c in ordered], dtype=np.float64).reshape(-1, 2)
        out += [ordered[i] for i in _undominated(mem)]
    return sorted(out, key=lambda c: c.seconds)


def _undominated(mem: np.ndarray, limit: int | None = None) -> list[int]:
    """Indices of rows (already sorted by time) that no earlier row matches or beats in every
    memory column: the Pareto set in (time, memory...). At most ``limit`` kept, earliest first."""
    n = len(mem)
    if n == 0:
        return []
    # earlier[i, j]: row j comes before row i and holds no more than it anywhere
    le = (mem[None, :, :] <= mem[:, None, :]).all(axis=2)
    earlier = np.tril(le, k=-1)
    keep = ~earlier.any(axis=1)
    idx = np.flatnonzero(keep)
    return idx[:limit].tolist() if limit else idx.tolist()


def placement_groups(cfg: JobConfig, placement: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Model-stage -> (rank group id, its ranks) under a placement."""
    everyone = tuple(range(cfg.nproc))
    keys = list(cfg.plan.stages())
    if placement == "colocated" or cfg.nproc < 2:
        return {k: (0, everyone) for k in keys}
    half = cfg.nproc // 2
    return {k: ((0, everyone[:half]) if k.endswith(".gen") else (1, everyone[half:])) for k in keys}


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
) -> SearchResult:
    """The ``top`` best plans (module docstring). ``cfg`` gives the job and the model-stages
    to place (its plan's keys; its layouts only for the stages the controller may not move).
    ``model``: default the profile's priors."""
    t0 = time.perf_counter()
    model = model or StepTimeModel.for_profile(profile)
    where = Placement(nproc=cfg.nproc, profile=profile)
    budget = device_budget(cfg, profile)
    choices: list[PlanChoice] = []
    counted, smallest, notes = 0, math.inf, []
    vllm_fixed = cfg.rollout.engine == "vllm"
    for placement in placements:
        if placement == "split" and (cfg.nproc < 2 or vllm_fixed or cfg.controller.stages is not None):
            continue  # vLLM runs on every rank (its external launcher); stages kept as they are keep their ranks
        groups = placement_groups(cfg, placement)
        fronts = {}
        for key, (group, ranks) in groups.items():
            args = model_args(cfg, key)
            cands = [_price(cfg, key, sc, work, where, model, group, args) for sc in stage_options(cfg, key, ranks, work)]
            counted += len(cands)
            if not cands:
                notes.append(f"{placement}: no layout of {key} fits {len(ranks)} ranks")
                break
            fronts[key] = frontier(cands)
        else:
            # (seconds, resident per group, max transient per group, picked, training kinds per
            # group, their correction (offset, margin) per group)
            none = fit.terms(rank_class(()))
            partial: list[tuple] = [(0.0, (0, 0), (0, 0), (), ((), ()), (none, none))]
            classes: dict = {}  # (kinds of a group, key, kind) -> (its kinds, their correction)
            for depth, (key, front) in enumerate(fronts.items(), 1):
                grown = []
                train = key.endswith(".train")
                for secs, res, tr, picked, kinds, corr in partial:
                    for c in front:
                        g = c.group
                        r, t = list(res), list(tr)
                        r[g] += c.resident
                        t[g] = max(t[g], c.transient)
                        k, co = kinds, corr
                        if train:
                            step = (kinds[g], key, c.kind)
                            got = classes.get(step)
                            if got is None:
                                grown_kinds = (*kinds[g], (key, c.kind))
                                got = classes[step] = (grown_kinds, fit.terms(rank_class(grown_kinds)))
                            k = (got[0], kinds[1]) if g == 0 else (kinds[0], got[0])
                            co = (got[1], corr[1]) if g == 0 else (corr[0], got[1])
                        grown.append((secs + c.seconds, tuple(r), tuple(t), (*picked, c), k, co))
                partial, worst = _prune(grown, budget, beam, final=depth == len(fronts))
                if depth == len(fronts) or not partial:  # complete plans, or the stage where all went over
                    smallest = min(smallest, worst)
                if not partial:
                    break
            for secs, res, tr, picked, kinds, _ in partial:
                plan = _plan(cfg, picked)
                peaks = {g: fit.peak(res[g], tr[g], rank_class(kinds[g])) * HEADROOM for g in sorted({c.group for c in picked})}
                choices.append(PlanChoice(plan=plan, seconds=secs, stage_seconds={c.key: c.seconds for c in picked},
                                          peak_bytes=peaks, placement=placement))
    choices.sort(key=lambda c: c.seconds)
    ms = (time.perf_counter() - t0) * 1e3
    if not choices:
        if budget is not None and smallest < math.inf:
            named = f"device_memory_gib={cfg.device_memory_gib:g}" if cfg.device_memory_gib is not None else f"the {profile.name}'s {profile.memory_gib:g} GiB"
            raise ConfigError(
                f"no plan of {cfg.nproc} ranks fits {named}: the smallest peak found "
                f"is {gib(smallest)} GiB with 10% headroom, {gib(smallest - budget)} GiB over"
            )
        raise ConfigError(f"no plan of {cfg.nproc} ranks runs this job: {'; '.join(notes) or 'no layout fits'}")
    return SearchResult(plans=choices[:top], candidates=counted, milliseconds=ms, budget=budget, smallest_peak=smallest, notes=notes)


def _prune(grown: list, budget: float | None, beam: int, *, final: bool) -> tuple[list, float]:
    """Drop plans over the budget, then dominated ones; keep the ``beam`` fastest of the
    rest. Also the smallest peak (with headroom) among ``grown``.

    A complete plan (``final``) is judged by its corrected peak (``MemoryFit``) and dominated
    by one no slower, no larger and no more corrected anywhere. A partial plan's correction is
    not known until every training stage has joined its rank classes, so it is judged by its
    uncorrected peak — a lower bound of any completion's, corrections being ≥ 0 — and
    dominated only within its classes so far."""
    if not grown:
        return [], math.inf
    res = np.array([g[1] for g in grown], dtype=np.float64)
    tr = np.array([g[2] for g in grown], dtype=np.float64)
    if final:
        corr = np.array([g[5] for g in grown], dtype=np.float64)  # (entries, groups, 2)
        offset, margin = corr[..., 0], corr[..., 1]
        peak = ((res + tr) * (1.0 + margin) + offset) * HEADROOM
        mem = np.hstack([res, tr, offset, margin])
    else:
        peak, mem = (res + tr) * HEADROOM, np.hstack([res, tr])
    worst = peak.max(axis=1)
    ok = worst <= budget if budget is not None else np.ones(len(grown), dtype=bool)
    idx = np.flatnonzero(ok)
    if not len(idx):
        return [], float(worst.min())
    idx = idx[np.argsort([grown[i][0] for i in idx], kind="stable")]
    classes: dict = {}
    for i in idx:  # fastest first within each class
        classes.setdefault(None if final else grown[i][4], []).append(i)
    kept = []
    for members in classes.values():
        members = np.array(members[: 8 * beam])  # dominance is O(n²) in memory: the fastest few
        kept += [members[j] for j in _undominated(mem[members], beam)]
    kept.sort(key=lambda i: grown[i][0])
    return [grown[i] for i in kept[:beam]], float(worst.min())


def _plan(cfg: JobConfig, picked: tuple[Candidate, ...]) -> PlanConfig:
    stages = {c.key: c.config for c in picked}
    plan = cfg.plan
    for key, sc in stages.items():
        model, stage = key.split(".")
        sub = getattr(plan, model)
        plan = dataclasses.replace(plan, **{model: dataclasses.replace(sub, **{stage: sc})})
    return plan
