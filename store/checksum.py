"""Block checksums of checkpoint files: CRC32C, and the legacy ``wsum64`` (pure).

Checkpoints are written with CRC32C per 4 MiB block (``nereus.reshard.checksum``: the one
scheme of checkpoints, staged data and streamed messages); the manifest keeps one checksum
per block of every file. A rank that needs only part of a box verifies only the blocks
that cover its region's byte span, on the bytes it reads.

``wsum64`` — a weighted sum of little-endian uint64 words — is what manifests written
before CRC32C name. It is still verified when such a checkpoint is read (its data must not
become unreadable), never written: it is linear, so two sign-bit flips in one block can
cancel, which a CRC cannot. Its definition: zero-pad the block's ``n`` bytes to a
multiple of 8, read them as little-endian uint64 words ``x_i``, and with fixed odd
weights ``W[j]`` (j < 512) and ``V[r]`` (from splitmix64)::

    wsum64 = sum_i x_i * W[i mod 512] * V[i div 512]  +  n * 0x9E3779B97F4A7C15   (mod 2**64)
"""

from __future__ import annotations

import math

import numpy as np

from nereus.reshard.checksum import BLOCK, CHECKSUM, block_checksums, blocks_of, crc32c, region_span  # noqa: F401

LEGACY = "wsum64"
KNOWN = (CHECKSUM, LEGACY)
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


def wsum64_blocks(data, block: int = BLOCK) -> tuple[str, ...]:
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


def checksums_of(name: str, data, block: int = BLOCK) -> tuple[str, ...]:
    """The block checksums of ``data`` under the scheme ``name`` (``crc32c`` or ``wsum64``)."""
    return block_checksums(data, block) if name == CHECKSUM else wsum64_blocks(data, block)
