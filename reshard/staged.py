"""Memory-staged checkpoint: the staged executor's storage, read through DCP.

A staged checkpoint holds every distinct SOURCE box of a transition once, keyed by tensor
name and global offsets — never by rank or world size — so any rank of any later layout
can read any region of it, even after the ranks that wrote it are gone::

    <path>/metadata.json                      {"schema": 2, "version": v, "tensors": {name: {shape, dtype,
                                               boxes: [[offsets, lengths, version], ...]}}, "crc32c": ...}
    <path>/<quote(name)>@<o0_o1_..>@v<v>.bin   raw row-major bytes of the box at offsets o, version v
    <path>/<...>.bin.crc32c                   {"block": B, "crc32c": [one per B-byte block]} (optional)

(``quote`` is ``urllib.parse.quote(name, safe="")``; a 0-d tensor's box is ``@scalar``; a
box of version None — the store's checkpoint data, one version per directory — has no
``@v`` part.) ``metadata.json`` carries the CRC32C of its own canonical JSON, so a
truncated or damaged one is an error naming it, never a parse error deep in a load.

Versions. Every save states the EMU version it stages (``version``); each box records the
version it was written at. A later save at another version rewrites the boxes that have a
live holder and keeps the entries of boxes nobody could rewrite (a rank that left) with
their OLD version, so a reader — which by default reads the newest version only — gets an
error naming such a box instead of old bytes silently mixed with fresh ones. Boxes of a
tensor cut differently than before are dropped. Each box is written by its lowest live
holder to a temporary name renamed into place, so a reader sees a box whole or not at all;
every writer of one save computes the same ``metadata.json`` from (layouts, live set,
version, the previous record), so concurrent writers agree on its bytes.

Why not ``dcp.save``: DCP's save is collective — every rank's plan goes to a coordinator,
whose ``finish`` writes the metadata — while a staged save must work when some ranks are
gone and each rank stages on its own (a rank about to leave stages its shards alone).
Under ``no_dist`` every rank would be its own coordinator with nothing left to plan, so a
``SavePlanner`` would add no check; the writes are plain atomic file writes instead. (The
store's checkpoints, whose ranks are all alive, do go through ``dcp.save``.)

Loading goes through ``torch.distributed.checkpoint.load`` with two narrow pieces:

- :class:`StagedReader` (a DCP ``StorageReader``) turns the record into DCP ``Metadata``
  (each tensor's chunks = its boxes) and, in ``read_data``, reads for each box only what
  its items need: local files are memory-mapped (only the touched pages are read), other
  filesystems get ranged reads of the items' contiguous runs (``checksum.region_runs``:
  runs separated by less than a run are merged, so under 2x the region's bytes). With
  ``verify`` the reader fetches whole checksum blocks instead and checks each block's
  CRC32C on the very bytes it then copies from: one read, verified. Fetches go in pieces
  of at most ``graph.STAGED_PIECE_BYTES`` (less when the transfers are smaller), each
  copied into the targets before the next is fetched (:mod:`.pieces`), so a read holds at
  most what the transition graph counted for it beside the targets. Before a load, :func:`check_staged`
  checks presence, sizes and checksum lists only: no byte of data is read twice;
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

from .checksum import BLOCK, block_checksums, crc32c, region_run_starts, region_runs
from .errors import CoverageError, LayoutError, TransferError, TransitionTimeout
from .graph import STAGED_PIECE_BYTES
from .layout import DTYPES, Dims, TensorLayout, box_view, itemsize, shard_view
from .pieces import BlockCheck, Region, batches, check_block, fill, merge_ranges, union_blocks
from .plan import STAGED, Transfer, TransferPlan

SCHEMA = 2
METADATA = "metadata.json"
SIDECAR = ".crc32c"
DEFAULT_ROOT = "/dev/shm/nereus"


def default_staged_path(name: str) -> str:
    """A staging directory in node shared memory for one transition or job."""
    return f"{DEFAULT_ROOT}/{quote(name, safe='')}"


def box_file(name: str, offsets: Sequence[int], version: int | None = None) -> str:
    """File name of a box: the escaped tensor name, the box's global offsets, its version."""
    where = "_".join(str(int(o)) for o in offsets) or "scalar"
    return f"{quote(name, safe='')}@{where}{'' if version is None else f'@v{int(version)}'}.bin"


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes, row-major, as a uint8 numpy array (no copy for CPU contiguous)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _atomic_write(fs, path: str, data) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def seal(record: dict) -> bytes:
    """``record`` as canonical JSON with the CRC32C of that JSON added (key ``crc32c``)."""
    body = {k: v for k, v in record.items() if k != "crc32c"}
    text = json.dumps(body, sort_keys=True)
    return json.dumps({**body, "crc32c": f"{crc32c(text.encode()):08x}"}, sort_keys=True).encode()


