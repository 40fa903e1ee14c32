"""Memory-staged checkpoint: the staged executor's storage, read through DCP.

A staged checkpoint holds every distinct SOURCE box of a transition once, keyed by tensor
name and global offsets — never by rank or world size — so any rank of any later layout
can read any region of it, even after the ranks that wrote it are gone::

    <path>/metadata.json                  {"schema": 1, "tensors": {name: {shape, dtype, boxes}}}
    <path>/<quote(name)>@<o0_o1_..>.bin   raw row-major bytes of the box at offsets o
    <path>/<...>.bin.crc32                crc32 of that file, 8 hex digits (optional)

(``quote`` is ``urllib.parse.quote(name, safe="")``; a 0-d tensor's box is ``@scalar``.)
Each box is written by its lowest live holder, to a temporary name renamed into place,
so a reader sees a box whole or not at all; ``metadata.json`` may be written by every
writer (same bytes, also atomic). ``path`` is any fsspec path or URL: a local directory
(default root ``/dev/shm/nereus``, node shared memory), ``file://``, ``memory://``, ...

Loading goes through ``torch.distributed.checkpoint.load`` with two narrow pieces:

- :class:`StagedReader` (a DCP ``StorageReader``) turns ``metadata.json`` into DCP
  ``Metadata`` (each tensor's chunks = its boxes) and, in ``read_data``, reads for each
  ``ReadItem`` only the bytes it needs: local files are memory-mapped (only the touched
  pages are read), other filesystems get one ranged read of the item's covering span
  ``[lin(o), lin(o + n - 1) + 1) * itemsize`` where ``lin`` is the row-major index in the box;
- :class:`StagedLoadPlanner` (a DCP ``LoadPlanner``) whose local plan is exactly the
  transition plan's ``ReadItem`` s for this rank and whose ``resolve_tensor`` returns the
  destination view, so bytes land in the target buffers with one copy.

``no_dist=True``: no collective runs, so ranks load independently of each other and of
the (possibly dead) ranks that wrote the boxes.
"""

from __future__ import annotations

import json
import math
import uuid
import warnings
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Mapping, MutableMapping, Sequence
from urllib.parse import quote

import fsspec
import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .errors import CoverageError, LayoutError, TransferError
from .layout import DTYPES, Dims, TensorLayout, box_view, itemsize, shard_view
from .plan import STAGED, Transfer, TransferPlan

SCHEMA = 1
METADATA = "metadata.json"
DEFAULT_ROOT = "/dev/shm/nereus"


def default_staged_path(name: str) -> str:
    """A staging directory in node shared memory for one transition or job."""
    return f"{DEFAULT_ROOT}/{quote(name, safe='')}"


def box_file(name: str, offsets: Sequence[int]) -> str:
    """File name of a box: the escaped tensor name and the box's global offsets."""
    where = "_".join(str(int(o)) for o in offsets) or "scalar"
    return f"{quote(name, safe='')}@{where}.bin"


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes, row-major, as a uint8 numpy array (no copy for CPU contiguous)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _atomic_write(fs, path: str, data) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def staged_metadata(layouts: Mapping[str, TensorLayout]) -> dict:
    """The JSON record of a staged checkpoint: shapes, dtypes, non-empty distinct boxes."""
    return {
        "schema": SCHEMA,
        "tensors": {
            name: {
                "shape": list(t.shape),
                "dtype": t.dtype,
                "boxes": [[list(o), list(n)] for (o, n) in t.unique_boxes() if math.prod(n)],
            }
            for name, t in sorted(layouts.items())
        },
    }


