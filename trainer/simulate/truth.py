"""The hidden ground truth of a simulation: what a step and a transition really take (pure).

The simulated machine runs the controller's own models with parameters the controller is
never shown, so that it has to calibrate from its observations as it does live:

- a step's pieces (the names the step loop measures, ``trainer/metrics/meters.py``: each
  model-stage, the weight syncs ``sync.<destination>``, a training stage's own forward
  ``<model>.train.infer``) take ``θ*·f(piece) · exp(σ·z)`` seconds: the step-time model's
  features (``online.piece_features``'s, priced for every policy at once) under a hidden efficiency θ* per operation class
  (the profile's prior × exp(``spread``·z_k), seeded, or given) and lognormal noise, z drawn
  per (seed, step, piece) so that every policy sees the same noise on the same step;
- a rank's peak is the memory model's ``(resident + transient)·(1 + slack) + offset``: the
  allocator slack and libraries the model does not count (the controller's ``MemoryFit``
  learns the offset); a peak over the device's memory fails the step (out of memory);
- a transition takes reshard's cost model (``TransitionModel``) on the cluster's own links
  (``transition.profile_links``) × a hidden factor, × noise. The controller prices a move
  on the same links without the factor (its prior, as live) and calibrates the rebuild time
  from the measured seconds (a simulated step measures no messages: the links stay priors).

Never the controller's current estimates: θ*, slack and factor are fixed before the run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import zlib

import numpy as np

from nereus.reshard.links import LinkCost

from ..config import JobConfig, PlanConfig, StageConfig, config_to_dict
from ..config.names import ACTOR_TRAIN, CRITIC_INFER, CRITIC_TRAIN, SYNCED
from ..controller.candidates import kept_of
from ..controller.memory import GIB, distinct_ranks, rank_peak
from ..controller.classes import MemoryFit
from ..controller.online import piece_stage
from ..controller.steptime import OP_CLASSES, Placement, StepTimeModel, candidate_features, candidate_sync_features
from ..controller.transition import profile_links
from ..controller.transition import TransitionModel
from ..controller.workload import Workload
from .inputs import TruthInput
from .traces import TraceStep


def pieces(cfg: JobConfig) -> list[str]:
    """The pieces the step loop measures for ``cfg``'s plan, in the order it runs them."""
    stages = cfg.plan.stages()
    out = []
    for key in stages:
        if key in SYNCED:
            out.append(f"sync.{key}")
        out.append(key)
        if (key == ACTOR_TRAIN and not cfg.on_policy) or (key == CRITIC_TRAIN and CRITIC_INFER not in stages):
            out.append(f"{key}.infer")
    return out


def workload(cfg: JobConfig, t: TraceStep) -> Workload:
    return dataclasses.replace(Workload.from_config(cfg).at(t.response_max, t.response_mean), prompt_mean=t.prompt_mean)


@functools.lru_cache(maxsize=4096)
def _key(plan: PlanConfig) -> str:
    return json.dumps(config_to_dict(plan), sort_keys=True)