def unseal(raw: bytes, where: str) -> dict:
    """The record of :func:`seal` bytes; CoverageError naming ``where`` unless whole and intact."""
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CoverageError(f"staged metadata {where!r} is not valid JSON ({e}): truncated or corrupted") from None
    if not isinstance(record, dict):
        raise CoverageError(f"staged metadata {where!r} is not a JSON object: corrupted")
    if record.get("schema") == 1:  # written before versions and self-checksums: no crc to check
        return record
    want = record.get("crc32c")
    body = json.dumps({k: v for k, v in record.items() if k != "crc32c"}, sort_keys=True)
    if want != f"{crc32c(body.encode()):08x}":
        raise CoverageError(f"staged metadata {where!r} fails its own crc32c (stored {want!r}): corrupted")
    return record


def staged_metadata(layouts: Mapping[str, TensorLayout], version: int | None = None) -> dict:
    """The record of a staged checkpoint: shapes, dtypes, non-empty distinct boxes, version."""
    return {
        "schema": SCHEMA,
        "version": version,
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
    version: int = 0,
) -> list[str]:
    """Write the boxes ``rank`` is the lowest live holder of; returns the files written.

    ``layouts`` are the merged SOURCE layouts (``plan.src_layouts``); every live rank
    calls this with the same layouts and ``version`` and its own ``buffers``. ``version``
    names the STATE being staged (the EMU version): one state may be staged in parts (a
    rank stages its shards before it leaves, the others later, all at one version), and a
    new state must use a new version — a box with no live holder is not written, and its
    file of an earlier version then keeps that version in its name, so a read of the new
    version names it instead of using it (module docstring). A rewritten box's files of
    other versions are removed. ``checksums`` adds a CRC32C block sidecar per box.
    """
    fs, root = fsspec.core.url_to_fs(path)
    fs.makedirs(root, exist_ok=True)
    written = []
    existing = _all_versions(fs, root)  # one listing, not one per box
    for name, layout in sorted(layouts.items()):
        for (offsets, lengths), holders in layout.unique_boxes().items():
            alive = sorted((s for s in holders if live is None or s.rank in live), key=lambda s: s.rank)
            if not math.prod(lengths) or not alive or alive[0].rank != rank:
                continue
            try:
                view = shard_view(buffers, layout, alive[0])
            except KeyError:
                raise LayoutError(
                    f"rank {rank} must stage tensor {name!r} box at {list(offsets)} but has no buffer "
                    f"{alive[0].buffer or name!r}"
                ) from None
            if tuple(view.shape) != tuple(lengths) or view.dtype != DTYPES[layout.dtype]:
                raise LayoutError(
                    f"rank {rank}: buffer for tensor {name!r} box at {list(offsets)} is {list(view.shape)} "
                    f"{view.dtype}, expected {list(lengths)} {layout.dtype}"
                )
            data = _host_bytes(view)
            target = f"{root}/{box_file(name, offsets, version)}"
            _atomic_write(fs, target, data)
            if checksums:
                sums = {"block": BLOCK, "crc32c": list(block_checksums(data, BLOCK))}
                _atomic_write(fs, target + SIDECAR, json.dumps(sums).encode())
            written.append(target)
            for old in existing.get(box_file(name, offsets)[: -len(".bin")], ()):
                if old != version:
                    for p in (f"{root}/{box_file(name, offsets, old)}", f"{root}/{box_file(name, offsets, old)}{SIDECAR}"):
                        _remove(fs, p)
    old = _read_record(fs, root)
    _atomic_write(fs, f"{root}/{METADATA}", seal(merge_records(old, layouts, version)))
    return written


