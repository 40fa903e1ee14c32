"""Writing checkpoint data through torch.distributed.checkpoint, in the staged box format.

A Nereus checkpoint's data directory IS a staged checkpoint (``reshard/staged.py``): one
raw row-major file per distinct box, named ``box_file(tensor, global offsets)``, plus
``metadata.json``. So any layout on any number of ranks loads it through the staged
reader, and nothing in it names a rank or a world size.

The save goes through ``dcp.save`` with two narrow pieces, as DCP intends:

- :class:`BoxSavePlanner` (a ``SavePlanner``): the local plan is one ``WriteItem`` per box
  this rank owns — the LOWEST rank holding the box, so every box is written exactly once
  and ranks write in parallel without talking; ``resolve_data`` returns the box's tensor
  (a view of a local buffer, or for offline conversion, bytes read from the source on
  demand). The global plan checks that every box has exactly one writer and gathers the
  ranks' ``planner_data`` (their RNG states) into the metadata.
- :class:`BoxWriter` (a ``StorageWriter``): ``write_data`` writes each item's bytes to its
  box file (local files: temporary name, fsync, rename; object stores: one put, which is
  atomic) and returns its size and block checksums (CRC32C) — with ``private`` (a staged copy
  in node memory) every file it creates is 0600 and every directory 0700; ``finish`` (coordinator only,
  after every rank wrote) writes ``metadata.json`` (self-checksummed) and the caller's side
  files (``extras``: HF configs, tokenizer files), and calls ``commit(data_dir, metadata,
  results, aux)`` with their sizes and checksums — the checkpoint store commits the
  manifest there, so DCP's own exception fan-out tells every rank whether it happened.

DCP call order: set_up_planner / set_up_storage_writer, create_local_plan /
prepare_local_plan (all ranks), create_global_plan / prepare_global_plan (coordinator),
finish_plan + write_data (all ranks), finish (coordinator).
"""

from __future__ import annotations

import itertools
import math
import os
import stat
import warnings
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Collection, Mapping, Sequence

import fsspec
import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future as TorchFuture

from nereus.reshard.layout import DTYPES, Dims, TensorLayout
from nereus.reshard.staged import METADATA, box_file, seal, staged_metadata

from .checksum import BLOCK, block_checksums
from .errors import StoreError
from .records import AuxFile

Box = tuple[str, Dims, Dims]
"""(tensor name, global offsets, lengths)."""


def plan_owned_boxes(layouts: Mapping[str, TensorLayout], rank: int, among: Collection[int] | None = None) -> list[Box]:
    """The non-empty distinct boxes whose lowest holder is ``rank``, by tensor name (pure).
    ``among``: only these ranks count as holders (a save by a subset of the world, e.g. one
    node's ranks, writes every box any of them holds)."""
    out = []
    for name in sorted(layouts):
        for (offsets, lengths), holders in layouts[name].unique_boxes().items():
            ranks = [s.rank for s in holders if among is None or s.rank in among]
            if math.prod(lengths) and ranks and min(ranks) == rank:
                out.append((name, offsets, lengths))
    return out


def all_boxes(layouts: Mapping[str, TensorLayout], among: Collection[int] | None = None) -> list[Box]:
    """Every non-empty distinct box (held by one of ``among``, when given), by tensor name."""
    return [(n, o, l) for n in sorted(layouts) for (o, l), holders in layouts[n].unique_boxes().items()
            if math.prod(l) and (among is None or any(s.rank in among for s in holders))]


def write_item(layout: TensorLayout, offsets: Dims, lengths: Dims) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(layout.name, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(lengths)),
            properties=TensorProperties(dtype=DTYPES[layout.dtype]),
            size=torch.Size(layout.shape),
        ),
    )


class BoxSavePlanner(SavePlanner):
    """Plans the boxes one rank writes; ``resolve(name, offsets, lengths)`` yields their data."""

    def __init__(
        self,
        layouts: Mapping[str, TensorLayout],
        boxes: Sequence[Box],
        resolve: Callable[[str, Dims, Dims], torch.Tensor],
        planner_data: Any = None,
        among: Collection[int] | None = None,
    ) -> None:
        self.layouts = layouts
        self.boxes = list(boxes)
        self.resolve = resolve
        self.planner_data = planner_data
        self.among = among
        """The ranks whose boxes this save holds (None: every rank's)."""

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [write_item(self.layouts[n], o, l) for n, o, l in self.boxes]
        return SavePlan(items, planner_data=self.planner_data)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        written: dict[tuple[str, Dims], int] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                key = (item.index.fqn, tuple(item.index.offset))
                if key in written:
                    raise StoreError(f"tensor {key[0]!r} box at {list(key[1])} is written by ranks {written[key]} and {rank}")
                written[key] = rank
        for name, offsets, _ in all_boxes(self.layouts, self.among):
            if (name, tuple(offsets)) not in written:
                raise StoreError(f"tensor {name!r} box at {list(offsets)} has no writer in this save")
        tensors = {
            name: TensorStorageMetadata(
                properties=TensorProperties(dtype=DTYPES[t.dtype]),
                size=torch.Size(t.shape),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n))
                    for o, n in t.unique_boxes()
                    if math.prod(n)
                ],
            )
            for name, t in self.layouts.items()
        }
        metadata = Metadata(state_dict_metadata=tensors, planner_data=[p.planner_data for p in all_plans])
        return all_plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        chunk = write_item.tensor_data.chunk
        return self.resolve(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))


