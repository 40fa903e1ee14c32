"""Loading a memory-staged checkpoint (``staged.py``'s format) through torch.distributed.checkpoint.

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
import warnings
from collections import defaultdict
from typing import Any, Iterable, Mapping, MutableMapping, Sequence

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

from .checksum import crc32c, region_run_starts, region_runs
from .errors import CoverageError, TransferError, TransitionTimeout
from .graph import STAGED_PIECE_BYTES
from .layout import DTYPES, box_view, itemsize
from .pieces import BlockCheck, Region, batches, check_block, fill, merge_ranges, union_blocks
from .plan import STAGED, Transfer, TransferPlan

from .staged import METADATA, SCHEMA, SIDECAR, StagedBox, box_file, unseal, versions_of


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
                other = [] if box.version is None else versions_of(self.fs, self.root, box.tensor, box.offsets)
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
