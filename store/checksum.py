"""Block checksums of box files (pure).

Every data file's bytes are cut into blocks of ``block`` bytes (the manifest's
``crc_block``, 4 MiB by default; the last block may be shorter) and the manifest keeps a
crc32 per block. A rank that needs only part of a box verifies only the blocks that
cover its region's byte span, so integrity checks read no more than the rank needs,
rounded out to whole blocks.

Row-major span of a region inside a box of lengths ``L`` and item size ``s``: with
strides ``S[d] = prod(L[d+1:])``, the region at offsets ``o`` of lengths ``n`` occupies
bytes ``[s * sum(o[d] S[d]), s * (sum((o[d] + n[d] - 1) S[d]) + 1))`` — not every byte
of the span belongs to the region, but the region lies within it.
"""

from __future__ import annotations

import math
import zlib
from typing import Sequence

CRC_BLOCK = 4 << 20


def block_crc32(data, block: int = CRC_BLOCK) -> tuple[str, ...]:
    """The crc32 of every ``block``-byte block of ``data`` (any buffer), as 8 hex digits."""
    view = memoryview(data).cast("B")
    n = max(1, math.ceil(len(view) / block))
    return tuple(f"{zlib.crc32(view[i * block : (i + 1) * block]):08x}" for i in range(n))


def region_span(box_lengths: Sequence[int], itemsize: int, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
    """Byte range [start, end) of a box file that holds the region (see module docstring)."""
    if not box_lengths:
        return 0, itemsize
    if not math.prod(lengths):
        return 0, 0
    strides = [math.prod(box_lengths[d + 1 :]) for d in range(len(box_lengths))]
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
    return first * itemsize, (last + 1) * itemsize


def blocks_of(start: int, end: int, block: int = CRC_BLOCK) -> range:
    """Indices of the blocks that cover bytes [start, end)."""
    return range(start // block, (end - 1) // block + 1) if end > start else range(0)
