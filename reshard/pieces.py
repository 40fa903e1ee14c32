"""Ranged reads of one box file in bounded pieces: which bytes, in what pieces, and where
each fetched byte lands (pure but for the copies into the targets).

A region of a row-major box of lengths ``L`` (strides ``S[d] = prod(L[d+1:])`` elements) at
offsets ``o`` of lengths ``n`` is ``prod(n[:j])`` runs of ``n[j] * S[j]`` contiguous elements,
``j`` the first dimension after which it spans the box whole
(``checksum.region_run_starts``); run ``r`` holds the region's row-major elements
``[r * run, (r + 1) * run)``. So the elements whose bytes lie in any byte range ``[a, z)``
form ONE row-major range ``[lo, hi)`` of the region, and such a range is at most
``2 * ndim - 1`` boxes (``checksum.rowmajor_boxes``), each a strided view of the fetched
bytes (strides ``S``): a piece cut anywhere — through a run, mid-row — is copied into the
target in a few ``copy_`` calls, with no assembled copy of the region.

The ranges to fetch are the regions' runs, merged across gaps shorter than a run (under 2x
the bytes), or with checksums the whole blocks covering them; :func:`batches` cuts them into
pieces of at most ``limit`` bytes (whole elements) and groups pieces into batches of at most
``limit`` bytes, fetched and copied one batch at a time, so a read never holds more than
``limit`` fetched bytes. :class:`BlockCheck` runs each block's CRC32C across the pieces that
hold it (CRC32C continues over concatenated bytes) and checks it when its last byte arrives.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np
import torch
from torch.distributed.checkpoint.planner import ReadItem

from .checksum import crc32c, region_run_starts, rowmajor_boxes
from .errors import TransferError
from .layout import DTYPES, box_view, itemsize

if TYPE_CHECKING:
    from .staged import StagedBox


def fill(box: "StagedBox", batch, fetched: Sequence[bytes], regions: Sequence["Region"], blocks: "BlockCheck | None") -> None:
    """Verify (``blocks``) and copy into the regions the fetched byte ranges ``batch``."""
    for (a, z), data in zip(batch, fetched):
        if len(data) != z - a:
            raise TransferError(
                f"{box.where()} returned {len(data)} bytes for bytes [{a}, {z}) ({z - a} expected): "
                "it shrank or changed after it was checked"
            )
        if blocks is not None:
            blocks.feed(a, z, data)
        piece = torch.frombuffer(data, dtype=torch.uint8).view(DTYPES[box.dtype])
        for r in regions:
            r.copy_from(piece, a, z)


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges [start, end) as sorted, disjoint ranges (overlapping or touching ones joined)."""
    out: list[list[int]] = []
    for a, z in sorted(set(ranges)):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], z)
        else:
            out.append([a, z])
    return [(a, z) for a, z in out]


def check_block(box: "StagedBox", b: int, lo: int, hi: int, got: str, want: str) -> None:
    """TransferError naming the box file and block ``b`` (bytes [lo, hi)) unless ``got == want``."""
    if got != want:
        raise TransferError(f"{box.where()} has crc32c {got} in bytes [{lo}, {hi}), staged as {want}: corrupted")


def union_blocks(runs: Iterable[tuple[np.ndarray, int]], block: int) -> list[tuple[int, int]]:
    """The blocks covering runs given as (start bytes, bytes per run), as sorted [first, end) index runs."""
    firsts, ends = [], []
    for starts, run in runs:
        if run and len(starts):
            firsts.append(starts // block)
            ends.append((starts + run - 1) // block + 1)
    if not firsts:
        return []
    first, end = np.concatenate(firsts), np.concatenate(ends)
    order = np.argsort(first, kind="stable")
    out: list[list[int]] = []
    for f, e in zip(first[order].tolist(), end[order].tolist()):
        if out and f <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([f, e])
    return [(f, e) for f, e in out]


class BlockCheck:
    """CRC32C of a box's blocks, fed its fetched bytes in file order; each block is checked
    the moment its last byte arrives."""

    def __init__(self, box: "StagedBox", block: int, sums: Sequence[str]) -> None:
        self.box, self.block, self.sums = box, block, sums
        self.partial: dict[int, int] = {}

    def ranges(self, regions: Sequence["Region"]) -> list[tuple[int, int]]:
        """The byte ranges of the whole blocks the regions touch."""
        spans = union_blocks([(r.starts, r.run) for r in regions], self.block)
        return [(f * self.block, min(e * self.block, self.box.nbytes)) for f, e in spans]

    def feed(self, a: int, z: int, data) -> None:
        block, n = self.block, self.box.nbytes
        view = memoryview(data)
        for b in range(a // block, -(-z // block)):
            end = min((b + 1) * block, n)
            lo, hi = max(a, b * block), min(z, end)
            self.partial[b] = crc32c(view[lo - a : hi - a], self.partial.get(b, 0))
            if hi == end:
                check_block(self.box, b, b * block, end, f"{self.partial.pop(b):08x}", self.sums[b])


def batches(ranges: Sequence[tuple[int, int]], limit: int, align: int) -> Iterable[list[tuple[int, int]]]:
    """``ranges`` cut into pieces of at most ``limit`` bytes (a multiple of ``align``, at
    least one element) and grouped in order into batches of at most ``limit`` bytes."""
    step = max(align, limit // align * align)
    batch: list[tuple[int, int]] = []
    held = 0
    for a, z in ranges:
        for lo in range(a, z, step):
            hi = min(z, lo + step)
            if batch and held + hi - lo > limit:
                yield batch
                batch, held = [], 0
            batch.append((lo, hi))
            held += hi - lo
    if batch:
        yield batch


class Region:
    """One item's region of a box file, to be filled from fetched pieces: its runs (start
    bytes, bytes per run; ``region_run_starts``), and the target view it lands in."""

    def __init__(self, box: "StagedBox", item: ReadItem, target: torch.Tensor) -> None:
        self.item, self.target = item, target
        self.size = itemsize(box.dtype)
        self.lengths, self.offsets = tuple(item.lengths), tuple(item.storage_offsets)
        self.strides = tuple(math.prod(box.lengths[d + 1 :]) for d in range(len(box.lengths)))
        self.starts, self.run = region_run_starts(box.lengths, self.size, self.offsets, self.lengths)
        self.elems = self.run // self.size if self.run else 0

    def _first_at_or_after(self, pos: int) -> int:
        """The first of the region's row-major elements whose file byte is at ``pos`` or later."""
        r = int(np.searchsorted(self.starts, pos, side="right")) - 1
        if r < 0:
            return 0
        inside = pos - int(self.starts[r])
        return r * self.elems + (inside // self.size if inside < self.run else self.elems)

    def copy_from(self, piece: torch.Tensor, a: int, z: int) -> None:
        """Copy the region's elements held in file bytes [a, z) from ``piece`` (those bytes,
        typed): they are a row-major range of the region, so at most ``2 * ndim - 1`` boxes,
        each a strided view of the piece."""
        if z <= self.starts[0] or a >= self.starts[-1] + self.run:
            return
        lo, hi = self._first_at_or_after(a), self._first_at_or_after(z)
        base = a // self.size
        for o, n in rowmajor_boxes(self.lengths, lo, hi):
            at = sum((self.offsets[d] + o[d]) * self.strides[d] for d in range(len(o))) - base
            box_view(self.target, o, n).copy_(piece.as_strided(n, self.strides, at))


__all__ = ["Region", "BlockCheck", "batches", "fill", "merge_ranges", "check_block", "union_blocks"]