def _remove(fs, path: str) -> None:
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass


def _all_versions(fs, root: str) -> dict[str, list[int]]:
    """For every box with a versioned file in ``root``: its stem (name and offsets) -> versions."""
    out: dict[str, list[int]] = defaultdict(list)
    for p in fs.ls(root, detail=False):
        base = p.rstrip("/").rsplit("/", 1)[-1]
        if base.endswith(".bin") and "@v" in base:
            stem, _, tail = base[: -len(".bin")].rpartition("@v")
            if tail.isdigit():
                out[stem].append(int(tail))
    return out


def _versions(fs, root: str, name: str, offsets) -> list[int]:
    """The versions of one box that have a file in ``root``."""
    stem = box_file(name, offsets)[: -len(".bin")]
    out = []
    for p in fs.glob(f"{root}/{_glob_escape(stem)}@v*.bin"):
        tail = p.rsplit("@v", 1)[1][: -len(".bin")]
        if tail.isdigit():
            out.append(int(tail))
    return sorted(out)


def _glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in text)


def _read_record(fs, root: str) -> dict | None:
    try:
        raw = fs.cat_file(f"{root}/{METADATA}")
    except FileNotFoundError:
        return None
    return unseal(raw, f"{root}/{METADATA}")


def merge_records(old: dict | None, layouts: Mapping[str, TensorLayout], version: int) -> dict:
    """The record after a save at ``version`` (pure): this save's tensors as its layouts
    cut them, tensors the save does not name as an earlier save recorded them. Every writer
    of one save computes the same record (it does not depend on which boxes a rank wrote)."""
    tensors = dict((old or {}).get("tensors", {}))
    tensors.update(staged_metadata(layouts, version)["tensors"])
    return {"schema": SCHEMA, "version": version, "tensors": dict(sorted(tensors.items()))}


# ------------------------------------------------------------------------------ reading


@dataclass(frozen=True, kw_only=True, slots=True)
class StagedBox:
    """One box file: the tensor, the box's global offsets and lengths, dtype, path, version
    and, when known up front (a store manifest), its block checksums."""

    tensor: str
    offsets: Dims
    lengths: Dims
    dtype: str
    path: str
    version: int | None = None
    checksums: tuple[str, ...] | None = None
    block: int = BLOCK

    @property
    def nbytes(self) -> int:
        return math.prod(self.lengths) * itemsize(self.dtype)

    def runs(self, offsets: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int]]:
        """Byte runs [start, end) of the box file that hold the region (``region_runs``)."""
        return region_runs(self.lengths, itemsize(self.dtype), offsets, lengths)

    def where(self) -> str:
        return f"staged box file {self.path!r} of tensor {self.tensor!r} (box at {list(self.offsets)})"


def record_from_boxes(boxes: Iterable[StagedBox], shapes: Mapping[str, tuple[Sequence[int], str]], version=None) -> dict:
    """A reader record from explicit boxes (the store builds one from its manifest)."""
    tensors: dict[str, dict] = {n: {"shape": list(s), "dtype": d, "boxes": []} for n, (s, d) in shapes.items()}
    for b in boxes:
        tensors[b.tensor]["boxes"].append(b)
    return {"schema": SCHEMA, "version": version, "tensors": tensors}