@dataclass(frozen=True, kw_only=True, slots=True)
class BoxWritten:
    """``WriteResult.storage_data``: the box file (relative to the data dir) and its block checksums."""

    path: str
    checksums: tuple[str, ...]


class Scratch:
    """A reusable host buffer: ``take(shape, dtype)`` is a view over one persistent byte
    buffer, grown when too small, so streaming code does not pay first-touch page faults
    (~0.3 s/GiB here) for every tensor. A view is valid until the next ``take``."""

    def __init__(self, nbytes: int = 0) -> None:
        self._buf = torch.empty(nbytes, dtype=torch.uint8)

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        if self._buf.numel() < n:
            self._buf = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._buf = torch.empty(n, dtype=torch.uint8)
        return self._buf[:n].view(dtype).view(tuple(shape))


def host_bytes(t: torch.Tensor, scratch: Scratch | None = None) -> np.ndarray:
    """A tensor's bytes, row-major, as uint8 (no copy for a contiguous CPU tensor; strided
    or device tensors are copied into ``scratch`` when given)."""
    t = t.detach()
    if not (t.is_contiguous() and t.device.type == "cpu"):
        if scratch is None:
            t = t.cpu().contiguous()
        else:
            t = scratch.take(t.shape, t.dtype).copy_(t)
    return t.reshape(-1).view(torch.uint8).numpy()


def _finish_local(fd: int, tmp: str, path: str, sync: bool) -> None:
    try:
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


_TMP_IDS = itertools.count()


PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700
"""Modes of a private root's files and directories (a staged copy in node memory)."""


def write_file(fs: fsspec.AbstractFileSystem, path: str, data, *, sync: bool, pool: Executor | None = None,
               private: bool = False) -> Future | None:
    """Write a whole file so a reader sees it whole or not at all.

    Local: temporary name, write, fsync (``sync``), rename; with a ``pool`` the fsync and
    rename run there (returned future), overlapping the disk flush with the next file.
    Elsewhere one ``pipe_file`` (a single put on object stores, visible atomically).
    ``private``: the temporary file is created new (``O_EXCL``, no symlink followed), mode
    0600 whatever the umask; the rename replaces a link at ``path``, never follows it."""
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, bytes(memoryview(data).cast("B")))
        return None
    tmp = f"{path}.tmp-{os.getpid()}-{next(_TMP_IDS)}"
    if private:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
        os.fchmod(fd, PRIVATE_FILE)  # the umask only removes bits; an explicit mode says it once
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    if sync and pool is not None:
        return pool.submit(_finish_local, fd, tmp, path, sync)
    _finish_local(fd, tmp, path, sync)
    return None


def is_private_root(path: str) -> bool:
    """A local directory that exists with no group or other permission bits."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o077


def tighten(top: str, seen: set[str]) -> None:
    """Every file under ``top`` to 0600 and every directory (``top`` too) to 0700, links
    left alone; paths in ``seen`` below ``top``'s own level are not looked at again (OCDBT's
    data files are new names; its manifest in ``top`` is replaced at every commit)."""
    for d, dirs, files in os.walk(top):
        named = [(os.path.join(d, x), PRIVATE_DIR) for x in dirs] + [(os.path.join(d, x), PRIVATE_FILE) for x in files]
        for path, mode in named + ([(top, PRIVATE_DIR)] if d == top else []):
            if path in seen and d != top:
                continue
            try:
                st = os.lstat(path)
                if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
                    os.chmod(path, mode)
            except FileNotFoundError:
                continue  # retired meanwhile
            seen.add(path)


def makedirs_private(path: str) -> None:
    """``os.makedirs`` with every directory it creates exactly 0700 whatever the umask
    (``os.makedirs``' mode reaches only the leaf, and the umask only removes bits: a umask
    of 0o277 would leave 0500); a directory that was already there is left as it is."""
    parent = os.path.dirname(path.rstrip("/"))
    if parent and parent != path and not os.path.isdir(parent):
        makedirs_private(parent)
    try:
        os.mkdir(path, PRIVATE_DIR)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return
    private_mode(path)


def private_mode(path: str) -> None:
    """Set the directory ``path`` (just made by this process) to exactly 0700, through a
    descriptor opened without following a link; one the umask left unreadable to its owner
    is changed by name, once ``lstat`` says it is a directory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except PermissionError:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.chmod(path, PRIVATE_DIR)
        return
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != PRIVATE_DIR:
            os.fchmod(fd, PRIVATE_DIR)
    finally:
        os.close(fd)


