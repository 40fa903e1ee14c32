"""The tensor memory a piece of code really allocates at its peak, on CPU or CUDA.

    with tensor_peak(device) as peak:
        run_the_stage()
    peak.bytes   # most bytes of tensors alive at once inside the block, beyond those before it

CUDA: the caching allocator's own counters (``torch.cuda.reset_peak_memory_stats`` at entry,
``max_memory_allocated`` at exit, minus what was allocated at entry). CPU has no allocator
counters, so the block runs under ``torch.profiler`` with ``profile_memory=True``, which
records every allocation and free of the CPU allocator (with its size, signed); ordered in
time (torch's ``_memory_profiler.OpTree``: private, pinned by tests/trainer/controller/test_memory_measured.py),
their running sum is the live bytes, and the peak its maximum. Profiling slows the block
several-fold: measure a step, not every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Peak:
    bytes: int = 0


@contextmanager
def tensor_peak(device: torch.device | str = "cpu") -> Iterator[Peak]:
    """Measure the peak of tensor bytes allocated inside the block (see the module docstring)."""
    device, peak = torch.device(device), Peak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield peak
        torch.cuda.synchronize(device)
        peak.bytes = torch.cuda.max_memory_allocated(device) - base
        return
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import OpTree

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield peak
    live = top = 0
    for event in OpTree(prof.profiler.kineto_results).sorted_nodes:
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            live += event.typed[1].alloc_size  # negative for a free
            top = max(top, live)
    peak.bytes = top
