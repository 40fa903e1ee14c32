"""Kernel times on one device: a roofline with shape-dependent efficiency (pure, numpy, vectorised).

A GEMM C[m,n] = A[m,k]·B[k,n] does F = 2mnk FLOPs and moves (mk + kn + mn) elements; it takes

    t = overhead + max((F_q + F½) / (peak·e_max),  bytes / (bandwidth·e_mem))
    F_q = ⌈tiles / units⌉ · units · 2T²k,   tiles = ⌈m/T⌉·⌈n/T⌉

- F_q is the work the device really schedules: whole T×T output tiles in whole waves over
  its compute units (wave and tile quantisation, NVIDIA's "Matrix Multiplication
  Background"), so that splitting n over TP ranks or a short m changes efficiency in steps;
- F½ is a GEMM's ramp (fill and drain of its pipeline), in FLOPs at the large-GEMM rate:
  the efficiency e_max·F/(F_q + F½) rises with size and saturates near e_max
  (``gemm_efficiency``; a GEMM of F½ FLOPs in full waves reaches half of it);
- the bandwidth term makes a skinny GEMM (decode: m = active rows) weight-bound.

Fused (flash) attention of F FLOPs over sequences of L tokens: F / (peak·e_att·L/(L + L½)),
the backward at its own efficiency; where the device has no fused kernel (CPU), the scores
are written and read back (memory term). Streaming kernels (norms, RoPE, SwiGLU, residuals,
softmax, Adam): bytes / (bandwidth·e_mem) plus one overhead per kernel.

``Device`` is one rank's view of the hardware: on a CPU node the ranks share the cores, so a
rank gets ``per_core × min(threads, cores / busy ranks)`` of compute and bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .params import WorldParams


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    peak: float  # FLOP/s of the rank in its compute dtype
    bandwidth: float  # bytes/s of memory the rank streams at (achieved)
    gemm_efficiency: float
    gemm_half_flops: float
    tile: float
    units: float
    attention_efficiency: float
    attention_backward_efficiency: float
    attention_half_length: float
    flash: bool
    overhead: float  # s per kernel


def device_view(p: WorldParams, dtype: str, *, nproc: int, busy: int) -> Device:
    """One rank's hardware (module docstring): ``busy`` ranks run at once among ``nproc``."""
    c = p.compute
    peak, bandwidth, units = getattr(c.flops, dtype), c.memory_bandwidth * c.memory_efficiency, c.compute_units
    if c.shared_cores > 0:
        per_node = max(1, min(nproc, int(p.devices_per_node)))
        threads = max(1.0, c.shared_cores // per_node)
        share = min(threads, c.shared_cores / max(1, min(busy, per_node)))
        peak, bandwidth, units = peak * share, bandwidth * share, max(1.0, threads)
    return Device(peak=peak, bandwidth=bandwidth, gemm_efficiency=c.gemm_efficiency, gemm_half_flops=c.gemm_half_flops,
                  tile=c.gemm_tile, units=units, attention_efficiency=c.attention_efficiency,
                  attention_backward_efficiency=c.attention_backward_efficiency, attention_half_length=c.attention_half_length,
                  flash=c.flash_attention >= 0.5, overhead=c.kernel_overhead_s)


def scheduled_flops(d: Device, m, n, k):
    """F_q: whole tiles in whole waves (module docstring)."""
    tiles = np.ceil(m / d.tile) * np.ceil(n / d.tile)
    return np.ceil(tiles / d.units) * d.units * 2 * d.tile * d.tile * k


def gemm_efficiency(d: Device, m, n, k):
    """The share of the peak a GEMM of (m, n, k) reaches on its compute (module docstring)."""
    m, n, k = np.maximum(m, 1.0), np.maximum(n, 1.0), np.maximum(k, 1.0)
    return d.gemm_efficiency * 2 * m * n * k / (scheduled_flops(d, m, n, k) + d.gemm_half_flops)


def gemm_seconds(d: Device, m, n, k, nbytes: int):
    """Seconds of one GEMM (module docstring); m, n, k broadcast (arrays over steps)."""
    m, n, k = np.maximum(m, 1.0), np.maximum(n, 1.0), np.maximum(k, 1.0)
    compute = (scheduled_flops(d, m, n, k) + d.gemm_half_flops) / (d.peak * d.gemm_efficiency)
    moved = (m * k + k * n + m * n) * nbytes
    return d.overhead + np.maximum(compute, moved / d.bandwidth)


def attention_seconds(d: Device, flops, length, *, backward: bool = False, scores_bytes=0.0, kernels: int = 1):
    """Seconds of fused attention doing ``flops`` over sequences of ``length`` tokens; without
    a fused kernel the ``scores_bytes`` are written and read (twice in backward)."""
    length = np.maximum(np.asarray(length, dtype=float), 1.0)
    e = d.attention_backward_efficiency if backward else d.attention_efficiency
    compute = flops / (d.peak * e * length / (length + d.attention_half_length))
    if d.flash:
        return kernels * d.overhead + compute
    memory = np.asarray(scores_bytes, dtype=float) * (4 if backward else 2) / d.bandwidth
    return kernels * d.overhead + np.maximum(compute, memory)


def decode_attention_seconds(d: Device, flops, kv_bytes):
    """One decode step's attention: the KV cache read against its FLOPs (memory-bound)."""
    return d.overhead + np.maximum(flops / (d.peak * d.attention_efficiency), kv_bytes / d.bandwidth)


def stream_seconds(d: Device, nbytes, kernels: float):
    """Streaming kernels moving ``nbytes`` in all."""
    return kernels * d.overhead + np.asarray(nbytes, dtype=float) / d.bandwidth
