"""Tensor layouts, parallel configs and Elastic Model Units (EMUs), as frozen data.

A *tensor layout* is a logical tensor (name, global shape, dtype) and the shards that
hold it. A shard is a box of the global tensor — ``offsets`` and ``lengths`` per
dimension — on one global rank. Several shards may hold the same box (replicas).

A shard lives in a *local buffer* on its rank. By default the buffer is the shard
alone and is named after the tensor. A fused buffer (vLLM's per-TP-rank ``qkv_proj`` =
[q_r; k_r; v_r]) holds several shards of different tensors stacked along dim 0: each
such shard names the ``buffer`` and the ``row`` where it starts. All shards of one
buffer share dtype and trailing lengths, and their rows tile the buffer exactly.

An *EMU* is the full distributed state of ONE replica of ONE model-stage: every tensor
(parameters and, for training stages, optimizer state) with its layout, plus the
parallel config, the ranks and a version. Everything is keyed by tensor name and
global offsets, never by rank position, so layouts survive changes of world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from .errors import LayoutError

Dims = tuple[int, ...]

DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name of a dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise LayoutError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}")
    return name


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """(dp, tp, pp) degrees of one model-stage placed on an ordered tuple of global ranks.

    Rank order is TP fastest, then PP, then DP: ``ranks[(d * pp + p) * tp + t]``, so a
    TP group is a run of consecutive ranks (inside one node when ranks fill nodes in order).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp"):
            if getattr(self, key) < 1:
                raise LayoutError(f"parallel config {key}={getattr(self, key)} must be >= 1")
        if len(self.ranks) != self.world:
            raise LayoutError(
                f"parallel config dp={self.dp} tp={self.tp} pp={self.pp} needs {self.world} "
                f"ranks, got {len(self.ranks)}: {self.ranks}"
            )
        if len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise LayoutError(f"parallel config ranks must be distinct and >= 0: {self.ranks}")

    @classmethod
    def on(cls, *, dp: int = 1, tp: int = 1, pp: int = 1, first_rank: int = 0) -> ParallelConfig:
        """The config on consecutive ranks starting at ``first_rank``."""
        return cls(dp=dp, tp=tp, pp=pp, ranks=tuple(range(first_rank, first_rank + dp * tp * pp)))

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def rank(self, *, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        return self.ranks[(dp * self.pp + pp) * self.tp + tp]

    def replica_ranks(self, dp: int) -> tuple[int, ...]:
        """The tp·pp ranks of data-parallel replica ``dp``."""
        width = self.tp * self.pp
        return self.ranks[dp * width : (dp + 1) * width]

    def describe(self) -> str:
        return f"dp={self.dp},tp={self.tp},pp={self.pp}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Shard:
    """A box of a logical tensor held by ``rank``, starting at dim-0 ``row`` of ``buffer``.

    ``buffer`` is empty when the shard is a buffer of its own, named after its tensor.
    """

    rank: int
    offsets: Dims
    lengths: Dims
    buffer: str = ""
    row: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def box(self) -> tuple[Dims, Dims]:
        return self.offsets, self.lengths


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorLayout:
    """A logical tensor's global shape and dtype, and the shards that hold it."""

    name: str
    shape: Dims
    dtype: str
    shards: tuple[Shard, ...]

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        ndim = len(self.shape)
        if any(s < 0 for s in self.shape):
            raise LayoutError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")
        for shard in self.shards:
            if len(shard.offsets) != ndim or len(shard.lengths) != ndim:
                raise LayoutError(
                    f"tensor {self.name!r}: shard on rank {shard.rank} has offsets {shard.offsets} "
                    f"and lengths {shard.lengths} for a {ndim}-d shape {self.shape}"
                )
            for o, n, s in zip(shard.offsets, shard.lengths, self.shape):
                if o < 0 or n < 0 or o + n > s:
                    raise LayoutError(
                        f"tensor {self.name!r}: shard on rank {shard.rank} at offsets "
                        f"{shard.offsets} lengths {shard.lengths} exceeds shape {self.shape}"
                    )
            if shard.buffer and ndim == 0:
                raise LayoutError(f"tensor {self.name!r}: a 0-d tensor cannot live in a fused buffer")

    @classmethod
    def trusted(cls, *, name: str, shape: Dims, dtype: str, shards: tuple[Shard, ...]) -> TensorLayout:
        """A layout built without the bounds checks, for code that derives it from checked ones."""
        layout = object.__new__(cls)
        for key, value in (("name", name), ("shape", shape), ("dtype", dtype), ("shards", shards)):
            object.__setattr__(layout, key, value)
        return layout

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def unique_boxes(self) -> dict[tuple[Dims, Dims], list[Shard]]:
        """Distinct boxes, each with the shards (replicas) holding it, in first-seen order."""
        boxes: dict[tuple[Dims, Dims], list[Shard]] = {}
        for shard in self.shards:
            boxes.setdefault(shard.box, []).append(shard)
        return boxes

    def check_covers(self, owner: str) -> None:
        """Raise unless the distinct boxes tile the whole tensor without overlap."""
        boxes = list(self.unique_boxes())
        total = sum(math.prod(lengths) for _, lengths in boxes)
        overlap = first_overlap(boxes)
        if overlap is not None:
            a, b = overlap
            raise LayoutError(
                f"{owner}: tensor {self.name!r} has partially overlapping shards {a} and {b}; "
                "replicas must hold identical boxes"
            )
        if total != self.numel:
            raise LayoutError(
                f"{owner}: shards of tensor {self.name!r} cover {total} of {self.numel} elements "
                f"of shape {self.shape}"
            )


def first_overlap(boxes: list[tuple[Dims, Dims]]) -> tuple | None:
    """The first pair of boxes that intersect, by a sweep along dim 0 (None if disjoint)."""
    if not boxes or not boxes[0][0]:
        return None if len(boxes) <= 1 else (boxes[0], boxes[1])
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    active: list[int] = []
    for i in order:
        start = boxes[i][0][0]
        active = [j for j in active if boxes[j][0][0] + boxes[j][1][0] > start]
        for j in active:
            if boxes_intersect(boxes[i], boxes[j]) and math.prod(boxes[i][1]) and math.prod(boxes[j][1]):
                return boxes[j], boxes[i]
        active.append(i)
    return None


def boxes_intersect(a: tuple[Dims, Dims], b: tuple[Dims, Dims]) -> bool:
    return all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1]))


