"""The world's randomness: counter-based draws, reproducible whatever else is priced (pure, numpy).

Every draw is a hash of its coordinates — (seed, what, step, piece, device) — through
SplitMix64, never a stream consumed in order: the same coordinates give the same number in
any call, for any set of plans priced beside it, so that every policy meets the same
noise on the same step and piece.

- a device's persistent speed, drawn per run: d_r = exp(σ_dev · z(seed, r));
- a straggler: device r is ``straggler_slowdown``× slower on step s when u(seed, s, r) < p;
- per-step noise of a piece: exp(σ_step · z(seed, s, crc32(piece)));
- a layout class's hidden allocator slack: lo + (hi − lo)·u(seed, crc32(class))² (most
  classes near lo, some much worse).

A piece runs at the pace of its slowest device: its seconds × max over its devices of
d_r · straggle_r(s) × its step noise. Normals by Box–Muller from two hashed uniforms.
"""

from __future__ import annotations

import zlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
DEVICE, STRAGGLER, STEP, SLACK, TRANSITION = 1, 2, 3, 4, 5
"""What a draw is for (its first coordinate after the seed)."""


def name_id(name: str) -> int:
    return zlib.crc32(name.encode())


def _mix(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def uniform(*keys) -> np.ndarray:
    """A uniform in (0, 1) per element of the broadcast ``keys`` (non-negative integers)."""
    with np.errstate(over="ignore"):
        arrays = np.broadcast_arrays(*(np.atleast_1d(np.asarray(k, dtype=np.uint64)) for k in keys))
        h = np.zeros(arrays[0].shape, dtype=np.uint64)
        for k in arrays:
            h = _mix(h ^ k)
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def normal(*keys) -> np.ndarray:
    u1, u2 = uniform(*keys, 1), uniform(*keys, 2)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * np.pi * u2)


def device_speed(seed: int, devices: np.ndarray, sigma: float) -> np.ndarray:
    """Each device's persistent slowdown factor for the run (≥ 0; 1 is nominal)."""
    return np.exp(sigma * normal(seed, DEVICE, devices)) if sigma > 0 else np.ones(len(devices))


def stragglers(seed: int, step: int, devices: np.ndarray, p: float, slowdown: float) -> np.ndarray:
    """Per device, the factor it runs at on ``step`` (``slowdown`` with probability ``p``)."""
    if p <= 0:
        return np.ones(len(devices))
    return np.where(uniform(seed, STRAGGLER, step, devices) < p, slowdown, 1.0)


def step_noise(seed: int, step: int, piece: str, sigma: float) -> float:
    return float(np.exp(sigma * normal(seed, STEP, step, name_id(piece))[0])) if sigma > 0 else 1.0


def class_slack(seed: int, cls: str, lo: float, hi: float) -> float:
    return float(lo + (hi - lo) * uniform(seed, SLACK, name_id(cls))[0] ** 2)


def transition_noise(seed: int, step: int, sigma: float) -> float:
    return float(np.exp(sigma * normal(seed, TRANSITION, step)[0])) if sigma > 0 else 1.0
