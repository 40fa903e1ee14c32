"""A columnar form of a transition's transfers, shared by the estimator, the graph and executors.

One row per transfer, in plan order (``arrays_from_plan`` keeps ``plan.transfers``'
order, and ``estimate_transfers`` reproduces it), as int64/bool numpy arrays:

- ``src`` / ``dst``: ranks (``src == STAGED`` (-1): read from the staged checkpoint);
- ``nbytes``: bytes of the region;
- ``src_buf`` / ``dst_buf``: ids into ``src_buffers`` / ``dst_buffers`` (-1 for a staged source);
- ``src_contig`` / ``dst_contig``: whether the region is one contiguous span of its buffer.
  Row-major: a region of lengths ``L`` in a buffer of shape ``E`` is contiguous iff, after
  the first dim ``i`` with ``L[i] > 1``, every later dim has ``L[j] == E[j]``. A staged
  source counts as contiguous (nothing is packed on a sender); a dtype cast as strided
  on its sender (it is packed, converted, into a send buffer).

The buffer tables list every (rank, buffer) of the transition, including buffers no
transfer touches (they still occupy memory), ordered by rank and then as
``layout.local_buffers`` lists them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .errors import ReshardError
from .layout import BufferSpec
from .plan import STAGED, TransferPlan

LINK_CLASSES = ("local", "node", "cross", "staged")
"""Link classes: same rank (memory copy), same node, across nodes, staged checkpoint read."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class BufferTable:
    """Rank-local buffers by id: ``rank[i]``, ``name[i]``, ``nbytes[i]``."""

    rank: np.ndarray
    name: tuple[str, ...]
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.name)

    def index(self) -> dict[tuple[int, str], int]:
        """(rank, name) -> buffer id."""
        return {(int(r), n): i for i, (r, n) in enumerate(zip(self.rank.tolist(), self.name))}

    def bytes_per_rank(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for r, n in zip(self.rank.tolist(), self.nbytes.tolist()):
            out[r] += n
        return dict(out)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TransferArrays:
    """Transfers as parallel arrays (see the module docstring), plus the buffer tables."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    src_buf: np.ndarray
    dst_buf: np.ndarray
    src_contig: np.ndarray
    dst_contig: np.ndarray
    src_buffers: BufferTable
    dst_buffers: BufferTable

    def __len__(self) -> int:
        return len(self.src)

    @property
    def ranks(self) -> np.ndarray:
        """Every rank that holds a buffer before or after, sorted."""
        return np.union1d(self.src_buffers.rank, self.dst_buffers.rank)


def buffer_table(buffers: Mapping[int, Mapping[str, BufferSpec]]) -> BufferTable:
    """The table of ``{rank: {name: spec}}``, ranks ascending, names in mapping order."""
    rows = [(r, name, spec.nbytes) for r in sorted(buffers) for name, spec in buffers[r].items()]
    return BufferTable(
        rank=np.array([r for r, _, _ in rows], dtype=np.int64),
        name=tuple(n for _, n, _ in rows),
        nbytes=np.array([b for _, _, b in rows], dtype=np.int64),
    )


def region_is_contiguous(lengths, extent) -> bool:
    """Row-major contiguity of a region of ``lengths`` inside a buffer of shape ``extent``."""
    dims = [d for d, n in enumerate(lengths) if n > 1]
    return not dims or all(lengths[j] == extent[j] for j in range(dims[0] + 1, len(lengths)))


def arrays_from_plan(plan: TransferPlan) -> TransferArrays:
    """The columnar form of an exact plan (one row per ``plan.transfers`` entry, same order)."""
    src_table, dst_table = buffer_table(plan.src_buffers), buffer_table(plan.dst_buffers)
    src_index, dst_index = src_table.index(), dst_table.index()
    n = len(plan.transfers)
    cols = {k: np.zeros(n, dtype=np.int64) for k in ("src", "dst", "nbytes", "src_buf", "dst_buf")}
    src_contig, dst_contig = np.ones(n, dtype=bool), np.ones(n, dtype=bool)
    for i, t in enumerate(plan.transfers):
        if t.dst_rank not in plan.dst_buffers or (t.src_rank != STAGED and t.src_rank not in plan.src_buffers):
            raise ReshardError(
                f"transfer {i} of tensor {t.tensor!r} goes from rank {t.src_rank} to rank {t.dst_rank}, "
                "whose buffers the plan does not list: arrays need the whole transition, "
                "plan_transfers(..., ranks=None)"
            )
        lengths = tuple(t.item.lengths)
        cols["src"][i], cols["dst"][i], cols["nbytes"][i] = t.src_rank, t.dst_rank, t.nbytes
        cols["dst_buf"][i] = dst_index[t.dst_rank, t.dst_buffer]
        dst_contig[i] = region_is_contiguous(lengths, plan.dst_buffers[t.dst_rank][t.dst_buffer].shape)
        if t.src_rank == STAGED:
            cols["src_buf"][i] = -1
        else:
            cols["src_buf"][i] = src_index[t.src_rank, t.src_buffer]
            # a cast is packed (and converted) on the sender, whatever its region's shape
            src_contig[i] = not plan.casts(t) and region_is_contiguous(lengths, plan.src_buffers[t.src_rank][t.src_buffer].shape)
    return TransferArrays(
        **cols, src_contig=src_contig, dst_contig=dst_contig, src_buffers=src_table, dst_buffers=dst_table
    )


def bytes_between(arrays: TransferArrays) -> dict[tuple[int, int], int]:
    """Bytes per (src, dst) pair, local copies included (src == dst); as ``TransferPlan.bytes_between``."""
    if not len(arrays):
        return {}
    width = int(max(arrays.src.max(), arrays.dst.max())) + 2
    keys, inverse = np.unique((arrays.src + 1) * width + arrays.dst, return_inverse=True)
    sums = np.bincount(inverse.ravel(), weights=arrays.nbytes, minlength=len(keys))  # exact below 2**53
    pairs = zip((keys // width - 1).tolist(), (keys % width).tolist(), sums.tolist())
    return {(s, d): int(b) for s, d, b in pairs}


def link_classes(src: np.ndarray, dst: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """Index into ``LINK_CLASSES`` per transfer: local, node, cross or staged."""
    out = np.where(src // ranks_per_node == dst // ranks_per_node, 1, 2)
    out[src == dst] = 0
    out[src == STAGED] = 3
    return out
