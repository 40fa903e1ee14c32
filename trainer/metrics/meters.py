"""Per-model-stage measurements of one step: seconds and peak memory of each piece.

    meter = StageMeter(device)
    with meter("actor.gen"):
        ...
    seconds, peaks = meter.take()      # {name: s}, {name: bytes} of this rank, since the last take
    held = meter.held()                # bytes this rank holds now (between steps)

Peak memory is measured, never modelled. CUDA: the caching allocator's peak of allocated
bytes over the piece (``reset_peak_memory_stats`` at entry). CPU: the process's resident
high-water mark over the piece — Linux resets ``VmHWM`` when ``5`` is written to
``/proc/self/clear_refs`` and reports it in ``/proc/self/status`` — minus the process's
resident memory before the job built anything (``baseline``), so a CPU figure is what the
job's tensors and the allocator's slack add to a bare process; each step starts from a
trimmed heap (``trim_heap``), or a plan's figure would depend on what earlier plans left. A name measured twice in a
step (a model's mini-batches) adds its seconds and keeps the larger peak. Where
``clear_refs`` cannot be written the high-water mark is the process's since start (an upper
bound) and ``resettable`` is False.

``StageMeter(device, tensors={...})`` measures the pieces it names by the tensor bytes they
allocate beyond what was alive at their start instead (``memtrace.tensor_peak``: on CPU
under the profiler, several-fold slower): a training stage's activation peak, which the
process's resident memory hides behind everything the job holds (tools/bench_train.py).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import re
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from .memtrace import tensor_peak

_HWM = re.compile(r"VmHWM:\s+(\d+) kB")
_RSS = re.compile(r"VmRSS:\s+(\d+) kB")


def _status(pattern: re.Pattern) -> int:
    try:
        with open("/proc/self/status") as f:
            match = pattern.search(f.read())
    except OSError:
        return 0
    return int(match.group(1)) * 1024 if match else 0


def rss_bytes() -> int:
    """This process's resident memory now (0 where /proc is absent)."""
    return _status(_RSS)


def reset_rss_peak() -> bool:
    """Reset the resident high-water mark to the current resident size (True if it could)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_peak_bytes() -> int:
    return _status(_HWM)


def trim_heap() -> None:
    """Return the free pages of glibc's heap to the system (no-op elsewhere). A CPU step
    starts from a trimmed heap so that its resident high-water mark measures what the step
    holds, not what earlier steps or plans left free in the heap (a few ms)."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6")


def release_freed_memory(device: torch.device | str) -> None:
    """Hand memory the job has freed back to the system, after a plan transition: the old
    layout's tensors are gone, but glibc keeps their pages in its heap (resident, so counted by
    every later CPU measurement) and CUDA's caching allocator keeps its blocks reserved."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    else:
        trim_heap()


class StageMeter:
    """Times and peak memory of named pieces of a step on this rank (see the module docstring)."""

    def __init__(self, device: torch.device | str, baseline: int | None = None, *, tensors: frozenset[str] = frozenset()) -> None:
        self.device = torch.device(device)
        self.tensors = tensors
        self.baseline = rss_bytes() if baseline is None else baseline
        self.resettable = True
        self.seconds: dict[str, float] = defaultdict(float)
        self.peaks: dict[str, int] = {}

    @contextmanager
    def __call__(self, name: str):
        if name in self.tensors:
            start = time.perf_counter()
            with tensor_peak(self.device) as measured:
                yield
            self.seconds[name] += time.perf_counter() - start
            self.peaks[name] = max(self.peaks.get(name, 0), measured.bytes)
            return
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.resettable = reset_rss_peak() and self.resettable
        start = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device)
            else:
                peak = max(0, rss_peak_bytes() - self.baseline)
            self.seconds[name] += time.perf_counter() - start
            self.peaks[name] = max(self.peaks.get(name, 0), peak)

    def held(self) -> int:
        """The bytes this rank holds now, between steps: what a plan transition starts from. CPU:
        resident memory above the baseline, from a trimmed heap (the process's libraries,
        buffers and heap as well as its tensors); CUDA: the bytes allocated to tensors, as the
        pieces' peaks count them (the caching allocator's reserve is not in either)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        trim_heap()
        return max(0, rss_bytes() - self.baseline)

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        out = dict(self.seconds), dict(self.peaks)
        self.seconds, self.peaks = defaultdict(float), {}
        return out
