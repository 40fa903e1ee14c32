"""Sharded checkpoints on any fsspec path, loadable into any layout on any number of ranks.

A checkpoint root (a local directory, ``memory://...``, ``gs://...``, ``s3://...``) holds::

    <root>/meta/                                   the metadata store (OCDBT): manifests, plans, job
    <root>/data/<step, 12 digits>-<token>/         one staged checkpoint per save (box files)

Save (:func:`save_checkpoint`, every rank): each rank writes the boxes it is the lowest
holder of, in parallel, through ``dcp.save`` (``dcp_io``); the coordinator then writes
``metadata.json`` and the caller's side files (HF configs, tokenizer files) and commits the
manifest — step, EMUs, every file (box files, ``metadata.json``, side files) with its bytes
and CRC32C block checksums, job state, RNG states — with a create-only compare-and-swap.
The checkpoint exists from that instant: a save killed earlier leaves a data directory
that no manifest names, which is never listed or loaded, and which the next save (or
:meth:`CheckpointStore.clean_orphans`, which the trainer runs when it resumes) removes once
it is older than ``ORPHAN_AGE_S`` (as Orbax removes unfinished temporary checkpoints).
Two writers committing the same step are told (:class:`ConflictError`) and the loser
removes its data. Tensors are keyed ``<model>/<name>`` so several models share a root.

Load (:func:`load_checkpoint`, each rank on its own, no collective): the transfer plan
from the saved EMUs to the target EMUs (``plan_transfers(..., live=set(), staged=True)``)
lists exactly the regions this rank needs; their files are checked (present, whole) before
any byte moves, then ``reshard.staged`` reads only the checksum blocks covering those
regions, verifies each block's CRC32C against the manifest on the very bytes it read, and
copies the regions from them: one read per byte, on object stores too. A block that fails
is an error naming the file (the buffers then hold a partial load: do not use them).

Async save (host copy, then a background write and commit): ``store/async_save.py``.

Private roots (a staged copy): a local root whose directory has no group or other bits gets
files 0600, directories 0700 (``dcp_io``; tensorstore's narrowed after each write); durable
checkpoints keep the run dir's modes. ``seal``: the key a manifest is sealed under (``records``).
"""

from __future__ import annotations

import base64
import os
import time
import uuid
from typing import Iterable, Mapping, MutableMapping, Sequence

import fsspec
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from nereus.reshard.layout import DTYPES, EMU, Shard, TensorLayout, shard_view
from nereus.reshard.plan import merge_layouts, plan_transfers
from nereus.reshard.staged import StagedBox, record_from_boxes
from nereus.reshard.staged_load import StagedReader, load_staged, staged_transfers

from .checksum import CHECKSUM, blocks_of, checksums_of, region_span
from .dcp_io import BoxSavePlanner, BoxWriter, BoxWritten, dcp_save, is_private_root, plan_owned_boxes, tighten
from nereus.reshard.errors import TransferError

from .errors import CheckpointExistsError, ConflictError, CorruptCheckpointError, StoreError
from .kv import ABSENT, MetaStore, join_url, split_url
from .records import CHECKPOINT_PREFIX, AuxFile, FileEntry, Manifest, checkpoint_key, manifest_from_dict, manifest_to_dict, sealed
from .safetensors_io import map_file

DATA = "data"
HEAD = "head"
"""Key of the record an exclusive commit (``nereus convert``) writes: its compare-and-swap
makes two conversions into one root conflict even when their steps differ."""
ORPHAN_AGE_S = 3600.0
"""A data directory no manifest names is removed by the next save once it is this old."""
Buffers = Mapping[str, Mapping[str, torch.Tensor]]
"""Local buffers by model, then by buffer name (as ``layout.local_buffers`` names them)."""


def normalize_root(root: str) -> str:
    """A local root as an absolute path; URLs unchanged (no trailing slash)."""
    scheme, path = split_url(root)
    return os.path.abspath(path) if scheme == "file" else str(root).rstrip("/")


