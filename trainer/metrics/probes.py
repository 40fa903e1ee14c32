"""Reference probes: how loaded the machine was at each step, measured by fixed work (opt-in).

With ``NEREUS_PROBES=1`` in a worker's environment, every rank runs the same three pieces of
fixed work right after each step, all ranks together (a barrier first), and the step's
metrics line gets their seconds, indexed by rank::

    "probes": {"gemm": [s, ...], "eager": [s, ...], "allreduce": [s, ...]}

- ``gemm``: ``GEMM_REPEATS`` products of two fixed ``GEMM_SIZE``² float32 matrices (compute);
- ``eager``: ``EAGER_OPS`` small elementwise ops on a 64-element tensor (dispatch: what an
  eager step of a tiny model mostly is);
- ``allreduce``: ``ALLREDUCE_REPEATS`` all-reduces of ``ALLREDUCE_NUMEL`` floats over the world
  (the collectives' latency).

The work never changes, so its time moves only with the machine: other jobs on the shared
cores, frequency, the memory bus. ``load_factors`` turns a run's probe seconds into one
factor per step (1 at the run's typical load), by which a benchmark divides what the step
measured, so that steps run under different load can be compared (``tools/bench_controller.py``'s
calibration). A probe costs ~tens of ms per step on this CPU, so it is off by default; unset,
it costs one dict lookup per process.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence

PROBES_ENV = "NEREUS_PROBES"
PROBES = ("gemm", "eager", "allreduce")
GEMM_SIZE, GEMM_REPEATS = 256, 20
EAGER_OPS = 2000
ALLREDUCE_NUMEL, ALLREDUCE_REPEATS = 1024, 5
_ON: list = []  # [bool], read from the environment once


def probes_on() -> bool:
    """``NEREUS_PROBES`` set to anything but ``""``/``0`` (read once per process)."""
    if not _ON:
        _ON.append(os.environ.get(PROBES_ENV, "") not in ("", "0"))
    return _ON[0]


def run_probes() -> dict[str, float]:
    """This rank's seconds of each probe (module docstring); collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, generator=gen)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, generator=gen)
    x = torch.zeros(64)
    buf = torch.ones(ALLREDUCE_NUMEL)
    dist.barrier()  # every rank probes the same moment's load
    out = {}
    t0 = time.perf_counter()
    for _ in range(GEMM_REPEATS):
        torch.mm(a, b)
    out["gemm"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(EAGER_OPS):
        x.add_(1.0)
    out["eager"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(ALLREDUCE_REPEATS):
        dist.all_reduce(buf)
    out["allreduce"] = time.perf_counter() - t0
    return out


def gather_probes(mine: dict[str, float]) -> dict[str, list[float]]:
    """Every rank's probe seconds, indexed by rank (one all_gather)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([mine[p] for p in PROBES], dtype=torch.float64)
    every = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return {p: [float(e[i]) for e in every] for i, p in enumerate(PROBES)}


def load_factors(steps: Sequence[dict[str, Sequence[float]]], probes: Sequence[str] = PROBES, window: int = 1) -> list[float]:
    """Per step, how much slower the machine ran than at the run's typical load (pure).

    ``steps``: each step's ``probes`` record ({probe: seconds per rank}). A probe's ratio at a
    step is its mean over the ranks ÷ the median of that over the steps given; the step's
    factor is the geometric mean of its ratios over ``probes``, then the median of those over
    the ``window`` steps centred on it (fewer at the ends): one probe's tens of ms vary more
    from step to step than the load does (on this machine ±25% quiet). ValueError naming the
    probe when a step lacks it, or when its seconds are not positive."""
    if not steps:
        return []
    per: dict[str, list[float]] = {}
    for i, record in enumerate(steps):
        for p in probes:
            seconds = record.get(p)
            if not seconds or min(seconds) <= 0:
                raise ValueError(f"step {i}: probe {p!r} missing or not positive ({seconds!r}); run with {PROBES_ENV}=1")
            per.setdefault(p, []).append(statistics.fmean(seconds))
    typical = {p: statistics.median(v) for p, v in per.items()}
    each = [math.exp(statistics.fmean(math.log(per[p][i] / typical[p]) for p in probes)) for i in range(len(steps))]
    half = max(window, 1) // 2
    return [statistics.median(each[max(0, i - half):i + half + 1]) for i in range(len(each))]