class StagedReader(StorageReader):
    """DCP ``StorageReader`` over a staged directory (see the module docstring).

    ``record``: the checkpoint's record (default: read ``metadata.json``); its boxes may be
    :class:`StagedBox` es carrying paths and checksums. ``verify``: check the CRC32C of
    every block read. ``version``: the version every box read must have (default: the
    record's newest). Call order (DCP's): read_metadata, set_up_storage_reader,
    prepare_local_plan, prepare_global_plan (coordinator; here every rank is its own),
    read_data.
    """

    def __init__(self, path: str, *, record: dict | None = None, verify: bool = False, version: int | None = None) -> None:
        super().__init__()
        self.path = path
        self.fs, self.root = fsspec.core.url_to_fs(path)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.record, self.verify, self.version = record, verify, version
        self.metadata: Metadata | None = None
        self.boxes: dict[MetadataIndex, StagedBox] = {}
        self.bytes_read = 0
        self.deadline = None  # a transport.Deadline: checked between the batches of pieces a read fetches
        self._sums: dict[str, tuple[int, tuple[str, ...]]] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset: one reader serves one load of one staged path."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return isinstance(checkpoint_id, str)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is not None:
            return self.metadata
        meta_path = f"{self.root}/{METADATA}"
        record = self.record
        if record is None:
            try:
                record = unseal(self.fs.cat_file(meta_path), meta_path)
            except FileNotFoundError:
                raise CoverageError(f"staged checkpoint {self.path!r} has no {METADATA} (nothing was staged there)") from None
        if record.get("schema") not in (1, SCHEMA):
            raise CoverageError(f"staged checkpoint {meta_path!r} has schema {record.get('schema')!r}, expected {SCHEMA}")
        if self.version is None:
            self.version = record.get("version")
        tensors = {}
        try:
            for name, t in record["tensors"].items():
                chunks = []
                for entry in t["boxes"]:
                    box = entry if isinstance(entry, StagedBox) else self._box(name, t["dtype"], entry[0], entry[1], self.version)
                    self.boxes[MetadataIndex(name, box.offsets)] = box
                    chunks.append(ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.lengths)))
                tensors[name] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=DTYPES[t["dtype"]]), size=torch.Size(t["shape"]), chunks=chunks
                )
        except (KeyError, TypeError, ValueError) as e:
            raise CoverageError(f"staged metadata {meta_path!r} is malformed ({type(e).__name__}: {e})") from None
        self.metadata = Metadata(state_dict_metadata=tensors, storage_data=dict(self.boxes))
        return self.metadata

    def _box(self, name: str, dtype: str, offsets, lengths, version=None) -> StagedBox:
        return StagedBox(tensor=name, offsets=tuple(offsets), lengths=tuple(lengths), dtype=dtype, version=version,
                         path=f"{self.root}/{box_file(name, offsets, version)}")

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
        """Raise unless every box the items read exists whole (its size, from a listing: no
        byte of it is read); with ``checksums``, unless each has its block checksums (the
        record's or a sidecar, one per block). The blocks themselves are verified by the
        load, on the bytes it reads (:meth:`read_data`)."""
        items = list(items)
        for box in {id(b): b for b in (self.box(i) for i in items)}.values():
            try:
                size = self.fs.size(box.path)
            except FileNotFoundError:
                size = None
            if size is None:
                other = [] if box.version is None else _versions(self.fs, self.root, box.tensor, box.offsets)
                if other:
                    raise CoverageError(
                        f"{box.where()} is missing at version {box.version}: it was staged at version(s) {other} "
                        "only (its holder left before staging it again)"
                    )
                raise CoverageError(f"{box.where()} is missing")
            if size != box.nbytes:
                raise CoverageError(
                    f"{box.where()} has {size} bytes, expected {box.nbytes} ({list(box.lengths)} {box.dtype}): truncated or foreign"
                )
            if checksums:
                self._checksums(box)

    def _by_box(self, items: Iterable[ReadItem]) -> list[tuple[StagedBox, list[ReadItem]]]:
        groups: dict[str, list[ReadItem]] = defaultdict(list)
        boxes: dict[str, StagedBox] = {}
        for item in items:
            box = self.box(item)
            groups[box.path].append(item)
            boxes[box.path] = box
        return [(boxes[p], its) for p, its in groups.items()]

    def _checksums(self, box: StagedBox) -> tuple[int, tuple[str, ...]]:
        """The box's (block size, CRC32C per block): from the record, else its sidecar;
        TransferError unless there is exactly one per block of the box."""
        if box.checksums is not None:
            block, sums = box.block, box.checksums
        elif box.path in self._sums:
            block, sums = self._sums[box.path]
        else:
            try:
                raw = json.loads(self.fs.cat_file(box.path + SIDECAR))
                block, sums = int(raw["block"]), tuple(raw["crc32c"])
            except FileNotFoundError:
                raise CoverageError(f"{box.where()} has no {SIDECAR} sidecar (staged without checksums)") from None
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
                raise TransferError(f"{box.where()}: its {SIDECAR} sidecar is damaged") from None
            self._sums[box.path] = block, sums
        if block > 0 and block % itemsize(box.dtype):
            raise TransferError(
                f"{box.where()} has {block}-byte checksum blocks, not a multiple of its {itemsize(box.dtype)}-byte "
                f"{box.dtype} elements: foreign or corrupted"
            )
        if block <= 0 or len(sums) != max(1, -(-box.nbytes // block)):
            raise TransferError(f"{box.where()} has {len(sums)} checksums of {block}-byte blocks for {box.nbytes} bytes: corrupted")
        return block, sums

    def _cat(self, box: StagedBox, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        if not ranges:
            return []
        self.bytes_read += sum(z - a for a, z in ranges)
        if len(ranges) == 1:
            (a, z), = ranges
            return [self.fs.cat_file(box.path, start=a, end=z)]
        n = len(ranges)
        return self.fs.cat_ranges([box.path] * n, [a for a, _ in ranges], [z for _, z in ranges], on_error="raise")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy every item's region into its target, box by box, verifying (``verify``) each
        block on the bytes the copies come from.

        Local files: a box that is one item's whole region, into a contiguous CPU target of
        its dtype (a restore in the plan it was saved in), is read straight into the target
        and checked there; otherwise one copy-on-write memory map per box, checksums run on
        the map, then the regions are copied from it (pages are read once, as touched). Other
        filesystems: the byte ranges the items need (their runs, or with ``verify`` the
        whole blocks that cover them) are fetched in pieces of at most ``limit`` bytes in
        all at a time, each piece's bytes copied into the targets straight away, so a read
        holds at most ``limit`` bytes beside its targets (``StagedLoadPlanner.piece_bytes``:
        what the transition graph counted for it). A verified read fetches whole checksum
        blocks, so its pieces are ``STAGED_PIECE_BYTES`` (one default block) whatever the
        region's size — not the region's bytes, which would fetch a 4 MiB block in
        thousands of requests; the graph charges every staged read that much. A local
        read into a non-contiguous target on a device (a strided CUDA view, which
        ``copy_`` would stage whole on the device) is copied in the same bounded pieces.
        ``self.deadline``, when set, is checked between batches."""
        limit = planner.piece_bytes if isinstance(planner, StagedLoadPlanner) else STAGED_PIECE_BYTES
        if self.verify:
            limit = STAGED_PIECE_BYTES
        for box, items in self._by_box(plan.items):
            targets = [planner.resolve_tensor(i) for i in items]
            if self.local:
                self._read_mapped(box, items, targets)
            else:
                self._read_pieces(box, items, targets, limit)
            for item, target in zip(items, targets):
                planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_mapped(self, box: StagedBox, items: Sequence[ReadItem], targets: Sequence[torch.Tensor]) -> None:
        if not box.nbytes:
            return
        if len(items) == 1 and self._read_whole(box, items[0], targets[0]):
            return
        raw = self._map(box)
        size = itemsize(box.dtype)
        if self.verify:
            block, sums = self._checksums(box)
            needed = union_blocks([region_run_starts(box.lengths, size, i.storage_offsets, i.lengths) for i in items], block)
            for first, end in needed:
                for b in range(first, end):
                    lo, hi = b * block, min((b + 1) * block, box.nbytes)
                    check_block(box, b, lo, hi, f"{crc32c(raw[lo:hi]):08x}", sums[b])
                self.bytes_read += min(end * block, box.nbytes) - first * block
        else:
            self.bytes_read += sum(math.prod(i.lengths) for i in items) * size  # the pages the copies touch
        flat = torch.from_numpy(raw).view(DTYPES[box.dtype])
        whole = flat.view(box.lengths)
        for item, target in zip(items, targets):
            if target.device.type != "cpu" and not target.is_contiguous():
                # copy_ from a strided CPU view into a strided device view stages the whole region
                # on the device: copy in pieces of at most STAGED_PIECE_BYTES instead
                region = Region(box, item, target)
                if not len(region.starts):
                    continue
                ranges = merge_ranges(region_runs(box.lengths, size, region.offsets, region.lengths))
                for batch in batches(ranges, STAGED_PIECE_BYTES, size):
                    self._check_deadline(box)
                    for a, z in batch:
                        region.copy_from(flat[a // size : z // size], a, z)
                continue
            target.copy_(box_view(whole, tuple(item.storage_offsets), tuple(item.lengths)))

    def _read_whole(self, box: StagedBox, item: ReadItem, target: torch.Tensor) -> bool:
        """The common case of a restore in the plan it was saved in: the box is one item's
        whole region and the target a contiguous CPU tensor of its dtype. The file is read
        straight into the target (no map, no page faults, one copy) and each block checked
        on the target's bytes, so on an error the target holds unverified bytes (as any
        failed load's buffers: not to be used). The checksum list is read and checked first.
        False, touching nothing, when the case does not apply."""
        if (target.device.type != "cpu" or not target.is_contiguous() or target.dtype != DTYPES[box.dtype]
                or tuple(item.lengths) != tuple(box.lengths) or any(item.storage_offsets)):
            return False
        block, sums = self._checksums(box) if self.verify else (0, [])
        out = target.detach().view(-1).view(torch.uint8).numpy()
        with open(box.path, "rb", buffering=0) as f:
            done = 0
            while done < box.nbytes:
                self._check_deadline(box)
                n = f.readinto(memoryview(out[done : done + STAGED_PIECE_BYTES]))
                if not n:
                    raise TransferError(f"{box.where()} ends after {done} of its {box.nbytes} bytes: truncated")
                done += n
        self.bytes_read += box.nbytes
        if self.verify:
            for b in range(len(sums)):
                lo, hi = b * block, min((b + 1) * block, box.nbytes)
                check_block(box, b, lo, hi, f"{crc32c(out[lo:hi]):08x}", sums[b])
        return True

    def _check_deadline(self, box: StagedBox) -> None:
        if self.deadline is not None and self.deadline.passed():
            raise TransitionTimeout(
                f"reading {box.where()} ran past the transition's deadline of {self.deadline.seconds:g} s"
            )

    def _read_pieces(self, box: StagedBox, items: Sequence[ReadItem], targets: Sequence[torch.Tensor], limit: int) -> None:
        size = itemsize(box.dtype)
        regions = [r for r in (Region(box, i, t) for i, t in zip(items, targets)) if len(r.starts)]
        if self.verify:
            blocks = BlockCheck(box, *self._checksums(box))
            ranges = blocks.ranges(regions)
        else:
            blocks = None
            ranges = merge_ranges([s for r in regions for s in region_runs(box.lengths, size, r.offsets, r.lengths)])
        with warnings.catch_warnings():  # pieces are read-only bytes; they are only copied from
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for batch in batches(ranges, limit, size):
                self._check_deadline(box)
                fill(box, batch, self._cat(box, batch), regions, blocks)  # the batch is freed before the next

    def _map(self, box: StagedBox) -> np.ndarray:
        """A copy-on-write memory map of a local box file (nothing is read until touched)."""
        return np.memmap(box.path, dtype=np.uint8, mode="c", shape=(box.nbytes,))


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

    @property
    def piece_bytes(self) -> int:
        """What the reader may hold beside the targets while it reads these transfers, as
        ``graph.plan_graph`` counts a round's staged reads: the largest one's bytes, at most
        ``STAGED_PIECE_BYTES`` (the reads run one after another)."""
        return min(STAGED_PIECE_BYTES, max((t.nbytes for ts in self.transfers.values() for t in ts), default=0))

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.transfers[read_item][0].dst_view(self.dst)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        for other in self.transfers[read_item][1:]:
            other.dst_view(self.dst).copy_(tensor)


def staged_transfers(plan: TransferPlan, rank: int) -> list[Transfer]:
    """This rank's transfers that read from the staged checkpoint."""
    return [t for t in plan.transfers if t.src_rank == STAGED and t.dst_rank == rank]


def check_staged(
    path: str | None, transfers: Sequence[Transfer], *, checksums: bool = False, version: int | None = None
) -> StagedReader | None:
    """Raise (CoverageError / TransferError) unless ``path`` holds every box these transfers
    read, whole, at ``version`` (default: the newest staged) and, with ``checksums``, with
    its block checksums — from the metadata and file sizes alone, reading no byte of the
    data and writing no target: the blocks themselves are NOT verified here. Returns the
    reader for the load, which verifies each block on the bytes it reads
    (``verify=checksums``; checking the blocks here too would read everything twice):
    pass it to ``load_staged(verified=True, reader=...)``, which refuses ``verified``
    without it."""
    if not transfers:
        return None
    if path is None:
        names = sorted({t.tensor for t in transfers})
        raise CoverageError(
            f"{len(transfers)} region(s) of tensors {names[:5]}{'...' if len(names) > 5 else ''} have no live "
            "source and must come from a staged checkpoint, but no staged_path was given"
        )
    reader = StagedReader(path, verify=checksums, version=version)
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
    version: int | None = None,
) -> int:
    """Fill ``rank``'s staged transfers (default: ``src_rank == STAGED``) from ``path``
    through DCP; missing target buffers are allocated into ``dst_buffers``. Returns the
    bytes loaded. ``checksums``: verify every block read, on the bytes read (one pass).
    ``verified``: the boxes were already checked present and whole by :func:`check_staged`,
    so their sizes are not listed again; it needs ``reader``, the reader that check
    returned. ``check_staged`` reads no data, so its ``checksums`` only take effect
    through that reader, which verifies each block as the load reads it: ``verified``
    without it is a ValueError, as is ``checksums`` with a reader that does not verify
    (either would load unverified bytes silently). ``reader``: a :class:`StagedReader` of
    ``path`` to reuse (it caches the metadata and sidecars; its own ``verify`` applies)."""
    transfers = staged_transfers(plan, rank) if transfers is None else list(transfers)
    if not transfers:
        return 0
    if verified and reader is None:
        raise ValueError(
            "load_staged(verified=True) needs reader=, the StagedReader check_staged returned: check_staged reads "
            "no data, its checksums are verified by that reader as the load reads the blocks"
        )
    if checksums and reader is not None and not reader.verify:
        raise ValueError("load_staged(checksums=True) was given a reader that does not verify (StagedReader(verify=False))")
    reader = reader if reader is not None else StagedReader(path, verify=checksums, version=version)
    if not verified:
        reader.check([t.item for t in transfers], checksums=reader.verify)
    specs = plan.dst_buffers[rank]
    for name in sorted({t.dst_buffer for t in transfers} - set(dst_buffers)):
        dst_buffers[name] = torch.empty(specs[name].shape, dtype=DTYPES[specs[name].dtype])
    run_load(reader, StagedLoadPlanner(transfers, dst_buffers))
    # bytes read: the source's dtype, which a cast (plan_transfers(cast=True)) may not share with the target
    return sum(math.prod(t.item.lengths) * itemsize(plan.src_layouts[t.tensor].dtype) for t in transfers)


def run_load(reader: StagedReader, planner: StagedLoadPlanner) -> None:
    """``dcp.load`` with these pieces and no collective; a failure surfaces as itself."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
        except CheckpointException as e:  # DCP wraps each rank's failure; surface ours
            cause = next((exc for exc, _ in e.failures.values() if isinstance(exc, Exception)), None)
            if cause is None:
                raise
            raise cause from e