@dataclass(frozen=True, kw_only=True, slots=True)
class EMU:
    """One replica of one model-stage: its parallel config, ranks, version and tensors.

    With data-parallel-sharded state (FSDP2-style) the dp ranks together hold one copy,
    so such a model-stage is a single EMU over all dp·tp·pp ranks.
    """

    model: str
    stage: str
    replica: int
    config: ParallelConfig
    ranks: tuple[int, ...]
    version: int = 0
    tensors: tuple[TensorLayout, ...]
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        allowed = set(self.ranks)
        if not allowed <= set(self.config.ranks):
            raise LayoutError(f"{self.label}: ranks {self.ranks} are not all in its config {self.config.ranks}")
        self._build_index()
        for layout in self.tensors:
            for shard in layout.shards:
                if shard.rank not in allowed:
                    raise LayoutError(
                        f"{self.label}: tensor {layout.name!r} has a shard on rank {shard.rank}, "
                        f"outside the EMU's ranks {self.ranks}"
                    )
            layout.check_covers(self.label)

    @classmethod
    def trusted(cls, **fields) -> EMU:
        """An EMU built without the coverage checks, for derivations tested to be whole."""
        emu = object.__new__(cls)
        fields.setdefault("version", 0)
        for key, value in fields.items():
            object.__setattr__(emu, key, value)
        object.__setattr__(emu, "_index", {})
        emu._build_index()
        return emu

    def _build_index(self) -> None:
        for layout in self.tensors:
            if layout.name in self._index:
                raise LayoutError(f"{self.label}: tensor {layout.name!r} appears twice")
            self._index[layout.name] = layout

    @property
    def label(self) -> str:
        return f"EMU {self.model}/{self.stage}#{self.replica} v{self.version} ({self.config.describe()})"

    def tensor(self, name: str) -> TensorLayout:
        try:
            return self._index[name]
        except KeyError:
            raise LayoutError(f"{self.label} has no tensor {name!r}") from None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._index)

    @property
    def nbytes(self) -> int:
        """Bytes of one copy of the state (replicas inside the EMU not counted)."""
        return sum(t.nbytes for t in self.tensors)

    def params_only(self) -> EMU:
        """This EMU without its optimizer state (``optim/...`` tensors): what a weight sync moves."""
        tensors = tuple(t for t in self.tensors if not t.name.startswith("optim/"))
        if tensors == self.tensors:
            return self
        fields = {f: getattr(self, f) for f in ("model", "stage", "replica", "config", "ranks", "version")}
        return EMU.trusted(**fields, tensors=tensors)


