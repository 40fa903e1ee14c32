"""Block checksums of box files (pure).

Every data file's bytes are cut into blocks of ``block`` bytes (the manifest's
``checksum_block``, 4 MiB by default; the last block may be shorter) and the manifest
keeps one checksum per block. A rank that needs only part of a box verifies only the
blocks that cover its region's byte span, so integrity checks read no more than the rank
needs, rounded out to whole blocks.

The checksum, ``wsum64``: zero-pad the block's ``n`` bytes to a multiple of 8, read them
as little-endian uint64 words ``x_i``, and with fixed odd weights ``W[j]`` (j < 512) and
``V[r]`` (from splitmix64, see :func:`splitmix64`)::

    wsum64 = sum_i x_i * W[i mod 512] * V[i div 512]  +  n * 0x9E3779B97F4A7C15   (mod 2**64)

It is a 64-bit weighted sum, not a cryptographic hash: any change of one word changes it
(the weights are odd, so invertible mod 2**64), reordered words or blocks change it with
probability ~1 - 2**-64, and it runs at numpy's uint64 matrix-vector speed — about twice
zlib's crc32 here, which matters because every byte written or read is checksummed once.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

CHECKSUM = "wsum64"
BLOCK = 4 << 20
ROW = 512
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def splitmix64(index: np.ndarray) -> np.ndarray:
    """splitmix64 of each uint64 index, forced odd (so invertible mod 2**64)."""
    with np.errstate(over="ignore"):
        z = (index.astype(np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) | np.uint64(1)


W = splitmix64(np.arange(ROW, dtype=np.uint64))
_V_BASE = 1 << 32  # the row weights come from another part of the same sequence
_V = splitmix64(np.arange(_V_BASE, _V_BASE + BLOCK // (8 * ROW) + 1, dtype=np.uint64))


def _row_weights(rows: int) -> np.ndarray:
    if rows <= len(_V):
        return _V[:rows]
    return splitmix64(np.arange(_V_BASE, _V_BASE + rows, dtype=np.uint64))


def wsum64(data) -> int:
    """The ``wsum64`` of a buffer's bytes (see the module docstring)."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    n = raw.size
    whole = n // 8 * 8
    words = raw[:whole].view("<u8")
    if whole < n:  # a ragged tail: pad it to one more word (copies this block only)
        tail = np.zeros(8, dtype=np.uint8)
        tail[: n - whole] = raw[whole:]
        words = np.concatenate([words, tail.view("<u8")])
    full = len(words) // ROW * ROW
    rows = full // ROW
    total = 0
    with np.errstate(over="ignore"):
        if rows:
            total = int(words[:full].reshape(rows, ROW) @ W @ _row_weights(rows))
        rest = words[full:]
        if len(rest):
            total += int(rest @ W[: len(rest)]) * int(_row_weights(rows + 1)[rows])
    return (total + n * _GOLDEN) & _MASK


def block_checksums(data, block: int = BLOCK) -> tuple[str, ...]:
    """The ``wsum64`` of every ``block``-byte block of ``data`` (any buffer), 16 hex digits each."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    n = max(1, math.ceil(raw.size / block))
    return tuple(f"{wsum64(raw[i * block : (i + 1) * block]):016x}" for i in range(n))


def wsum64_reference(data: bytes) -> int:
    """The same checksum in plain Python, for tests and for readers in other languages."""
    padded = bytes(data) + b"\0" * (-len(data) % 8)
    total = 0
    for i in range(len(padded) // 8):
        x = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        w = int(W[i % ROW])
        v = int(splitmix64(np.array([_V_BASE + i // ROW], dtype=np.uint64))[0])
        total = (total + x * w * v) & _MASK
    return (total + len(data) * _GOLDEN) & _MASK


def region_span(box_lengths: Sequence[int], itemsize: int, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
    """Byte range [start, end) of a box file that holds the region.

    Row-major: with strides ``S[d] = prod(L[d+1:])`` the region at offsets ``o`` of lengths
    ``n`` lies in bytes ``[s * sum(o[d] S[d]), s * (sum((o[d] + n[d] - 1) S[d]) + 1))``
    (not every byte of the span belongs to the region).
    """
    if not box_lengths:
        return 0, itemsize
    if not math.prod(lengths):
        return 0, 0
    strides = [math.prod(box_lengths[d + 1 :]) for d in range(len(box_lengths))]
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
    return first * itemsize, (last + 1) * itemsize


def blocks_of(start: int, end: int, block: int = BLOCK) -> range:
    """Indices of the blocks that cover bytes [start, end)."""
    return range(start // block, (end - 1) // block + 1) if end > start else range(0)
