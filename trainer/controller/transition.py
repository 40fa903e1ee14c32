"""What a transition between two plans costs (pure): reshard's estimator and transition graph.

A model-stage whose micro-batch size alone changes costs nothing (it is retuned in place).
For every model-stage whose layout changes, its state (weights, and AdamW state for a
training stage) moves from the old EMUs to the new ones: ``reshard.estimate`` gives the
exact transfers as arrays, ``reshard.graph.plan_graph`` schedules them in rounds within the
memory budget and prices them with its alpha-beta ``LinkCost``: the device profile's links
(``profile_links``), refitted per link class from the messages the job's weight syncs and
transitions measure (``with_links``: ``links.calibrate``). Building the new stages (modules on meta, parallelize,
process groups) costs a fixed ``rebuild`` per changed stage, calibrated from measured
transitions. The weight syncs of the new plan are priced by the step-time model, not here.

    seconds = Σ_rebuilt stages (graph seconds of its state) + rebuild · (rebuilt stages)

The exact transfers grow with ranks × tensors (a 1,024-rank 8B transition is millions of
them, minutes to schedule), so above ``EXACT_RANKS`` ranks a stage is priced in closed
form instead: its busiest rank receives its whole new resident state over the slowest link
class (``cross``), one message per pipeline-stage tensor — an upper bound of the graph's
seconds up to its rounds, what the admission rule needs to decide (the executor plans the
exact rounds when it runs).

The executor (``runtime/transition.apply_plan``) moves the rebuilt stages one at a time, in
``move_order``, and releases each old stage once its state has moved: while stage k moves, a
rank holds the stages already moved in their new layout, the rest in their old one, and
stage k in both — except a weight-synced copy (``actor.gen``, ``critic.infer``; ``refilled``),
whose old copy is freed before the new one is built: its weights come from its training
stage's sync, not from the old copy. ``transition_peak`` is the largest of those sums over the ranks and
the moves (the controller refuses a transition whose peak is over the budget).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nereus.reshard.derive import derive_emus
from nereus.reshard.estimate import estimate_transfers
from nereus.reshard.graph import plan_graph
from nereus.reshard.links import LINK_CLASSES, LinkCost, calibrate

from ..config import JobConfig, PlanConfig, StageConfig
from ..config.names import SYNCED, TRAIN, is_train, split_key
from .candidates import layout_of

REBUILD_SECONDS = 0.3  # prior per rebuilt model-stage (this CPU: module build, groups, optimizer)
EXACT_RANKS = 16  # above: the closed-form price (module docstring)


def profile_links(profile) -> LinkCost:
    """reshard's alpha-beta link prior from a device profile's links (local: local, node:
    intra, cross: inter; the staged class keeps reshard's default)."""
    ln = profile.links
    return LinkCost(alpha={"local": ln["local"].latency, "node": ln["intra"].latency, "cross": ln["inter"].latency},
                    beta={"local": ln["local"].bandwidth, "node": ln["intra"].bandwidth, "cross": ln["inter"].bandwidth},
                    ranks_per_node=profile.devices_per_node)


def stage_emus(cfg: JobConfig, key: str, sc: StageConfig, nproc: int):
    """The EMUs a model-stage holds under ``sc`` (weights, and AdamW state when training)."""
    from ..models.args import model_args
    from ..rollout.vllm_layout import vllm_emus

    args = model_args(cfg, key)
    model, stage = split_key(key)
    config = sc.parallel_config(nproc)
    if cfg.engine_owned(key):
        return vllm_emus(args.spec, config, model=model, stage=stage)
    return derive_emus(args.spec, config, model=model, stage=stage, optimizer=stage == TRAIN, dp_shard=sc.dp_shard, fused=sc.fused)


def changed_stages(old: PlanConfig, new: PlanConfig) -> list[str]:
    """Model-stages whose stage config differs (the rest keep their modules and state)."""
    a, b = old.stages(), new.stages()
    return [k for k in b if a.get(k) != b[k]]


def rebuilt_stages(old: PlanConfig, new: PlanConfig) -> list[str]:
    """Changed model-stages whose layout changes (anything but ``candidates.RETUNED``: the micro-batch
    size or token budget, activation recompute): they are built anew and their state moves;
    the others only retune the running stage."""
    a, b = old.stages(), new.stages()
    return [k for k in changed_stages(old, new) if not (a.get(k) is not None and layout_of(a[k]) == layout_of(b[k]))]


@dataclass(frozen=True, kw_only=True, slots=True)
class TransitionCost:
    seconds: float
    nbytes: int
    """Bytes that cross between ranks (local copies not counted)."""
    stages: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class TransitionModel:
    link: LinkCost = LinkCost()
    rebuild: float = REBUILD_SECONDS

    def cost(self, cfg: JobConfig, old: PlanConfig, new: PlanConfig, *, budget: int | None = None) -> TransitionCost:
        stages = rebuilt_stages(old, new)
        seconds, nbytes = self.rebuild * len(stages), 0
        for key in stages:
            if cfg.nproc > EXACT_RANKS:
                s, b = self._bound(cfg, key, new.stages()[key])
                seconds, nbytes = seconds + s, nbytes + b
                continue
            src = stage_emus(cfg, key, old.stages()[key], cfg.nproc)
            dst = stage_emus(cfg, key, new.stages()[key], cfg.nproc)
            arrays = estimate_transfers(src, dst)
            graph = plan_graph(arrays, budget=budget, cost=self.link)
            seconds += graph.seconds
            nbytes += int(arrays.nbytes[arrays.src != arrays.dst].sum())
        return TransitionCost(seconds=seconds, nbytes=nbytes, stages=tuple(stages))

    def _bound(self, cfg: JobConfig, key: str, sc: StageConfig) -> tuple[float, int]:
        """(seconds, bytes) of the closed-form price of moving ``key`` into ``sc``."""
        from nereus.reshard.derive import plan_parameters

        from ..models.args import model_args
        from .memory import pipeline_memory

        busiest = max(m.resident for m in pipeline_memory(cfg, key, sc, ends=True))
        per_stage = -(-len(plan_parameters(model_args(cfg, key).spec)) // sc.pp)
        tensors = per_stage * (3 if is_train(key) else 1)  # weights, and AdamW's two moments
        i = LINK_CLASSES.index("cross")
        return tensors * self.link.alpha[i] + busiest / self.link.beta[i], busiest * cfg.nproc

    def with_links(self, samples, prior: LinkCost) -> TransitionModel:
        """``link`` refitted (``reshard.links.calibrate``, per link class) from measured
        messages ``(link class, bytes, seconds)`` — the weight syncs' and the transitions'
        own — over ``prior``."""
        return dataclasses.replace(self, link=calibrate(samples, prior))

    def calibrated(self, measured: list[tuple[float, int, float]]) -> TransitionModel:
        """Refit ``rebuild`` from measured transitions ``(seconds, changed stages, predicted
        movement seconds)``: the mean of (measured − movement) per stage, at least 0."""
        per_stage = [(s - moved) / n for s, n, moved in measured if n]
        if not per_stage:
            return self
        return TransitionModel(link=self.link, rebuild=max(0.0, sum(per_stage) / len(per_stage)))


def refilled(cfg: JobConfig, key: str) -> bool:
    """Whether the executor refills ``key`` from its weight sync instead of moving its state:
    a weight-synced copy (``SYNCED``) of the built-in engine (a vLLM engine's copy moves)."""
    return key in SYNCED and not cfg.engine_owned(key)


def move_order(cfg: JobConfig, old: PlanConfig, new: PlanConfig, *, groups=None) -> list[str]:
    """The rebuilt stages of ``old`` → ``new`` in the order the executor moves them: the
    order whose busiest rank holds least while it moves (exact over every order; ties: the
    plan's order). Pure and the same on every rank (the model's
    resident bytes, not a rank's measured ones). ``groups``: ``memory.distinct_ranks(cfg,
    (old, new))``, if at hand."""
    return _moves(cfg, old, new, groups)[0]


def transition_peak(cfg: JobConfig, old: PlanConfig, new: PlanConfig, *, groups=None) -> int:
    """The largest resident bytes any rank holds while ``old`` moves to ``new`` stage by stage
    in ``move_order`` (module docstring), before headroom; at least the old plan's resident
    bytes. ``groups``: ``memory.distinct_ranks(cfg, (old, new))``, if at hand."""
    return _moves(cfg, old, new, groups)[1]


def _moves(cfg: JobConfig, old: PlanConfig, new: PlanConfig, groups) -> tuple[list[str], int]:
    """(``move_order``, ``transition_peak``): the order whose largest held bytes are least, exact
    (what a rank holds depends only on the set of stages moved: a min-max over the subsets,
    at most 2^6 of them; ties: the plan's order first)."""
    import functools

    from .memory import distinct_ranks

    rebuilt = rebuilt_stages(old, new)
    ranks = groups if groups is not None else distinct_ranks(cfg, (old, new))
    held = [{m.stage: m.resident for m in h} for (h, _), _ in ranks]  # per rank group: what it holds, in the old layout
    coming = [{m.stage: m.resident for m in c} for (_, c), _ in ranks]
    base = [sum(h.values()) for h in held]
    first = [key in old.stages() and refilled(cfg, key) for key in rebuilt]  # freed before its new copy is built

    @functools.cache
    def best(moved: int) -> tuple[int, tuple[int, ...]]:  # (peak from here, the order of the rest); moved: a bit set
        if moved == (1 << len(rebuilt)) - 1:
            return 0, ()
        now = [b + sum(n.get(k, 0) - h.get(k, 0) for j, k in enumerate(rebuilt) if moved >> j & 1) for b, h, n in zip(base, held, coming)]
        out = None
        for j, key in enumerate(rebuilt):
            if moved >> j & 1:
                continue
            during = max((c + n.get(key, 0) - (h.get(key, 0) if first[j] else 0) for c, h, n in zip(now, held, coming)), default=0)
            rest, order = best(moved | 1 << j)
            option = (max(during, rest), (j, *order))
            if out is None or option[0] < out[0]:
                out = option
        return out

    peak, order = best(0)
    return [rebuilt[j] for j in order], max(peak, max(base, default=0))
