"""The full tensors of a distributed state on one rank, every replica checked (for tests
and checks on small models: it moves the whole state through one rank).

``gather_full(emus, buffers, rank)`` is collective over ``group``: each rank sends every
shard it holds (its boxes, read through ``shard_view``) to ``dst`` (a global rank, a member
of ``group``) with one ``gather_object``, so that only ``dst`` ever holds the whole state;
the destination assembles each tensor from its distinct boxes and checks that every
replica of a box (DP replicas, TP-replicated norms, KV-head copies) holds the same bytes.
A tensor the shards do not cover, or replicas that disagree, is a ``ReshardError`` naming
the tensor, the box and the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .errors import ReshardError
from .layout import DTYPES, EMU, shard_view


def gather_full(
    emus: Sequence[EMU], buffers: Mapping[str, torch.Tensor], rank: int, *, dst: int = 0, group=None
) -> dict[str, torch.Tensor] | None:
    """Every tensor of ``emus`` as one full CPU tensor on global rank ``dst`` (None elsewhere)."""
    layouts = {}
    for emu in emus:
        for t in emu.tensors:
            layouts.setdefault(t.name, []).append(t)
    mine = []
    for name, parts in layouts.items():
        for layout in parts:
            for shard in layout.shards:
                if shard.rank == rank:
                    view = shard_view(buffers, layout, shard).detach().cpu()
                    raw = view.contiguous().reshape(-1).view(torch.uint8).numpy().copy()
                    mine.append((name, shard.offsets, shard.lengths, raw))
    gathered: list | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object((rank, mine), gathered, dst=dst, group=group)  # only dst receives: the others hold their own shards alone
    if rank != dst:
        return None
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    seen: dict[tuple[str, tuple, tuple], tuple[int, np.ndarray]] = {}
    for sender, shards in sorted(gathered, key=lambda g: g[0]):
        for name, offsets, lengths, raw in shards:
            first = seen.setdefault((name, offsets, lengths), (sender, raw))
            if first[0] != sender and not np.array_equal(first[1], raw):
                raise ReshardError(
                    f"tensor {name!r}: the replicas of its box at offsets {list(offsets)} lengths {list(lengths)} "
                    f"disagree (ranks {first[0]} and {sender})"
                )
            layout = layouts[name][0]
            if name not in out:
                out[name] = torch.zeros(layout.shape, dtype=DTYPES[layout.dtype])
                filled[name] = torch.zeros(layout.shape, dtype=torch.bool)
            region = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
            out[name][region] = torch.from_numpy(raw).view(DTYPES[layout.dtype]).view(tuple(lengths))
            filled[name][region] = True
    for name, layout_parts in layouts.items():
        if name not in out:
            out[name] = torch.zeros(layout_parts[0].shape, dtype=DTYPES[layout_parts[0].dtype])
            filled[name] = torch.zeros(layout_parts[0].shape, dtype=torch.bool)
        if not bool(filled[name].all()):
            raise ReshardError(f"tensor {name!r}: {int((~filled[name]).sum())} elements are held by no rank")
    return out
