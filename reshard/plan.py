"""Overlap plans between two sets of EMUs, built on torch.distributed.checkpoint (pure).

For each tensor, the distinct source boxes become the chunks of a DCP
``TensorStorageMetadata`` and the distinct target boxes are planned against them with
``planner_helpers.create_read_items_for_chunk_list`` (a sweep line over the largest
dimension). Every resulting ``ReadItem`` — target box, source chunk, offsets relative to
both, lengths — is then given a sender and a receiver for each rank that holds the target
box, which makes it a :class:`Transfer`. The same transfers drive the stream executor
(point-to-point sends) and the staged one (DCP load from a checkpoint).

Choice of sender, for a source box held by several ranks (replicas):

1. the destination itself when it holds the box: a local copy, no bytes cross;
2. otherwise the live holders take the box's remote requests in turn: the k-th request
   (requests ordered by destination rank, then target box) goes to live holder
   ``(k + box index + tensor index) mod live holders``, holders ordered by rank. Rotating
   by box and tensor spreads bytes over the replicas, and the rule needs the layouts
   alone, so every rank derives the same choice without talking to the others (and the
   vectorized estimator reproduces it exactly);
3. no live holder: the staged checkpoint (``src_rank == STAGED``) when one exists,
   else a :class:`CoverageError` naming the tensor and the region.

Dtype casts (``cast=True``): a floating-point tensor may change dtype on the way, e.g.
float32 master weights into a bf16 rollout layout. A transfer's ``nbytes`` are then the
TARGET's bytes: the sender casts while it packs (so the wire carries the target dtype),
a local copy casts in its ``copy_``, and a staged read in its copy into the target.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .errors import CoverageError, LayoutError, MismatchError
from .layout import DTYPES, EMU, BufferSpec, Dims, Shard, TensorLayout, first_overlap, box_view, itemsize, local_buffers

STAGED = -1
"""``Transfer.src_rank`` of a region read from the staged checkpoint."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """One DCP ``ReadItem`` with a sender and a receiver.

    ``item.dest_index.offset`` is the target box's global offsets and ``item.dest_offsets``
    the region's offsets inside it; ``item.storage_index.offset`` / ``storage_offsets``
    likewise for the source box. ``*_buffer``/``*_row`` say where each box sits locally.
    """

    item: ReadItem
    src_rank: int
    dst_rank: int
    src_buffer: str
    src_row: int
    dst_buffer: str
    dst_row: int
    nbytes: int

    @property
    def tensor(self) -> str:
        return self.item.dest_index.fqn

    @property
    def lengths(self) -> Dims:
        return tuple(self.item.lengths)

    def src_view(self, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The region to send, as a view of the sender's buffers."""
        return _region(buffers[self.src_buffer], self.src_row, self.item.storage_offsets, self.item.lengths)

    def dst_view(self, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The region to fill, as a view of the receiver's buffers."""
        return _region(buffers[self.dst_buffer], self.dst_row, self.item.dest_offsets, self.item.lengths)


def _region(buffer: torch.Tensor, row: int, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The box at ``offsets`` (relative to a chunk starting at dim-0 ``row``) of a buffer."""
    if not lengths:
        return buffer
    return box_view(buffer, (row + offsets[0], *offsets[1:]), tuple(lengths))


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferPlan:
    """The transfers of a transition, and the buffers each rank holds before and after.

    When planned for a subset of ranks, ``transfers`` holds every transfer any of them
    sends or receives, and the buffer maps cover those ranks only.
    """

    transfers: tuple[Transfer, ...]
    src_buffers: dict[int, dict[str, BufferSpec]]
    dst_buffers: dict[int, dict[str, BufferSpec]]
    layouts: dict[str, TensorLayout]
    """Target tensors, merged over the target EMUs (all replicas' shards)."""
    src_layouts: dict[str, TensorLayout]

    def bytes_between(self) -> dict[tuple[int, int], int]:
        """Bytes per (src, dst) pair, local copies included (src == dst)."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for t in self.transfers:
            out[t.src_rank, t.dst_rank] += t.nbytes
        return dict(out)

    def casts(self, t: Transfer) -> bool:
        """Whether transfer ``t`` changes its tensor's dtype (``plan_transfers(cast=True)``)."""
        return self.src_layouts[t.tensor].dtype != self.layouts[t.tensor].dtype


def merge_layouts(emus: Sequence[EMU], side: str) -> dict[str, TensorLayout]:
    """Tensors of several EMUs (the replicas of a model-stage) with all their shards.

    Raises if two EMUs disagree on a tensor's shape or dtype, or if EMUs overlap in ranks
    with different versions of the same tensor's layout in one buffer.
    """
    merged: dict[str, TensorLayout] = {}
    shards: dict[str, list[Shard]] = defaultdict(list)
    for emu in emus:
        for layout in emu.tensors:
            first = merged.setdefault(layout.name, layout)
            if (first.shape, first.dtype) != (layout.shape, layout.dtype):
                raise LayoutError(
                    f"{side} replicas disagree on tensor {layout.name!r}: shape {first.shape} "
                    f"{first.dtype} vs {layout.shape} {layout.dtype} in {emu.label}"
                )
            shards[layout.name].extend(layout.shards)
    return {
        name: TensorLayout.trusted(name=name, shape=t.shape, dtype=t.dtype, shards=tuple(shards[name]))
        for name, t in merged.items()
    }


def check_compatible(src: dict[str, TensorLayout], dst: dict[str, TensorLayout], *, cast: bool = False) -> None:
    """Every target tensor must exist in the source with the same global shape and dtype
    (with ``cast``: or both dtypes floating point)."""
    for name, t in dst.items():
        s = src.get(name)
        if s is None:
            raise MismatchError(f"target tensor {name!r} is not in the source EMUs")
        if s.shape != t.shape:
            raise MismatchError(f"tensor {name!r}: source shape {s.shape} != target shape {t.shape}")
        floats = DTYPES[s.dtype].is_floating_point and DTYPES[t.dtype].is_floating_point
        if s.dtype != t.dtype and not (cast and floats):
            hint = "" if cast or not floats else " (plan with cast=True to convert)"
            raise MismatchError(f"tensor {name!r}: source dtype {s.dtype} != target dtype {t.dtype}{hint}")


def storage_metadata(layout: TensorLayout, boxes: Iterable[tuple[Dims, Dims]]) -> TensorStorageMetadata:
    """DCP metadata of a tensor whose saved chunks are ``boxes``."""
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=DTYPES[layout.dtype]),
        size=torch.Size(layout.shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in boxes],
    )


def plan_tensor(
    src: TensorLayout,
    dst: TensorLayout,
    *,
    live: Collection[int] | None = None,
    staged: bool = False,
    salt: int = 0,
) -> list[Transfer]:
    """Every transfer that fills ``dst`` (all its shards, all replicas) from ``src``.

    ``salt`` is the tensor's index in the target's tensor order (see the module docstring).
    """
    src_boxes = {box: holders for box, holders in src.unique_boxes().items() if math.prod(box[1])}
    dst_boxes = {box: holders for box, holders in dst.unique_boxes().items() if math.prod(box[1])}
    if not dst_boxes:
        return []
    src_keys = list(src_boxes)
    dst_keys = list(dst_boxes)
    overlap = first_overlap(src_keys)
    if overlap is not None:
        (ao, an), (bo, bn) = overlap
        raise LayoutError(
            f"source replicas disagree on tensor {dst.name!r}: the box at offsets {list(ao)} lengths {list(an)} "
            f"(ranks {sorted(s.rank for s in src_boxes[overlap[0]])}) and the box at offsets {list(bo)} lengths {list(bn)} "
            f"(ranks {sorted(s.rank for s in src_boxes[overlap[1]])}) overlap without being the same box; "
            "every replica of a source must cut the tensor into the same boxes"
        )
    items = create_read_items_for_chunk_list(
        dst.name,
        storage_metadata(src, src_keys),
        [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in dst_keys],
    )
    _check_full_cover(dst, dst_keys, items)
    size = itemsize(dst.dtype)
    # requests[source box index] = [(dst rank, target box index, item)] in a fixed order.
    requests: dict[int, list[tuple[int, int, ReadItem]]] = defaultdict(list)
    for item in items:
        for shard in dst_boxes[dst_keys[item.dest_index.index]]:
            requests[item.storage_index.index].append((shard.rank, item.dest_index.index, item))
    out: list[Transfer] = []
    for b, reqs in sorted(requests.items()):
        holders = sorted(src_boxes[src_keys[b]], key=lambda s: s.rank)
        alive = [h for h in holders if live is None or h.rank in live]
        by_rank = {h.rank: h for h in alive}
        reqs.sort(key=lambda r: (r[0], r[1]))
        k = 0
        for rank, d, item in reqs:
            target = next(s for s in dst_boxes[dst_keys[d]] if s.rank == rank)
            sender = by_rank.get(rank)
            if sender is None and alive:
                sender = alive[(k + b + salt) % len(alive)]
                k += 1
            if sender is None and not staged:
                region = _global_region(item)
                raise CoverageError(
                    f"tensor {dst.name!r}: region at offsets {region[0]} lengths {region[1]} needed by "
                    f"rank {rank} is held only by ranks {[h.rank for h in holders]}, none live, "
                    "and no staged checkpoint was given"
                )
            out.append(
                Transfer(
                    item=item,
                    src_rank=sender.rank if sender else STAGED,
                    dst_rank=rank,
                    src_buffer=(sender.buffer or src.name) if sender else src.name,
                    src_row=sender.row if sender else 0,
                    dst_buffer=target.buffer or dst.name,
                    dst_row=target.row,
                    nbytes=math.prod(item.lengths) * size,
                )
            )
    return out


def _global_region(item: ReadItem) -> tuple[Dims, Dims]:
    offsets = tuple(a + b for a, b in zip(item.dest_index.offset, item.dest_offsets))
    return offsets, tuple(item.lengths)


def _check_full_cover(dst: TensorLayout, dst_keys: list[tuple[Dims, Dims]], items: list[ReadItem]) -> None:
    """The source chunks must fill every target box (they do when the source is whole)."""
    filled = [0] * len(dst_keys)
    for item in items:
        filled[item.dest_index.index] += math.prod(item.lengths)
    for (offsets, lengths), got in zip(dst_keys, filled):
        if got != math.prod(lengths):
            raise CoverageError(
                f"tensor {dst.name!r}: target box at offsets {offsets} lengths {lengths} is only "
                f"{got} of {math.prod(lengths)} elements covered by the source shards"
            )


def plan_transfers(
    sources: Sequence[EMU],
    targets: Sequence[EMU],
    *,
    live: Collection[int] | None = None,
    staged: bool = False,
    ranks: Collection[int] | None = None,
    cast: bool = False,
) -> TransferPlan:
    """The exact overlap plan from ``sources`` to ``targets``.

    ``live``: source ranks that can send (None: all). ``staged``: a checkpoint of the whole
    source state exists, so regions with no live holder are read from it. ``ranks``: plan
    only what these ranks send or receive (one rank's plan at scale); None plans all.
    ``cast``: floating-point tensors may change dtype (module docstring).
    """
    src = merge_layouts(sources, "source")
    dst = merge_layouts(targets, "target")
    check_compatible(src, dst, cast=cast)
    wanted = None if ranks is None else set(ranks)
    names = list(dst) if wanted is None else _tensors_touching(src, dst, wanted)
    salts = {name: i for i, name in enumerate(dst)}
    transfers: list[Transfer] = []
    for name in names:
        for t in plan_tensor(src[name], dst[name], live=live, staged=staged, salt=salts[name]):
            if wanted is None or t.dst_rank in wanted or t.src_rank in wanted:
                transfers.append(t)
    plan_ranks = wanted if wanted is not None else _all_ranks(sources) | _all_ranks(targets)
    src_used = {n: src[n] for n in dst}
    return TransferPlan(
        transfers=tuple(transfers),
        src_buffers={r: local_buffers(src.values(), r) for r in sorted(plan_ranks)},
        dst_buffers={r: local_buffers(dst.values(), r) for r in sorted(plan_ranks)},
        layouts=dst,
        src_layouts=src_used,
    )


def _all_ranks(emus: Sequence[EMU]) -> set[int]:
    return {r for e in emus for r in e.ranks}


def _tensors_touching(src: dict[str, TensorLayout], dst: dict[str, TensorLayout], ranks: set[int]) -> list[str]:
    """Target tensors that any of ``ranks`` holds in the source or in the target."""
    return [
        name
        for name, t in dst.items()
        if any(s.rank in ranks for s in t.shards) or any(s.rank in ranks for s in src[name].shards)
    ]
