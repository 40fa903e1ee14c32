"""The world: the simulator's ground truth, with its own structure and public parameters (pure).

``World`` answers what the step loop (``policies.py``, ``run.py``) and the baselines
(``baselines.py``) ask — a step's measured pieces, every rank's peak, out of memory, a
transition's seconds — from its own models:

- a piece's seconds (``stages``, ``generate``: kernels on a roofline, hierarchical
  collectives, the real micro-batch schedule) × its slowest device's speed (``noise``:
  persistent per device, a straggler now and then) × per-step noise;
- a rank's peak (``memory``), with an allocator slack hidden per layout class;
- a transition (``movement``): the state moved on the world's links, all rebuilt stages at
  once, plus their rebuild.

Pieces are named as the step loop measures them (``pieces``): ``sync.<stage>`` before a stage
that receives a weight sync, each model-stage, and ``<model>.train.infer`` where a training
layout runs its own forward (PPO's old log-probs unless on-policy; the critic's values
without a ``critic.infer``). ``expected_trace`` prices a plan over a whole trace at once
(arrays over steps, each distinct stage layout once per trace: plans that share a layout
share its price), without stragglers and per-step noise; ``step_many`` with ``noise=False``
gives the same numbers step by step.

It imports nothing of the controller: its parameters are its own
(``configs/simulate/worlds/<kind>.yaml``, ``params``), never calibrated against the
controller's predictions.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np
from nereus.trainer.config import JobConfig, PlanConfig, StageConfig
from nereus.trainer.config.names import GEN, INFER, SYNC, SYNCED, TRAIN, is_own_forward, is_train, model_of, own_forward_piece, piece_stage, sync_piece, train_stage

from . import memory, noise
from .generate import gen_seconds
from .kernels import device_view
from .links import place, stage_ranks
from .movement import Moves, holding, movement_seconds, moves
from .params import WorldParams, load_world_params
from .shapes import Lengths, ModelShape, Work, job_work
from .stages import Stage, infer_seconds, train_seconds

RETUNED = {"micro_batch_size": None, "micro_batch_tokens": None, "recompute": "none"}
"""Stage fields changed in place (no state moves, no rebuild)."""
CACHE = 50_000


def pieces(cfg: JobConfig) -> list[str]:
    """The pieces the step loop measures for ``cfg``'s plan, in the plan's stage order."""
    stages = cfg.plan.stages()
    out = []
    for key in stages:
        if key in SYNCED:
            out.append(sync_piece(key))
        out.append(key)
        if cfg.own_forward(key):
            out.append(own_forward_piece(key))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """What the world tells about its devices (``world.profile``: what a policy may read of them)."""

    name: str
    kind: str
    memory_gib: float
    devices_per_node: int


class World:
    """See the module docstring. ``prompt_mean``: the job's mean real prompt (tokens) where a
    trace step has none; ``noise=False``: no stragglers and no per-step noise (the persistent
    device speeds stay: they are the world, not noise)."""

    def __init__(self, params: WorldParams, *, seed: int = 0, prompt_mean: float | None = None, noise: bool = True) -> None:
        self.params, self.seed, self.prompt_mean, self.noisy = params, int(seed) % (1 << 63), prompt_mean, noise
        self.per_node = int(params.devices_per_node)
        self.profile = Hardware(name=params.name, kind=params.kind, memory_gib=params.memory_gib, devices_per_node=self.per_node)
        self._cache: dict = {}
        self._speed = np.zeros(0)
        self._steps: tuple | None = None

    @classmethod
    def from_file(cls, path_or_name: str | os.PathLike, *, seed: int = 0, prompt_mean: float | None = None, noise: bool = True) -> World:
        return cls(load_world_params(path_or_name), seed=seed, prompt_mean=prompt_mean, noise=noise)

    # ------------------------------------------------------------------ lengths

    def work(self, cfg: JobConfig, t) -> Work:
        """A trace step's demands on ``cfg``'s job (``t``: any object with TraceStep's fields)."""
        return job_work(cfg, t, self.prompt_mean)

    def lengths(self, cfg: JobConfig, steps) -> Lengths:
        """A trace's lengths as arrays (the last trace converted is remembered by identity)."""
        if isinstance(steps, Lengths):
            return steps
        job = (cfg.batch_size, cfg.algorithm, cfg.algo_hp, cfg.data, cfg.task)
        if self._steps is not None and self._steps[0] is steps and self._steps[1] == (len(steps), job):
            return self._steps[2]
        base = job_work(cfg, type("T", (), {"response_max": 1, "response_mean": 1.0, "prompt_mean": None})(), self.prompt_mean)
        given = [getattr(t, "prompt_mean", None) for t in steps]
        out = Lengths(batch=base.batch, prompt=base.prompt, minibatch=base.minibatch, epochs=base.epochs,
                      response_max=np.array([t.response_max for t in steps], dtype=float),
                      response_mean=np.array([t.response_mean or t.response_max for t in steps], dtype=float),
                      prompt_mean=np.array([base.prompt_mean if g is None else g for g in given], dtype=float))
        self._steps = (steps, (len(steps), job), out)
        return out

    # ------------------------------------------------------------------ seconds

    def _stage(self, cfg: JobConfig, key: str, sc: StageConfig) -> Stage:
        shape = ModelShape.of(cfg, key)

        def make() -> Stage:
            busy = len(stage_ranks(sc, cfg.nproc))
            return Stage(p=self.params, shape=shape, sc=sc, where=place(sc, cfg.nproc, self.per_node),
                         dev=device_view(self.params, shape.dtype, nproc=cfg.nproc, busy=busy))

        return self._memo(("stage", key, shape, sc, cfg.nproc), make)

    def _memo(self, key, make):
        """``make()``, remembered under ``key`` (a bounded cache: cleared when full)."""
        if key in self._cache:
            return self._cache[key]
        if len(self._cache) > CACHE:
            self._cache.clear()
        value = self._cache[key] = make()
        return value

    def parts(self, cfg: JobConfig, name: str, lengths: Lengths) -> dict[str, np.ndarray]:
        """A piece's seconds by part over the trace, at nominal device speed (no noise)."""
        stages = cfg.plan.stages()
        key = piece_stage(name)
        sc = stages[key]
        if name.startswith(SYNC):
            src = stages[SYNCED[key]]
            return self._memo(("sync", key, sc, src, cfg.nproc, ModelShape.of(cfg, key), len(lengths)),
                              lambda: self._sync(cfg, key, len(lengths)))
        mode = INFER if is_own_forward(name) else memory.stage_kind(key)
        st = self._stage(cfg, key, sc)
        fn = {TRAIN: train_seconds, INFER: infer_seconds, GEN: gen_seconds}[mode]
        return self._memo((mode, key, st.shape, sc, cfg.nproc, lengths.key), lambda: fn(st, lengths))

    def _sync(self, cfg: JobConfig, key: str, steps: int) -> dict[str, np.ndarray]:
        stages, shape = cfg.plan.stages(), ModelShape.of(cfg, key)
        n = _world_ranks(cfg, stages.values())
        per = shape.nbytes
        m = moves(holding(stages[SYNCED[key]], shape, n=n, nproc=cfg.nproc, per_param=per),
                  holding(stages[key], shape, n=n, nproc=cfg.nproc, per_param=per), self.per_node)
        move = movement_seconds(self.params, m, self.per_node)
        return {"move": np.full(steps, move), "overhead": np.full(steps, self.params.software.stage_call_overhead_s)}

    def _devices(self, cfg: JobConfig, name: str) -> np.ndarray:
        stages = cfg.plan.stages()
        key = piece_stage(name)
        ranks = stage_ranks(stages[key], cfg.nproc)
        if name.startswith(SYNC):
            ranks = np.union1d(ranks, stage_ranks(stages[SYNCED[key]], cfg.nproc))
        return ranks

    def speeds(self, n: int) -> np.ndarray:
        """Every device's persistent slowdown for this run (devices 0 … n−1)."""
        if len(self._speed) < n:
            self._speed = noise.device_speed(self.seed, np.arange(max(n, 2 * len(self._speed))), self.params.variance.device_sigma)
        return self._speed[:n]

    def expected_trace(self, cfg: JobConfig, steps) -> dict[str, np.ndarray]:
        """Seconds per piece of ``cfg``'s plan at every step of ``steps`` (TraceSteps or
        ``Lengths``), at the devices' persistent speeds, without stragglers or step noise."""
        lengths = self.lengths(cfg, steps)
        out = {}
        for name in pieces(cfg):
            devices = self._devices(cfg, name)
            slow = float(self.speeds(int(devices.max()) + 1)[devices].max())
            out[name] = sum(self.parts(cfg, name, lengths).values()) * slow
        return out

    def breakdown(self, cfg: JobConfig, name: str, work: Work) -> dict[str, float]:
        """A piece's seconds by part at one step (nominal device speed, no noise)."""
        return {k: float(np.asarray(v).reshape(-1)[0]) for k, v in self.parts(cfg, name, Lengths.of([work])).items()}

    def expected_many(self, cfgs: list[JobConfig], work: Work) -> list[dict[str, float]]:
        lengths = Lengths.of([work])
        return [{k: float(v[0]) for k, v in self.expected_trace(cfg, lengths).items()} for cfg in cfgs]

    def expected(self, cfg: JobConfig, work: Work) -> dict[str, float]:
        return self.expected_many([cfg], work)[0]

    # ------------------------------------------------------------------ memory

    def slack(self, cls: str) -> float:
        """The hidden allocator slack of a layout class (``memory.layout_class``)."""
        m = self.params.memory
        return noise.class_slack(self.seed, cls, m.slack_min, m.slack_max)

    def _group_peaks(self, cfg: JobConfig, lengths: Lengths) -> tuple[np.ndarray, np.ndarray]:
        p = self.params
        flash, sw = p.compute.flash_attention >= 0.5, p.software

        def transient(key, sc, infer):
            shape = ModelShape.of(cfg, key)
            kind = memory.stage_kind(key, infer=infer)

            def make():
                if kind == INFER:
                    return memory.infer_transient(sc, shape, lengths, flash, sw.fsdp_prefetch_layers)
                if kind == GEN:
                    return memory.gen_transient(sc, shape, lengths)
                return memory.train_transient(sc, shape, lengths, flash, sw.bucket_bytes, sw.fsdp_prefetch_layers)

            return self._memo(("transient", kind, shape, sc, lengths.key), make)

        return self._memo(("memory", cfg.plan, cfg.nproc, cfg.on_policy, cfg.model, cfg.critic, cfg.reward_model, lengths.key),
                          lambda: memory.group_peaks(cfg, lengths, slack=self.slack, transient=transient,
                                                     reserved=p.memory.reserved_gib * memory.GIB, workspace=p.memory.workspace_mib * (1 << 20)))

    def peak_trace(self, cfg: JobConfig, steps) -> np.ndarray:
        """The largest rank's peak bytes at every step."""
        groups, _ = self._group_peaks(cfg, self.lengths(cfg, steps))
        return groups.max(axis=0)

    def feasible_trace(self, cfg: JobConfig, steps) -> np.ndarray:
        """Per step: every rank's peak within the device's memory."""
        return self.peak_trace(cfg, steps) <= self.budget(cfg)

    def peaks(self, cfg: JobConfig, work: Work) -> list[int]:
        """Every rank's peak bytes at ``work`` (ranks holding alike computed once)."""
        groups, inverse = self._group_peaks(cfg, Lengths.of([work]))
        return groups[inverse, 0].astype(np.int64)[: cfg.nproc].tolist()

    def held(self, cfg: JobConfig) -> list[int]:
        """Every rank's bytes between steps (``memory.held_bytes``), as the step loop records them."""
        p = self.params.memory
        return self._memo(("held", cfg.plan, cfg.nproc, cfg.model, cfg.critic, cfg.reward_model),
                          lambda: memory.held_bytes(cfg, slack=self.slack, reserved=p.reserved_gib * memory.GIB,
                                                    workspace=p.workspace_mib * (1 << 20)).astype(np.int64).tolist())

    def budget(self, cfg: JobConfig) -> float:
        """A rank's memory: the job's ``device_memory_gib``, else the device's (a CPU node's
        memory shared by its ranks)."""
        if cfg.device_memory_gib is not None:
            return cfg.device_memory_gib * memory.GIB
        share = min(cfg.nproc, self.per_node) if self.params.compute.shared_cores > 0 else 1
        return self.params.memory_gib * memory.GIB / share

    def over_memory(self, cfg: JobConfig, work: Work) -> bool:
        return bool(self.peak_trace(cfg, Lengths.of([work]))[0] > self.budget(cfg))

    # ------------------------------------------------------------------ steps

    def step(self, cfg: JobConfig, t, *, peaks: bool = True) -> tuple[dict, float, bool]:
        return self.step_many([cfg], t, peaks=[peaks])[0]

    def step_many(self, cfgs: list[JobConfig], t, *, peaks: list[bool]) -> list[tuple[dict, float, bool]]:
        """(metrics as the step loop records them, the step's seconds, out of memory?) of each
        config at trace step ``t``; every piece's noise depends on (seed, step, piece, its
        devices) alone. ``peaks[i]``: record every rank's peak, else only check the memory."""
        if not cfgs:
            return []
        work = self.work(cfgs[0], t)
        lengths = Lengths.of([work])
        v = self.params.variance
        out = []
        for cfg, want in zip(cfgs, peaks):
            secs = {}
            for name in pieces(cfg):
                devices = self._devices(cfg, name)
                pace = self.speeds(int(devices.max()) + 1)[devices]
                if self.noisy:
                    pace = pace * noise.stragglers(self.seed, t.step, devices, v.straggler_probability, v.straggler_slowdown)
                jitter = noise.step_noise(self.seed, t.step, name, v.step_sigma) if self.noisy else 1.0
                secs[name] = float(sum(self.parts(cfg, name, lengths).values())[0]) * float(pace.max()) * jitter
            if want:
                peak = self.peaks(cfg, work)
                oom = max(peak) > self.budget(cfg)
            else:
                peak, oom = [0] * cfg.nproc, self.over_memory(cfg, work)
            stages = {name: {"seconds": s, "rows": work.batch, "tokens": work.batch * work.width, "real_tokens": work.batch * work.row_mean,
                             "peak_bytes": peak} for name, s in secs.items()}
            metrics = {"step": t.step, "response_length": t.response_mean,
                       "lengths": {"response_max": t.response_max, "response_mean": t.response_mean, "width": work.width,
                                   "response_sq_mean": float(lengths.response_sq_mean[0])},
                       "stages": stages, "step_seconds": sum(secs.values())}
            if want:
                metrics["held_bytes"] = self.held(cfg)
            out.append((metrics, sum(secs.values()), oom))
        return out

    # ------------------------------------------------------------------ transitions

    def move_fits(self, cfg: JobConfig, old: PlanConfig, new: PlanConfig, order: list[str]) -> bool:
        """Whether every rank's memory holds the move of ``old`` to ``new`` stage by stage in
        ``order`` (``memory.move_peak``); a move that does not runs out of memory."""
        p = self.params.memory
        return memory.move_peak(cfg, old, new, order, slack=self.slack, reserved=p.reserved_gib * memory.GIB,
                                workspace=p.workspace_mib * (1 << 20)) <= self.budget(cfg)

    def transition(self, cfg: JobConfig, old: PlanConfig, new: PlanConfig, step: int) -> tuple[float, int, tuple[str, ...]]:
        """(seconds, bytes that cross between ranks, rebuilt stages) of moving ``old`` to ``new``."""
        a, b = old.stages(), new.stages()
        rebuilt = [k for k in b if k not in a or _layout(a[k], cfg.nproc) != _layout(b[k], cfg.nproc)]
        n = _world_ranks(cfg, list(a.values()) + list(b.values()))
        total: Moves | None = None
        rebuild, tr = 0.0, self.params.transitions
        for key in rebuilt:
            shape = ModelShape.of(cfg, key)
            per = _state_bytes(key, b[key], shape)
            target = holding(b[key], shape, n=n, nproc=cfg.nproc, per_param=per)
            trained = train_stage(model_of(key))  # a copy's state comes from its training stage
            source = key if key in a else trained if trained in a else None
            if source is not None:
                m = moves(holding(a[source], shape, n=n, nproc=cfg.nproc, per_param=per), target, self.per_node)
                total = m if total is None else total + m
            ranks = len(stage_ranks(b[key], cfg.nproc))
            rebuild += tr.rebuild_base_s + tr.comm_init_s * math.log2(max(2, ranks)) + tr.allocate_s_per_gib * target.need.max() / memory.GIB
        moved = movement_seconds(self.params, total, self.per_node) if total is not None else 0.0
        jitter = noise.transition_noise(self.seed, step, self.params.variance.transition_sigma) if self.noisy else 1.0
        return float((moved + rebuild) * jitter), total.nbytes if total is not None else 0, tuple(rebuilt)


def _layout(sc: StageConfig, nproc: int) -> StageConfig:
    ranks = sc.ranks if sc.ranks is not None else tuple(range(nproc))
    return dataclasses.replace(sc, ranks=ranks, **RETUNED)


def _state_bytes(key: str, sc: StageConfig, shape: ModelShape) -> float:
    """Bytes per parameter a transition moves: a training stage its weights, fp32 masters and
    AdamW moments (FSDP: no separate compute copy), others their weights."""
    if is_train(key):
        return 12.0 if sc.dp_shard and sc.dp > 1 else 14.0
    return float(shape.nbytes)


def _world_ranks(cfg: JobConfig, stages) -> int:
    return max([cfg.nproc] + [int(stage_ranks(sc, cfg.nproc).max()) + 1 for sc in stages])
