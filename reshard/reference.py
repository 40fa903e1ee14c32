"""Deterministic global tensors, computable box by box, for checking reshards exactly.

The element at global linear index ``i`` of tensor ``name`` is a hash of ``(name, i)``
mapped into the dtype, so any rank can build any shard of any tensor without the others
and without materialising the whole tensor, and a resharded buffer can be compared with
what it must hold, every element, bit for bit.
"""

from __future__ import annotations

import math
import zlib
from typing import Iterable, Mapping

import torch

from .layout import DTYPES, BufferSpec, Dims, TensorLayout, buffer_name, local_buffers, shard_view


def _name_seed(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) * 1_000_003 + seed * 7919) % (1 << 31)


def reference_box(name: str, shape: Dims, dtype: str, offsets: Dims, lengths: Dims, seed: int = 0) -> torch.Tensor:
    """The box ``offsets``/``lengths`` of the reference tensor ``name`` (a new tensor)."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    index = torch.zeros((), dtype=torch.int64)
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        view = [1] * len(shape)
        view[d] = n
        index = index + (torch.arange(o, o + n, dtype=torch.int64) * strides[d]).view(view)
    index = index.expand(tuple(lengths)) if lengths else index
    h = (index * 2654435761 + _name_seed(name, seed)) % 1000003
    torch_dtype = DTYPES[dtype]
    if torch_dtype.is_floating_point:
        return ((h.to(torch.float64) - 500001.0) / 250000.0).to(torch_dtype)
    if torch_dtype == torch.bool:
        return (h % 2).bool()
    return (h % 251 - 125 if torch_dtype == torch.int8 else h % 251).to(torch_dtype)


def fill_reference(buffers: Mapping[str, torch.Tensor], layouts: Iterable[TensorLayout], rank: int, seed: int = 0) -> None:
    """Write the reference values of every shard ``rank`` holds into its buffers."""
    for layout in layouts:
        for shard in layout.shards:
            if shard.rank == rank:
                ref = reference_box(layout.name, layout.shape, layout.dtype, shard.offsets, shard.lengths, seed)
                shard_view(buffers, layout, shard).copy_(ref)


def make_buffers(specs: Mapping[str, BufferSpec]) -> dict[str, torch.Tensor]:
    """Empty local buffers for these specs."""
    return {name: torch.empty(spec.shape, dtype=DTYPES[spec.dtype]) for name, spec in specs.items()}


def reference_state(layouts: Iterable[TensorLayout], rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The local buffers of ``rank`` for these layouts, holding the reference values."""
    layouts = list(layouts)
    buffers = make_buffers(local_buffers(layouts, rank))
    fill_reference(buffers, layouts, rank, seed)
    return buffers


def mismatches(buffers: Mapping[str, torch.Tensor], layouts: Iterable[TensorLayout], rank: int, seed: int = 0) -> list[str]:
    """Shards on ``rank`` whose buffers differ from the reference in any bit (empty: exact)."""
    bad = []
    for layout in layouts:
        for shard in layout.shards:
            if shard.rank != rank:
                continue
            name = buffer_name(layout, shard)
            if name not in buffers:
                bad.append(f"{layout.name}: buffer {name!r} missing on rank {rank}")
                continue
            got = shard_view(buffers, layout, shard)
            ref = reference_box(layout.name, layout.shape, layout.dtype, shard.offsets, shard.lengths, seed)
            if got.shape != ref.shape or got.dtype != ref.dtype or not torch.equal(_bits(got), _bits(ref)):
                bad.append(f"{layout.name} at {shard.offsets} on rank {rank}")
    return bad


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A bitwise view, so that NaN payloads and signed zeros compare exactly."""
    t = t.contiguous()
    if t.dtype.is_floating_point and t.dim() > 0:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


__all__ = ["reference_box", "fill_reference", "make_buffers", "reference_state", "mismatches"]
