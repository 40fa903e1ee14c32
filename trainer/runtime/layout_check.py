"""Layout invariance, checked: one job's steps from the same state under several plans.

``run_layouts(cfg, plans)`` starts ``cfg.nproc`` local workers (the launcher ``nereus train``
uses) and, in each of them, builds the job once per plan (``plans``: lists of ``--set``
overrides, e.g. ``["plan.actor.train.tp=2", ...]``), runs ``steps`` steps and records the
first step's metrics, the step times, and the full training state after the first step:
every parameter and AdamW tensor of every ``*.train`` model-stage, gathered to rank 0
with every replica checked (``reshard.gather``). Every plan starts from the same seeded
state, so ``compare(results)`` measures how far the update depends on the layout: the
largest relative difference, per tensor max|a − b| / max|b|, against the first plan (and
per metric, ``metric_error``).

The update is the same under every plan up to floating-point reduction order
(docs/architecture.md, principle 4; docs/correctness.md).
tests/trainer/runtime/test_layout_invariance.py holds everything to 1e-10 in float64; in
float32 it holds metrics to 1e-6 and AdamW's moments to 4e-6, and parameters only within the
slope of Adam's update (lr·g/(|g| + ε) turns a 1e-6 gradient difference into up to 2·lr
where |g| is near ε). tools/bench_train.py reports the float32 figures
(``layout_invariance_max_rel_err``: parameters) and the float64 one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from nereus.reshard.gather import gather_full

from ..config import JobConfig, config_to_dict
from ..config.names import is_train
from ..prepare import load_config
from ..metrics.log import flatten, peak_memory_bytes

TIMING_KEYS = ("stage_seconds", "step_seconds", "tokens_per_s", "peak_memory_bytes", "peak_device_memory_bytes", "held_bytes", "stages",
               "syncs")


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutResult:
    plan: tuple[str, ...]
    metrics: dict[str, float]
    """The first step's numeric metrics (timings and memory left out)."""
    state: dict[str, np.ndarray]
    """``"<model-stage>/<tensor>"`` -> the full tensor after the first step."""
    step_seconds: list[float]
    peak_memory_bytes: list[int]
    """Every rank's peak resident memory at the end (meaningful for one plan per run)."""
    phase_seconds: list[dict[str, float]] = field(default_factory=list)
    """Per step: seconds of generation, inference, training, sync (``stage_seconds``)."""
    stage_peaks: dict[str, int] = field(default_factory=dict)
    """The last step's peak per model-stage record (``stages``), the highest over ranks."""


def run_layouts(cfg: JobConfig, plans: Sequence[Sequence[str]], *, steps: int = 1, tensor_peaks: Sequence[str] = ()) -> list[LayoutResult]:
    """Run the job under each plan (one launch, ``cfg.nproc`` workers); see the module
    docstring. The model-stages named in ``tensor_peaks`` are measured by the tensor bytes
    they allocate (``observe.StageMeter``; slow), the others by resident memory."""
    from nereus.launch import launch_local

    return launch_local(_worker, cfg.nproc, config_to_dict(cfg), [tuple(p) for p in plans], steps, tuple(tensor_peaks),
                        run_id="nereus-layouts")[0]


def _worker(base: dict, plans: list[tuple[str, ...]], steps: int, tensor_peaks: tuple[str, ...] = ()) -> list[LayoutResult] | None:
    from .step import Trainer, worker_device
    from .worker import join_process_group

    cfg0 = load_config(base)
    device = worker_device(cfg0)
    join_process_group(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg0.nproc))
    try:
        rank, out = dist.get_rank(), []
        for plan in plans:
            trainer = Trainer(load_config(base, list(plan)), device)
            trainer.meter.tensors = frozenset(tensor_peaks)
            times, phases, first = [], [], {}
            for i in range(steps):
                t = time.perf_counter()
                metrics = trainer.run_step()
                times.append(time.perf_counter() - t)
                phases.append(dict(metrics["stage_seconds"]))
                if i == 0:
                    first = {k: v for k, v in flatten({k: v for k, v in metrics.items() if k not in TIMING_KEYS}).items()}
                    state = {}
                    for key, stage in trainer.stages.items():
                        if is_train(key):
                            full = gather_full(stage.emus, stage.buffers(), rank)
                            state.update({f"{key}/{n}": t.numpy() for n, t in (full or {}).items()})
            peaks: list = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, (peak_memory_bytes(), {k: r["peak_bytes"] for k, r in metrics["stages"].items()}))
            stage_peaks: dict[str, int] = {}
            for _, mine in peaks:
                for k, v in mine.items():
                    stage_peaks[k] = max(stage_peaks.get(k, 0), v)
            out.append(LayoutResult(plan=plan, metrics=first, state=state, step_seconds=times, peak_memory_bytes=[p for p, _ in peaks],
                                    phase_seconds=phases, stage_peaks=stage_peaks))
        return out if rank == 0 else None
    finally:
        dist.destroy_process_group()


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """max|a − b| / max|b| (0 for equal tensors, also empty or all-zero ones)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    diff = float(np.abs(a - b).max()) if a.size else 0.0
    scale = float(np.abs(b).max()) if b.size else 0.0
    return 0.0 if diff == 0.0 else diff / (scale or 1.0)


def metric_error(a: float, b: float) -> float:
    """|a − b| / max(|b|, 1): relative for metrics above 1, absolute below (a KL that is 0 in
    exact arithmetic, a loss that is a near-cancelled sum of O(1) token terms)."""
    return abs(a - b) / max(abs(b), 1.0)


def state_kind(key: str) -> str:
    """"param", "exp_avg", "exp_avg_sq" or "step" for a ``LayoutResult.state`` key."""
    for kind in ("exp_avg_sq", "exp_avg", "step"):
        if f"/optim/{kind}/" in key:
            return kind
    return "param"


def compare(results: Sequence[LayoutResult]) -> dict[str, dict[str, tuple[float, str]]]:
    """Per plan after the first: the largest difference from the first plan, and where, for
    its metrics (``metric_error``) and for each kind of state tensor (``relative_error``)."""
    ref = results[0]
    out = {}
    for r in results[1:]:
        if r.metrics.keys() != ref.metrics.keys() or r.state.keys() != ref.state.keys():
            raise ValueError(f"plan {list(r.plan)} reports other metrics or tensors than plan {list(ref.plan)}")
        worst: dict[str, tuple[float, str]] = {}
        for k in ref.metrics:
            e = metric_error(r.metrics[k], ref.metrics[k])
            worst["metrics"] = max(worst.get("metrics", (-1.0, "")), (e, k))
        for k in ref.state:
            kind = state_kind(k)
            worst[kind] = max(worst.get(kind, (-1.0, "")), (relative_error(r.state[k], ref.state[k]), k))
        out[" ".join(r.plan) or "(base plan)"] = worst
    return out