# ----------------------------------------------------------------------------- buffers


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferSpec:
    """A rank-local buffer: its name, shape and dtype."""

    name: str
    shape: Dims
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def buffer_name(layout: TensorLayout, shard: Shard) -> str:
    return shard.buffer or layout.name


def local_buffers(layouts: Iterable[TensorLayout], rank: int) -> dict[str, BufferSpec]:
    """The buffers ``rank`` holds for these layouts, checking that fused pieces tile them.

    A rank holds at most one shard of a tensor in one buffer; replicas of a box live on
    different ranks.
    """
    pieces: dict[str, list[tuple[int, Dims, str, str]]] = {}
    for layout in layouts:
        mine = [s for s in layout.shards if s.rank == rank]
        if len({buffer_name(layout, s) for s in mine}) != len(mine):
            raise LayoutError(f"tensor {layout.name!r} has more than one shard in one buffer on rank {rank}")
        for s in mine:
            pieces.setdefault(buffer_name(layout, s), []).append((s.row, s.lengths, layout.dtype, layout.name))
    specs: dict[str, BufferSpec] = {}
    for name, parts in pieces.items():
        if len(parts) == 1 and parts[0][3] == name:
            specs[name] = BufferSpec(name=name, shape=parts[0][1], dtype=parts[0][2])
            continue
        parts.sort()
        dtypes = {p[2] for p in parts}
        trailing = {p[1][1:] for p in parts}
        if len(dtypes) != 1 or len(trailing) != 1:
            raise LayoutError(
                f"fused buffer {name!r} on rank {rank} mixes dtypes {sorted(dtypes)} or trailing "
                f"shapes {sorted(trailing)} of tensors {[p[3] for p in parts]}"
            )
        row = 0
        for start, shape, _, tensor in parts:
            if start != row:
                raise LayoutError(
                    f"fused buffer {name!r} on rank {rank}: tensor {tensor!r} starts at row {start}, "
                    f"expected {row} (pieces must tile the buffer)"
                )
            row += shape[0]
        specs[name] = BufferSpec(name=name, shape=(row, *trailing.pop()), dtype=dtypes.pop())
    return specs


def shard_view(buffers: Mapping[str, torch.Tensor], layout: TensorLayout, shard: Shard) -> torch.Tensor:
    """The view of ``buffers`` that holds ``shard`` of ``layout`` (shaped like the shard's box)."""
    buf = buffers[buffer_name(layout, shard)]
    if shard.buffer:
        return buf.narrow(0, shard.row, shard.lengths[0])
    return buf


def box_view(tensor: torch.Tensor, offsets: Dims, lengths: Dims) -> torch.Tensor:
    """``tensor[offsets : offsets + lengths]`` in every dimension, as a view."""
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != tensor.shape[dim]:
            tensor = tensor.narrow(dim, o, n)
    return tensor


# ------------------------------------------------------------------------------- JSON

SCHEMA_VERSION = 1


def emu_to_dict(emu: EMU) -> dict:
    return {
        "schema": SCHEMA_VERSION,
        "model": emu.model,
        "stage": emu.stage,
        "replica": emu.replica,
        "version": emu.version,
        "config": {"dp": emu.config.dp, "tp": emu.config.tp, "pp": emu.config.pp, "ranks": list(emu.config.ranks)},
        "ranks": list(emu.ranks),
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "shards": [[s.rank, list(s.offsets), list(s.lengths), s.buffer, s.row] for s in t.shards],
            }
            for t in emu.tensors
        ],
    }


def emu_from_dict(data: Mapping) -> EMU:
    if data.get("schema") != SCHEMA_VERSION:
        raise LayoutError(f"EMU record has schema {data.get('schema')!r}; this version reads {SCHEMA_VERSION}")
    cfg = data["config"]
    return EMU(
        model=data["model"],
        stage=data["stage"],
        replica=data["replica"],
        version=data["version"],
        config=ParallelConfig(dp=cfg["dp"], tp=cfg["tp"], pp=cfg["pp"], ranks=tuple(cfg["ranks"])),
        ranks=tuple(data["ranks"]),
        tensors=tuple(
            TensorLayout(
                name=t["name"],
                shape=tuple(t["shape"]),
                dtype=t["dtype"],
                shards=tuple(
                    Shard(rank=r, offsets=tuple(o), lengths=tuple(n), buffer=b, row=row)
                    for r, o, n, b, row in t["shards"]
                ),
            )
            for t in data["tensors"]
        ),
    )