def qualify(emu: EMU) -> EMU:
    """The EMU with tensors and fused buffers renamed ``<model>/<name>`` (pure)."""
    def rename(s: Shard) -> Shard:
        return s if not s.buffer else Shard(rank=s.rank, offsets=s.offsets, lengths=s.lengths, buffer=f"{emu.model}/{s.buffer}", row=s.row)

    tensors = tuple(
        TensorLayout.trusted(name=f"{emu.model}/{t.name}", shape=t.shape, dtype=t.dtype, shards=tuple(rename(s) for s in t.shards))
        for t in emu.tensors
    )
    return EMU.trusted(model=emu.model, stage=emu.stage, replica=emu.replica, config=emu.config, ranks=emu.ranks, version=emu.version, tensors=tensors)


def flatten(buffers: Buffers) -> dict[str, torch.Tensor]:
    return {f"{model}/{name}": t for model, bufs in buffers.items() for name, t in bufs.items()}


def unflatten(flat: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        model, _, name = key.partition("/")
        out.setdefault(model, {})[name] = t
    return out


def checkpoint_layouts(emus: Sequence[EMU]) -> dict[str, TensorLayout]:
    """The qualified, merged layouts of a checkpoint's EMUs; one stage per model."""
    stages: dict[str, set[str]] = {}
    for e in emus:
        stages.setdefault(e.model, set()).add(e.stage)
    for model, s in stages.items():
        if len(s) > 1:
            raise StoreError(f"a checkpoint holds one stage per model; model {model!r} has stages {sorted(s)}")
    return merge_layouts([qualify(e) for e in emus], "checkpoint")


def rng_state() -> dict:
    """This process's RNG states (CPU, and every CUDA device when present), base64: a record
    (``nereus inspect`` counts them), which nothing restores. The trainer draws nothing from
    the global generators: each of its draws has a generator seeded by what it is about
    (trainer/seeds.py), so a resumed job draws what the uninterrupted one draws."""
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


class CheckpointStore:
    """The checkpoints of one root: listing, manifests, commit, retention, verification."""

    def __init__(self, root: str) -> None:
        self.root = normalize_root(root)
        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.root)
        except (ImportError, ValueError) as e:  # e.g. gs:// without gcsfs installed
            raise StoreError(f"cannot open checkpoint data at {self.root!r}: {e}") from None
        self.private = is_private_root(self.path) if isinstance(self.fs, LocalFileSystem) else False  # module docstring
        self._tight: set[str] = set()
        self.meta = MetaStore.open(self.root)

    def tighten_meta(self) -> None:
        """A private root's metadata files to 0600, its directories to 0700 (tensorstore's umask)."""
        if self.private:
            tighten(os.path.join(self.path, "meta"), self._tight)

    def steps(self) -> list[int]:
        """Committed checkpoint steps, ascending."""
        return [int(k[len(CHECKPOINT_PREFIX):]) for k in self.meta.keys(CHECKPOINT_PREFIX)]

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: the latest committed checkpoint)."""
        if step is None:
            steps = self.steps()
            if not steps:
                raise StoreError(f"{self.root}: no committed checkpoint")
            step = steps[-1]
        key = checkpoint_key(step)
        entry = self.meta.get(key)
        if entry is None:
            raise StoreError(f"{self.root}: no committed checkpoint at step {step} (have {self.steps()})")
        return manifest_from_dict(key, entry.value)

    def data_url(self, data_dir: str) -> str:
        return join_url(self.root, data_dir)

    def new_data_dir(self, step: int) -> str:
        """``data/<step, 12 digits>-<creation time, ms>-<token>``: the time lets a later save
        tell an abandoned directory from one a concurrent writer is still filling."""
        return f"{DATA}/{step:012d}-{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:8]}"

    def clean_orphans(self, older_than: float = ORPHAN_AGE_S) -> list[str]:
        """Remove data directories that no committed manifest names and that were created
        more than ``older_than`` seconds ago (a killed save's); returns what was removed.
        ``older_than=0`` when no other writer can be active (a job resuming its own root)."""
        base = f"{self.path.rstrip('/')}/{DATA}"
        try:
            present = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False)]
        except FileNotFoundError:
            return []
        named = {str(e.value.get("data", "")).rsplit("/", 1)[-1] for e in self.meta.items(CHECKPOINT_PREFIX)}
        now, removed = time.time(), []
        for name in sorted(set(present) - named):
            created = _created(name, self.fs, f"{base}/{name}")
            if created is not None and now - created >= older_than:
                self.remove_data(f"{DATA}/{name}")
                removed.append(f"{DATA}/{name}")
        return removed

    def snapshot(self) -> dict[str, bytes]:
        """The generation of every checkpoint key and of ``head`` now (an exclusive commit's
        expectations: whatever changes before it makes it fail)."""
        out = {e.key: e.generation for e in self.meta.items(CHECKPOINT_PREFIX)}
        out[HEAD] = self.meta.generation(HEAD)
        return out

    def commit_exclusive(self, manifest: Manifest, snapshot: Mapping[str, bytes]) -> None:
        """Make ``manifest`` the root's only checkpoint, in one transaction conditioned on
        ``snapshot``: if any checkpoint or another exclusive commit landed since, nothing is
        written and :class:`ConflictError` says so. Data of retired checkpoints is removed."""
        writes: dict = {manifest.key: manifest_to_dict(manifest), HEAD: {"schema": 1, "kind": "head", "step": manifest.step,
                                                                       "data": manifest.data}}
        expect = {HEAD: snapshot.get(HEAD, ABSENT), manifest.key: snapshot.get(manifest.key, ABSENT)}
        retired = []
        for key, generation in snapshot.items():
            if key not in (HEAD, manifest.key):
                writes[key], expect[key] = None, generation
        for e in self.meta.items(CHECKPOINT_PREFIX):
            if e.key in snapshot:
                retired.append(e.value.get("data"))
        try:
            self.meta.commit(writes, expect=expect)
        except ConflictError:
            raise ConflictError(f"{self.root}: another writer committed a checkpoint here while this one was written; "
                                "nothing of this conversion was committed") from None
        self.tighten_meta()
        for data_dir in retired:
            if data_dir and data_dir != manifest.data:
                self.remove_data(data_dir)

    def remove_data(self, data_dir: str) -> None:
        path = f"{self.path.rstrip('/')}/{data_dir}"
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def check_absent(self, step: int, *, overwrite: bool) -> None:
        if not overwrite and self.meta.get(checkpoint_key(step)) is not None:
            raise CheckpointExistsError(f"{self.root} already holds a committed checkpoint at step {step}; pass overwrite to replace it")

    def commit(self, manifest: Manifest, *, overwrite: bool = False, only: bool = False) -> None:
        """Make ``manifest`` visible (create-only unless ``overwrite``), atomically.

        ``only``: also retire every other checkpoint in the same transaction (the root then
        holds just this one). Data of replaced checkpoints is removed after the commit.
        """
        key = manifest.key
        entry = self.meta.get(key)
        if entry is not None and not overwrite:
            raise ConflictError(f"{self.root}: checkpoint step {manifest.step} was committed by another writer first")
        expect = {key: entry.generation if entry is not None else ABSENT}
        writes: dict = {key: manifest_to_dict(manifest)}
        retired = [entry.value.get("data")] if entry is not None else []
        if only:
            for other in self.meta.items(CHECKPOINT_PREFIX):
                if other.key != key:
                    writes[other.key], expect[other.key] = None, other.generation
                    retired.append(other.value.get("data"))
        self.meta.commit(writes, expect=expect)
        self.tighten_meta()
        for data_dir in retired:
            if data_dir and data_dir != manifest.data:
                self.remove_data(data_dir)

    def retain(self, keep: int) -> list[int]:
        """Delete all but the last ``keep`` committed checkpoints (manifest first, then data)."""
        if keep < 1:
            raise StoreError(f"retention must keep at least 1 checkpoint, got {keep}")
        return [step for step in self.steps()[:-keep] if self.delete(step)]

    def delete(self, step: int) -> bool:
        """Retire the checkpoint of ``step`` (manifest first, then data); False when it is not
        committed or another writer retired or replaced it meanwhile."""
        entry = self.meta.get(checkpoint_key(step))
        if entry is None:
            return False
        try:
            self.meta.put(entry.key, None, expect=entry.generation)
        except ConflictError:
            return False
        self.tighten_meta()
        self.remove_data(entry.value["data"])
        return True

    def check_files(self, manifest: Manifest, entries: Iterable[FileEntry]) -> None:
        """Raise :class:`CorruptCheckpointError` naming the first file missing or of the wrong size."""
        base = f"{self.path.rstrip('/')}/{manifest.data}"
        for e in entries:
            path = f"{base}/{e.path}"
            try:
                size = self.fs.size(path)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{_where(manifest, e, path)} is missing") from None
            if size != e.nbytes:
                raise CorruptCheckpointError(f"{_where(manifest, e, path)} has {size} bytes, the manifest says {e.nbytes}: truncated")

    def verify(self, manifest: Manifest, blocks: Mapping[FileEntry | AuxFile, Iterable[int]] | None = None) -> None:
        """Raise :class:`CorruptCheckpointError` naming the first file missing, truncated or
        with a block whose checksum differs from the manifest's. ``blocks``: the blocks to
        check per file (default: every block of every file, side files and
        ``metadata.json`` included); only those bytes are read."""
        if blocks is None:
            blocks = {e: range(len(e.checksums)) for e in (*manifest.files, *manifest.aux)}
        self.check_files(manifest, blocks)
        base = f"{self.path.rstrip('/')}/{manifest.data}"
        size = manifest.checksum_block
        local = isinstance(self.fs, LocalFileSystem)
        for e, indices in blocks.items():
            path = f"{base}/{e.path}"
            for i in sorted(set(indices)):
                start, end = i * size, min((i + 1) * size, e.nbytes)
                data = map_file(path, start, end - start).numpy() if local else self.fs.cat_file(path, start=start, end=end)
                _check_blocks(manifest, e, path, i, data)

    def read_file(self, manifest: Manifest, entry: FileEntry | AuxFile) -> bytes:
        """A whole file of the checkpoint (a side file), read once and verified on those
        bytes against the manifest; CorruptCheckpointError naming it otherwise."""
        self.check_files(manifest, [entry])
        path = f"{self.path.rstrip('/')}/{manifest.data}/{entry.path}"
        data = self.fs.cat_file(path)
        _check_blocks(manifest, entry, path, 0, data)
        return data


def _check_blocks(manifest: Manifest, e: FileEntry | AuxFile, path: str, first: int, data) -> None:
    """Raise CorruptCheckpointError unless ``data`` (the file's bytes from block ``first`` on)
    matches the manifest's checksum of each block it holds."""
    size = manifest.checksum_block
    for k, got in enumerate(checksums_of(manifest.checksum, data, size)):
        i = first + k
        if got != e.checksums[i]:
            start = i * size
            raise CorruptCheckpointError(
                f"{_where(manifest, e, path)} has {manifest.checksum} {got} in bytes [{start}, {min(start + size, e.nbytes)}), "
                f"the manifest says {e.checksums[i]}: corrupted"
            )


def _where(manifest: Manifest, e: FileEntry | AuxFile, path: str) -> str:
    if isinstance(e, AuxFile):
        return f"checkpoint step {manifest.step}: file {path}"
    return f"checkpoint step {manifest.step}: data file {path} (tensor {e.tensor!r}, box at {list(e.offsets)})"


def _created(name: str, fs, path: str) -> float | None:
    """When a data directory was created: from its name, else the filesystem (None: unknown)."""
    parts = name.split("-")
    if len(parts) == 3 and parts[1].isdigit():
        return int(parts[1]) / 1000
    try:
        return fs.modified(path).timestamp()
    except (NotImplementedError, FileNotFoundError, AttributeError, OSError):
        return None


def reader_for(store: CheckpointStore, manifest: Manifest) -> StagedReader:
    """A staged reader of a checkpoint's data built from its manifest (no ``metadata.json``
    read): every box with its path and its CRC32C block checksums, verified on read."""
    base = store.data_url(manifest.data)
    _, root = fsspec.core.url_to_fs(base)
    shapes = {}
    for e in manifest.emus:
        for t in qualify(e).tensors:
            shapes[t.name] = (t.shape, t.dtype)
    crc = manifest.checksum == CHECKSUM
    boxes = [StagedBox(tensor=f.tensor, offsets=f.offsets, lengths=f.lengths, dtype=f.dtype, path=f"{root}/{f.path}",
                       checksums=f.checksums if crc else None, block=manifest.checksum_block) for f in manifest.files]
    return StagedReader(base, record=record_from_boxes(boxes, shapes), verify=crc)


def needed_blocks(manifest: Manifest, transfers: Sequence) -> dict[FileEntry, set[int]]:
    """The checksum blocks of each file that the staged ``transfers`` read (see ``store.checksum``)."""
    by_box = {(f.tensor, f.offsets): f for f in manifest.files}
    out: dict[FileEntry, set[int]] = {}
    for t in transfers:
        key = (t.item.storage_index.fqn, tuple(t.item.storage_index.offset))
        entry = by_box.get(key)
        if entry is None:
            raise CorruptCheckpointError(
                f"checkpoint step {manifest.step}: the manifest lists no file for tensor {key[0]!r} box at {list(key[1])}"
            )
        start, end = region_span(entry.lengths, DTYPES[entry.dtype].itemsize, t.item.storage_offsets, t.item.lengths)
        out.setdefault(entry, set()).update(blocks_of(start, end, manifest.checksum_block))
    return out


def build_manifest(step: int, data_dir: str, emus: Sequence[EMU], layouts: Mapping[str, TensorLayout], results, *, state=None, plan=None, rng=(),
                   aux: Sequence[AuxFile] = ()) -> Manifest:
    """The manifest of a finished save from every rank's write results (pure)."""
    files = []
    for rank_results in results:
        for r in rank_results:
            info: BoxWritten = r.storage_data
            layout = layouts[r.index.fqn]
            offsets = tuple(r.index.offset)
            lengths = next(l for o, l in layout.unique_boxes() if tuple(o) == offsets)
            files.append(FileEntry(tensor=layout.name, offsets=offsets, lengths=tuple(lengths), dtype=layout.dtype,
                                   path=info.path, nbytes=r.size_in_bytes, checksums=tuple(info.checksums)))
    files.sort(key=lambda f: (f.tensor, f.offsets))
    return Manifest(step=step, data=data_dir, files=tuple(files), emus=tuple(emus), created=time.time(),
                    plan=plan, state=dict(state or {}), rng=tuple(rng), aux=tuple(aux))


def save_checkpoint(
    root: str,
    step: int,
    emus: Sequence[EMU],
    buffers: Buffers,
    *,
    rank: int | None = None,
    group=None,
    state: Mapping | None = None,
    plan: Mapping | None = None,
    keep: int | None = None,
    overwrite: bool = False,
    sync: bool = True,
    rng: dict | None = None,
    files: Mapping[str, bytes] | None = None,
    orphan_age: float = ORPHAN_AGE_S,
    among: Sequence[int] | None = None,
    seal: str | None = None,
) -> Manifest:
    """Save every EMU's tensors from every rank (call on all ranks of ``group``).

    ``buffers``: this rank's local buffers by model. ``state``: JSON-able job state (data
    position, controller, ...; the coordinator's is kept). ``keep``: retention. ``rank``:
    this process's global rank (default: the process group's). ``files``: side files the
    coordinator writes into the data directory (relative path -> bytes, e.g.
    ``hf/actor/tokenizer.json``), covered by the manifest's checksums. ``orphan_age``:
    unfinished saves older than this are removed first (:meth:`CheckpointStore.clean_orphans`).
    ``among``: the global ranks of ``group`` when it is a part of the world (one node's): the
    save holds every box one of them holds and no other (a node's staged copy); default the
    whole world. ``seal``: the key it is sealed under. Returns the committed manifest on every rank.
    """
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    store = CheckpointStore(root)
    layouts = checkpoint_layouts(emus)
    flat = flatten(buffers)
    mine: dict[tuple, tuple[TensorLayout, Shard]] = {}
    for name, layout in layouts.items():
        for s in layout.shards:
            if s.rank == rank:
                mine.setdefault((name, s.offsets), (layout, s))

    def resolve(name, offsets, lengths):
        layout, shard = mine[name, tuple(offsets)]
        try:
            return shard_view(flat, layout, shard)
        except KeyError:
            raise StoreError(f"rank {rank} holds tensor {name!r} box at {list(offsets)} but was given no buffer {shard.buffer or name!r}") from None

    def prepare() -> str:
        store.check_absent(step, overwrite=overwrite)
        store.clean_orphans(orphan_age)
        return store.new_data_dir(step)

    committed: list[Manifest] = []

    def commit(data_dir, metadata, results, aux):
        manifest = build_manifest(step, data_dir, emus, layouts, results, state=state, plan=dict(plan) if plan else None,
                                  rng=metadata.planner_data or (), aux=aux)
        manifest = sealed(manifest, seal) if seal is not None else manifest
        try:
            store.commit(manifest, overwrite=overwrite)
        except Exception:
            store.remove_data(data_dir)
            raise
        committed.append(manifest)
        if keep is not None:
            store.retain(keep)

    among = None if among is None else frozenset(among)
    planner = BoxSavePlanner(layouts, plan_owned_boxes(layouts, rank, among), resolve, rng if rng is not None else rng_state(),
                             among=among)
    writer = BoxWriter(store.root, layouts, prepare, commit, sync=sync, extras=files, private=store.private)
    no_dist = group is None and not (dist.is_available() and dist.is_initialized())
    dcp_save(planner, writer, group=group, no_dist=no_dist)
    return committed[0] if committed else store.manifest(step)


def load_checkpoint(
    root: str,
    targets: Sequence[EMU],
    rank: int,
    buffers: MutableMapping[str, MutableMapping[str, torch.Tensor]] | None = None,
    *,
    step: int | None = None,
    verify: bool = True,
) -> tuple[Manifest, dict[str, dict[str, torch.Tensor]]]:
    """Load ``rank``'s buffers of the ``targets`` layouts from a committed checkpoint.

    Reads only the checksum blocks covering the regions this rank needs, once, verifying
    each on the bytes read (``verify``). ``buffers`` (by model) are filled in place;
    missing ones are allocated. No collective: ranks may load at different times. A
    damaged file raises CorruptCheckpointError naming it; the buffers then hold a partial
    load and must not be used.
    """
    store = CheckpointStore(root)
    manifest = store.manifest(step)
    src = [qualify(e) for e in manifest.emus]
    dst = [qualify(e) for e in targets]
    plan = plan_transfers(src, dst, live=set(), staged=True, ranks={rank})
    transfers = staged_transfers(plan, rank)
    blocks = needed_blocks(manifest, transfers)
    store.check_files(manifest, blocks)  # present and whole: sizes only, no byte read
    reader = reader_for(store, manifest)
    if verify and manifest.checksum != CHECKSUM:  # a legacy (wsum64) checkpoint: its own pass first
        store.verify(manifest, blocks)
    reader.verify = verify and manifest.checksum == CHECKSUM  # CRC32C: checked on the bytes the load reads
    flat = flatten(buffers or {})
    try:
        load_staged(store.data_url(manifest.data), plan, rank, flat, transfers=transfers, verified=True, reader=reader)
    except TransferError as e:
        raise CorruptCheckpointError(f"checkpoint step {manifest.step}: {e}") from None
    out = unflatten(flat)
    if buffers is not None:
        for model, bufs in out.items():
            buffers.setdefault(model, {}).update(bufs)
    return manifest, out