def save_staged(
    path: str,
    layouts: Mapping[str, TensorLayout],
    buffers: Mapping[str, torch.Tensor],
    *,
    rank: int,
    live: Collection[int] | None = None,
    checksums: bool = False,
) -> list[str]:
    """Write the boxes ``rank`` is the lowest live holder of; returns the files written.

    ``layouts`` are the merged SOURCE layouts (``plan.src_layouts``); every live rank
    calls this with the same layouts and its own ``buffers``. A box with no live holder
    is skipped (it must have been staged earlier). ``checksums`` adds a crc32 sidecar.
    """
    fs, root = fsspec.core.url_to_fs(path)
    fs.makedirs(root, exist_ok=True)
    written = []
    for name, layout in sorted(layouts.items()):
        for (offsets, lengths), holders in layout.unique_boxes().items():
            alive = sorted((s for s in holders if live is None or s.rank in live), key=lambda s: s.rank)
            if not math.prod(lengths) or not alive or alive[0].rank != rank:
                continue
            try:
                view = shard_view(buffers, layout, alive[0])
            except KeyError:
                raise LayoutError(
                    f"rank {rank} must stage tensor {name!r} box at {offsets} but has no buffer "
                    f"{alive[0].buffer or name!r}"
                ) from None
            if tuple(view.shape) != tuple(lengths) or view.dtype != DTYPES[layout.dtype]:
                raise LayoutError(
                    f"rank {rank}: buffer for tensor {name!r} box at {offsets} is {list(view.shape)} "
                    f"{view.dtype}, expected {list(lengths)} {layout.dtype}"
                )
            data = _host_bytes(view)
            target = f"{root}/{box_file(name, offsets)}"
            _atomic_write(fs, target, data)
            if checksums:
                _atomic_write(fs, target + ".crc32", f"{zlib.crc32(data):08x}".encode())
            written.append(target)
    _write_metadata(fs, root, staged_metadata(layouts))
    return written


def _write_metadata(fs, root: str, record: dict) -> None:
    """Write ``metadata.json``, keeping tensors an earlier save staged there (a rank that
    staged its shards before leaving, a later save of a subset). Writers of one save
    write identical bytes; a tensor staged before with other boxes is refused: a staged
    directory holds one version of the state."""
    path = f"{root}/{METADATA}"
    try:
        old = json.loads(fs.cat_file(path))["tensors"]
    except FileNotFoundError:
        old = {}
    for name, t in record["tensors"].items():
        if name in old and old[name] != t:
            raise LayoutError(
                f"staged checkpoint {root!r} already holds tensor {name!r} as {old[name]['shape']} "
                f"{old[name]['dtype']} with other boxes; stage a different layout into a fresh path"
            )
    record = {**record, "tensors": {**old, **record["tensors"]}}
    _atomic_write(fs, path, json.dumps(record, sort_keys=True).encode())


# ------------------------------------------------------------------------------ reading