class Truth:
    """See the module docstring. ``prompt_mean``: the job's mean real prompt (tokens)."""

    def __init__(self, truth: TruthInput, profile, *, prompt_mean: float | None = None) -> None:
        self.spec, self.profile, self.prompt_mean = truth, profile, prompt_mean
        prior = StepTimeModel.for_profile(profile)
        rng = np.random.default_rng(truth.seed)
        drawn = {k: prior.prior[k] * float(np.exp(truth.spread * rng.standard_normal())) for k in OP_CLASSES}
        self.model = StepTimeModel(prior=prior.prior, coef={**drawn, **(truth.efficiency or {})})
        self.offset = truth.memory_offset_gib * GIB
        # what the oracle plans with: the real peak of any class of layouts
        self.fit = MemoryFit(offsets={"(truth)": self.offset}, unseen=truth.memory_slack)
        link = profile_links(profile)
        f = truth.transition_factor
        self.transitions = TransitionModel(link=LinkCost(alpha=tuple(a * f for a in link.alpha), beta=tuple(b / f for b in link.beta),
                                                         ranks_per_node=link.ranks_per_node),
                                           rebuild=TransitionModel().rebuild * f)
        self._fits: dict = {}

    def noise(self, step: int, name: str) -> float:
        if self.spec.noise <= 0:
            return 1.0
        z = np.random.default_rng([self.spec.seed, step, zlib.crc32(name.encode())]).standard_normal()
        return float(np.exp(self.spec.noise * z))

    def work(self, cfg: JobConfig, t: TraceStep) -> Workload:
        if t.prompt_mean is None and self.prompt_mean is not None:
            t = dataclasses.replace(t, prompt_mean=self.prompt_mean)
        return workload(cfg, t)

    def expected(self, cfg: JobConfig, work: Workload) -> dict[str, float]:
        """Seconds per piece of ``cfg``'s plan at ``work``, without noise."""
        return self.expected_many([cfg], work)[0]

    def expected_many(self, cfgs: list[JobConfig], work: Workload) -> list[dict[str, float]]:
        """``expected`` of several configs of one job at one workload: each piece priced once
        for all of them (``online.piece_features``'s pieces, as arrays over ``Candidates``)."""
        out: list[dict[str, float]] = [{} for _ in cfgs]
        groups: dict[tuple, list[tuple[int, StageConfig]]] = {}
        for i, cfg in enumerate(cfgs):
            stages = cfg.plan.stages()
            for name in pieces(cfg):
                key = piece_stage(name, stages)
                sc = stages[key]
                groups.setdefault((name, key, cfg.nproc, len(sc.ranks) if sc.ranks is not None else cfg.nproc), []).append((i, sc))
        for (name, key, nproc, _), members in groups.items():
            cfg = cfgs[members[0][0]]
            where = Placement(nproc=nproc, profile=self.profile)
            c = kept_of(tuple(sc for _, sc in members))
            if name.startswith("sync."):
                f = candidate_sync_features(cfg, key, c, where)
            else:
                f = candidate_features(cfg, key, c, work, where, mode="infer" if name.endswith(".train.infer") else None)
            seconds = self.model.predict(f)
            for (i, _), sec in zip(members, np.broadcast_to(seconds, (len(members),)).tolist()):
                out[i][name] = sec
        return [{name: o[name] for name in pieces(cfg)} for o, cfg in zip(out, cfgs)]

    def peaks(self, cfg: JobConfig, work: Workload) -> list[int]:
        """Every rank's real peak bytes at ``work`` (ranks holding alike computed once)."""
        s = self.spec.memory_slack
        out = np.zeros(cfg.nproc, dtype=np.int64)
        for (held,), ranks in distinct_ranks(cfg, (cfg.plan,), seq=work.width):
            out[ranks[ranks < cfg.nproc]] = int(rank_peak(list(held))[0] * (1 + s) + self.offset)
        return out.tolist()

    def budget(self, cfg: JobConfig) -> float:
        return (self.profile.memory_gib if cfg.device_memory_gib is None else cfg.device_memory_gib) * GIB

    def over_memory(self, cfg: JobConfig, work: Workload) -> bool:
        """Whether a rank's real peak exceeds the device at ``work`` (a peak grows with the width:
        the widest that fitted each plan is remembered)."""
        if self.profile.kind == "cpu":
            return False
        key = (_key(cfg.plan), cfg.nproc)
        if work.width <= self._fits.get(key, 0):
            return False
        if max(self.peaks(cfg, work)) > self.budget(cfg):
            return True
        self._fits[key] = work.width
        return False

    def step(self, cfg: JobConfig, t: TraceStep, *, peaks: bool = True) -> tuple[dict, float, bool]:
        """(metrics as the step loop records them, the step's seconds, out of memory?)."""
        return self.step_many([cfg], t, peaks=[peaks])[0]

    def step_many(self, cfgs: list[JobConfig], t: TraceStep, *, peaks: list[bool]) -> list[tuple[dict, float, bool]]:
        """``step`` of several configs at trace step ``t`` (the same noise on the same pieces).
        ``peaks[i]``: record every rank's peak (the controller reads them), else only check
        the memory."""
        if not cfgs:
            return []
        work = self.work(cfgs[0], t)
        out = []
        for cfg, expected, want in zip(cfgs, self.expected_many(cfgs, work), peaks):
            secs = {name: s * self.noise(t.step, name) for name, s in expected.items()}
            if want:
                peak = self.peaks(cfg, work)
                oom = self.profile.kind != "cpu" and max(peak) > self.budget(cfg)
            else:
                peak, oom = [0] * cfg.nproc, self.over_memory(cfg, work)
            real = work.batch * work.row_mean
            stages = {name: {"seconds": s, "rows": work.batch, "tokens": work.batch * work.width, "real_tokens": real, "peak_bytes": peak}
                      for name, s in secs.items()}
            metrics = {"step": t.step, "response_length": t.response_mean,
                       "lengths": {"response_max": t.response_max, "response_mean": t.response_mean, "width": work.width},
                       "stages": stages, "step_seconds": sum(secs.values())}
            out.append((metrics, sum(secs.values()), oom))
        return out

    def transition(self, cfg: JobConfig, old: PlanConfig, new: PlanConfig, step: int) -> tuple[float, int, tuple[str, ...]]:
        """(real seconds, bytes, rebuilt stages) of moving ``old`` to ``new`` within ``cfg``'s world."""
        cost = self.transitions.cost(cfg, old, new)
        return cost.seconds * self.noise(step, "transition"), cost.nbytes, cost.stages