def fsync_dir(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Make renames inside a local directory durable (no-op elsewhere)."""
    if isinstance(fs, LocalFileSystem):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class BoxWriter(StorageWriter):
    """Writes box files under ``<root_url>/<data dir>``; the coordinator commits in ``finish``.

    ``prepare()`` runs on the coordinator during global planning: it checks the
    destination and returns the data directory (relative to ``root_url``), which DCP then
    scatters to every rank inside the plans' ``storage_data`` — so all ranks agree on a
    fresh directory without an extra collective. ``commit(data_dir, metadata, results,
    aux)`` receives every rank's :class:`BoxWritten` results and the coordinator's
    :class:`~.records.AuxFile` s; if it raises, the save fails on every rank (DCP
    broadcasts the coordinator's exception).
    """

    def __init__(
        self,
        root_url: str,
        layouts: Mapping[str, TensorLayout],
        prepare: Callable[[], str],
        commit: Callable[[str, Metadata, list[list[WriteResult]], tuple[AuxFile, ...]], None],
        *,
        sync: bool = True,
        progress: Callable[[int], None] | None = None,
        checksum_block: int = BLOCK,
        extras: Mapping[str, bytes] | None = None,
        private: bool = False,
    ) -> None:
        super().__init__()
        self.private = private
        """Files 0600 and directories 0700 (``write_file``): a private root's (a staged copy)."""
        self.root_url = root_url.rstrip("/")
        self.fs, _ = fsspec.core.url_to_fs(self.root_url)
        self.layouts = layouts
        self.prepare = prepare
        self.commit = commit
        self.sync = sync
        self.progress = progress
        self.data_dir: str | None = None
        self.scratch = Scratch()
        self.checksum_block = checksum_block
        self.extras = dict(extras or {})

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        data_dir = self.prepare()
        return [replace(p, storage_data=data_dir) for p in plans]

    def _root(self, data_dir: str) -> str:
        return fsspec.core.url_to_fs(f"{self.root_url}/{data_dir}")[1]

    def _makedirs(self, path: str) -> None:
        if self.private and isinstance(self.fs, LocalFileSystem):
            makedirs_private(path)
        else:
            self.fs.makedirs(path, exist_ok=True)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        """Write every item's box file. Per item, the checksums run on a helper thread while
        this thread writes the same bytes (both release the GIL); fsync + rename of local
        files run on the helpers too and are all awaited before returning."""
        self.data_dir = plan.storage_data
        root = self._root(self.data_dir)
        self._makedirs(root)
        results, flushes = [], []
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="nereus-write") as pool:
            for item in plan.items:
                data = host_bytes(planner.resolve_data(item), self.scratch)
                rel = box_file(item.index.fqn, tuple(item.index.offset))
                sums = pool.submit(block_checksums, data, self.checksum_block)
                flush = write_file(self.fs, f"{root}/{rel}", data, sync=self.sync, pool=pool, private=self.private)
                if flush is not None:
                    flushes.append(flush)
                written = BoxWritten(path=rel, checksums=sums.result())
                results.append(WriteResult(index=item.index, size_in_bytes=data.nbytes, storage_data=written))
                if self.progress is not None:
                    self.progress(data.nbytes)
            for flush in flushes:
                flush.result()
        done: TorchFuture = TorchFuture()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        root = self._root(self.data_dir)
        self._makedirs(root)
        files = {METADATA: seal(staged_metadata(self.layouts)), **self.extras}
        aux = []
        for rel, data in files.items():
            if "/" in rel:
                self._makedirs(f"{root}/{rel.rsplit('/', 1)[0]}")
            write_file(self.fs, f"{root}/{rel}", np.frombuffer(data, dtype=np.uint8), sync=self.sync, private=self.private)
            aux.append(AuxFile(path=rel, nbytes=len(data), checksums=block_checksums(data, self.checksum_block)))
        if self.sync:
            for d in sorted({f"{root}/{rel.rsplit('/', 1)[0]}" for rel in files if "/" in rel} | {root}):
                fsync_dir(self.fs, d)
        self.commit(self.data_dir, metadata, results, tuple(aux))


def dcp_save(planner: BoxSavePlanner, writer: BoxWriter, *, group: Any = None, no_dist: bool = False) -> Metadata:
    """``dcp.save`` with these pieces; a rank's failure is re-raised as its own exception."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            return dcp.save({}, storage_writer=writer, planner=planner, process_group=group, no_dist=no_dist)
        except CheckpointException as e:
            raise unwrap(e) from None


def unwrap(e: CheckpointException) -> BaseException:
    """The first rank's original exception inside DCP's wrapper (the wrapper if none)."""
    for rank in sorted(e.failures):
        exc = e.failures[rank][0]
        if isinstance(exc, CheckpointException):
            return unwrap(exc)
        if isinstance(exc, BaseException):
            return exc
    return e


__all__ = [
    "BoxSavePlanner",
    "BoxWriter",
    "BoxWritten",
    "dcp_save",
    "plan_owned_boxes",
    "all_boxes",
    "write_file",
]