@dataclass(frozen=True, kw_only=True, slots=True)
class StagedBox:
    """One box file: the tensor, the box's global offsets and lengths, dtype, path."""

    tensor: str
    offsets: Dims
    lengths: Dims
    dtype: str
    path: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.lengths) * itemsize(self.dtype)

    def span(self, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int]:
        """Byte range [start, end) of the box file covering the region (row-major)."""
        strides = [math.prod(self.lengths[d + 1 :]) for d in range(len(self.lengths))]
        first = sum(o * s for o, s in zip(offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
        size = itemsize(self.dtype)
        return first * size, (last + 1) * size


class StagedReader(StorageReader):
    """DCP ``StorageReader`` over a staged directory (see the module docstring).

    Call order (DCP's): read_metadata, set_up_storage_reader, prepare_local_plan,
    prepare_global_plan (coordinator; here every rank is its own), read_data.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.fs, self.root = fsspec.core.url_to_fs(path)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.metadata: Metadata | None = None
        self.boxes: dict[MetadataIndex, StagedBox] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset: one reader serves one load of one staged path."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return isinstance(checkpoint_id, str)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is not None:
            return self.metadata
        meta_path = f"{self.root}/{METADATA}"
        try:
            record = json.loads(self.fs.cat_file(meta_path))
        except FileNotFoundError:
            raise CoverageError(f"staged checkpoint {self.path!r} has no {METADATA} (nothing was staged there)") from None
        if record.get("schema") != SCHEMA:
            raise CoverageError(f"staged checkpoint {meta_path!r} has schema {record.get('schema')!r}, expected {SCHEMA}")
        tensors = {}
        for name, t in record["tensors"].items():
            chunks = []
            for offsets, lengths in t["boxes"]:
                box = StagedBox(
                    tensor=name,
                    offsets=tuple(offsets),
                    lengths=tuple(lengths),
                    dtype=t["dtype"],
                    path=f"{self.root}/{box_file(name, offsets)}",
                )
                self.boxes[MetadataIndex(name, offsets)] = box
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(lengths)))
            tensors[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=DTYPES[t["dtype"]]), size=torch.Size(t["shape"]), chunks=chunks
            )
        self.metadata = Metadata(state_dict_metadata=tensors, storage_data=dict(self.boxes))
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def box(self, item: ReadItem) -> StagedBox:
        self.read_metadata()
        box = self.boxes.get(item.storage_index)
        if box is None:
            idx = item.storage_index
            raise CoverageError(
                f"staged checkpoint {self.path!r} has no box of tensor {idx.fqn!r} at offsets {list(idx.offset or ())}"
            )
        return box

    def check(self, items: Iterable[ReadItem], *, checksums: bool = False) -> None:
        """Raise unless every box the items read exists whole (and matches its crc32)."""
        for box in {id(b): b for b in (self.box(i) for i in items)}.values():
            try:
                size = self.fs.size(box.path)
            except FileNotFoundError:
                size = None
            if size is None:
                raise CoverageError(f"staged box file {box.path!r} of tensor {box.tensor!r} (box at {list(box.offsets)}) is missing")
            if size != box.nbytes:
                raise CoverageError(
                    f"staged box file {box.path!r} of tensor {box.tensor!r} has {size} bytes, expected "
                    f"{box.nbytes} ({list(box.lengths)} {box.dtype}): truncated or foreign"
                )
            if checksums:
                self._check_crc(box)

    def _check_crc(self, box: StagedBox) -> None:
        try:
            want = int(self.fs.cat_file(box.path + ".crc32").decode().strip(), 16)
        except FileNotFoundError:
            raise CoverageError(f"staged box file {box.path!r} of tensor {box.tensor!r} has no .crc32 sidecar") from None
        data = np.memmap(box.path, dtype=np.uint8, mode="r") if self.local else self.fs.cat_file(box.path)
        got = zlib.crc32(data)
        if got != want:
            raise TransferError(
                f"staged box file {box.path!r} of tensor {box.tensor!r} (box at {list(box.offsets)}) has crc32 "
                f"{got:08x}, staged as {want:08x}: corrupted"
            )

    def mapped(self, box: StagedBox) -> torch.Tensor | None:
        """The whole box as a tensor over a memory map of a local file (None: not local).

        Copy-on-write mapping: nothing is read until a region's pages are touched."""
        if not self.local:
            return None
        raw = torch.from_numpy(np.memmap(box.path, dtype=np.uint8, mode="c", shape=(box.nbytes,)))
        return raw.view(DTYPES[box.dtype]).view(box.lengths)

    def region(self, box: StagedBox, item: ReadItem, whole: torch.Tensor | None = None) -> torch.Tensor:
        """The item's region of the box: a view of the mapped box, or one ranged read."""
        if whole is not None:
            return box_view(whole, tuple(item.storage_offsets), tuple(item.lengths))
        start, end = box.span(item.storage_offsets, item.lengths)
        raw = torch.frombuffer(bytearray(self.fs.cat_file(box.path, start=start, end=end)), dtype=torch.uint8)
        strides = [math.prod(box.lengths[d + 1 :]) for d in range(len(box.lengths))]
        return torch.as_strided(raw.view(DTYPES[box.dtype]), tuple(item.lengths), strides, 0)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_box: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            by_box[self.box(item).path].append(item)
        for items in by_box.values():
            box = self.box(items[0])
            whole = self.mapped(box)
            for item in items:
                target = planner.resolve_tensor(item)
                target.copy_(self.region(box, item, whole))
                planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done


class StagedLoadPlanner(LoadPlanner):
    """DCP ``LoadPlanner`` whose plan is a transition's ReadItems for one rank.

    ``resolve_tensor`` hands DCP the destination view itself, so the reader's copy is
    the only copy; a region held twice on the rank (two buffers) is copied on commit.
    """

    def __init__(self, transfers: Sequence[Transfer], dst_buffers: Mapping[str, torch.Tensor]) -> None:
        self.transfers: dict[ReadItem, list[Transfer]] = defaultdict(list)
        for t in transfers:
            self.transfers[t.item].append(t)
        self.dst = dst_buffers

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(list(self.transfers))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CoverageError(f"staged checkpoints hold tensors only, not bytes ({read_item.dest_index.fqn!r})")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.transfers[read_item][0].dst_view(self.dst)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        for other in self.transfers[read_item][1:]:
            other.dst_view(self.dst).copy_(tensor)


def staged_transfers(plan: TransferPlan, rank: int) -> list[Transfer]:
    """This rank's transfers that read from the staged checkpoint."""
    return [t for t in plan.transfers if t.src_rank == STAGED and t.dst_rank == rank]


def check_staged(path: str | None, transfers: Sequence[Transfer], *, checksums: bool = False) -> StagedReader | None:
    """Raise (CoverageError / TransferError) unless ``path`` holds every box these
    transfers read, whole (and with matching crc32 when ``checksums``); reads no target."""
    if not transfers:
        return None
    if path is None:
        names = sorted({t.tensor for t in transfers})
        raise CoverageError(
            f"{len(transfers)} region(s) of tensors {names[:5]}{'...' if len(names) > 5 else ''} have no live "
            "source and must come from a staged checkpoint, but no staged_path was given"
        )
    reader = StagedReader(path)
    reader.check([t.item for t in transfers], checksums=checksums)
    return reader


def load_staged(
    path: str,
    plan: TransferPlan,
    rank: int,
    dst_buffers: MutableMapping[str, torch.Tensor],
    *,
    checksums: bool = False,
    transfers: Sequence[Transfer] | None = None,
    verified: bool = False,
    reader: StagedReader | None = None,
) -> int:
    """Fill ``rank``'s staged transfers (default: ``src_rank == STAGED``) from ``path``
    through DCP; missing target buffers are allocated into ``dst_buffers``. Returns the
    bytes loaded. ``verified``: the boxes were already checked (:func:`check_staged`).
    ``reader``: a :class:`StagedReader` of ``path`` to reuse (it caches the metadata)."""
    transfers = staged_transfers(plan, rank) if transfers is None else list(transfers)
    if not transfers:
        return 0
    reader = reader if reader is not None else StagedReader(path)
    if not verified:
        reader.check([t.item for t in transfers], checksums=checksums)
    specs = plan.dst_buffers[rank]
    for name in sorted({t.dst_buffer for t in transfers} - set(dst_buffers)):
        dst_buffers[name] = torch.empty(specs[name].shape, dtype=DTYPES[specs[name].dtype])
    planner = StagedLoadPlanner(transfers, dst_buffers)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
        except CheckpointException as e:  # DCP wraps each rank's failure; surface ours
            cause = next((exc for exc, _ in e.failures.values() if isinstance(exc, Exception)), None)
            if cause is None:
                raise
            raise cause from e
    # bytes read: the source's dtype, which a cast (plan_transfers(cast=True)) may not share with the target
    return sum(math.prod(t.item.lengths) * itemsize(plan.src_layouts[t.tensor].dtype) for t in transfers)
