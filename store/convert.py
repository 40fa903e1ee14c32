"""Offline conversion between HF safetensors and Nereus checkpoints in any layout.

No process group: one process plans, reads and writes, tensor by tensor. Memory stays at
one input tensor plus the piece being written (a box, or the tensor cast to the output
dtype): about twice the largest tensor, whatever the model size.

- HF -> Nereus (``--to "tp=2,pp=2"``): the target EMUs are derived from ``config.json``
  (``derive_emus``, which rejects a tp that does not divide the heads or a pp above the
  layer count before any byte moves); the checkpoint is written through the same DCP
  writer as a training save (``dcp_io``), every box by this one process, and committed
  with its manifest last. ``config.json`` travels in the manifest (``state.hf_configs``),
  the HF side files (``hf.SIDE_FILES``: generation config, tokenizer) in the data
  directory as ``hf/<model>/<name>``, checksummed by the manifest.
- Nereus -> Nereus: each tensor is read whole from the source through the staged reader
  (``plan_transfers(saved EMUs -> one rank holding whole tensors, staged=True)``), every
  checksum block verified on the bytes read; optimizer state (in its saved dtype), job
  state, RNG states and side files are carried over. A checkpoint of several models (what
  ``nereus train`` saves: actor and critic) converts one of them, ``model=``.
- Nereus / HF -> HF (``--to hf``): tensors in ``plan_parameters`` order, streamed into
  ``model.safetensors`` or shards + index, in a temporary directory renamed at the end;
  ``config.json`` states one dtype (``torch_dtype`` and ``dtype`` alike: the weights'),
  side files are written beside it.

On any error the destination keeps what it had: no manifest is committed (the new data
directory is removed, and a root this conversion created is removed whole) and no HF
directory is renamed into place. The destination check and the commit are one
compare-and-swap (``CheckpointStore.commit_exclusive``): of two conversions into one
destination, one commits and the other fails, removing its data.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

from nereus.reshard.derive import DecoderSpec, derive_emus, plan_parameters
from nereus.reshard.layout import DTYPES, EMU, ParallelConfig, Shard, TensorLayout, box_view, dtype_name
from nereus.reshard.plan import plan_transfers
from nereus.reshard.staged_load import StagedLoadPlanner

from nereus.reshard.errors import TransferError

from .checkpoint import CheckpointStore, build_manifest, checkpoint_layouts, normalize_root, qualify, reader_for
from .checksum import CHECKSUM, checksums_of
from .dcp_io import BoxSavePlanner, BoxWriter, Scratch, all_boxes, dcp_save, unwrap
from .errors import CheckpointExistsError, CorruptCheckpointError, ModelMismatchError, StoreError
from .hf import HFCheckpoint, HFWriter, check_against_spec, is_hf_dir, side_files, spec_from_hf_config
from .records import Manifest
from .safetensors_io import Interleaved, map_file

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
MODEL = "actor"
STAGE = "train"
Progress = Callable[[int], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """Where a conversion goes: ``hf``, or a Nereus layout (dp, tp, pp)."""

    hf: bool = False
    dp: int = 1
    tp: int = 1
    pp: int = 1


def parse_target(text: str) -> Target:
    """``"hf"`` or ``"tp=2,pp=2"`` (keys dp, tp, pp; those not named are 1) (pure)."""
    text = text.strip()
    if text.lower() == "hf":
        return Target(hf=True)
    degrees: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq or key not in ("dp", "tp", "pp"):
            raise StoreError(f"--to {text!r}: expected 'hf' or degrees like 'tp=2,pp=2' (keys dp, tp, pp), got {part!r}")
        try:
            degrees[key] = int(value)
        except ValueError:
            raise StoreError(f"--to {text!r}: {key}={value!r} is not an integer") from None
        if degrees[key] < 1:
            raise StoreError(f"--to {text!r}: {key} must be >= 1")
    if not degrees:
        raise StoreError(f"--to {text!r}: name a layout ('tp=2,pp=2') or 'hf'")
    return Target(**degrees)


def parse_dtype(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        return DTYPE_ALIASES[text.lower()]
    except KeyError:
        raise StoreError(f"--dtype {text!r}: expected bf16, fp16 or fp32") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    """What a conversion did: tensors written, bytes written, wall seconds."""

    source: str
    destination: str
    tensors: int
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


# ------------------------------------------------------------------------------ sources


class HFSource:
    """Tensors of an HF directory, read whole and one at a time."""

    kind = "hf"

    def __init__(self, path: str) -> None:
        self.ckpt = HFCheckpoint.open(path)
        self.spec = self.ckpt.spec()
        check_against_spec(self.ckpt, self.spec)
        embed = self.ckpt.tensors["model.embed_tokens.weight"]
        self.spec = replace(self.spec, dtype=embed.dtype)  # the weights' dtype, whatever config.json says
        self.config = self.ckpt.config
        self.step, self.state, self.rng, self.optimizer = 0, {}, (), False
        self.model = MODEL

    def side_files(self) -> dict[str, bytes]:
        return side_files(self.ckpt.path)

    def names(self) -> list[str]:
        return [name for name, *_ in plan_parameters(self.spec)]

    def shape(self, name: str) -> tuple[torch.Size, torch.dtype]:
        info = self.ckpt.tensors[name]
        return torch.Size(info.shape), DTYPES[info.dtype]

    def read(self, name: str, scratch: Scratch | None = None) -> torch.Tensor:
        """The whole tensor as a view of a memory map of its file (no ``scratch`` needed: the
        bytes go from the page cache to the writer with no copy; the file's header was
        checked against its size when the directory was opened)."""
        return self.ckpt.mapped(name)


class NereusSource:
    """Tensors of a committed Nereus checkpoint (one model), read whole through the staged reader."""

    kind = "nereus"

    def __init__(self, root: str, step: int | None = None, model: str | None = None) -> None:
        self.store = CheckpointStore(root)
        self.manifest: Manifest = self.store.manifest(step)
        models = sorted({e.model for e in self.manifest.emus})
        if model is None and len(models) != 1:
            raise StoreError(f"{root}: checkpoint step {self.manifest.step} holds models {models}; choose one with --model")
        if model is not None and model not in models:
            raise StoreError(f"{root}: checkpoint step {self.manifest.step} has no model {model!r} (it holds {models})")
        self.model = model or models[0]
        emus = [e for e in self.manifest.emus if e.model == self.model]
        src = [qualify(e) for e in emus]
        layouts = checkpoint_layouts(emus)
        self.names_all = [n.partition("/")[2] for n in layouts]
        self.config = dict((self.manifest.state.get("hf_configs") or {}).get(self.model) or {})
        embed = layouts.get(f"{self.model}/model.embed_tokens.weight")
        if not self.config:
            raise StoreError(f"{root}: checkpoint step {self.manifest.step} carries no model config (state.hf_configs.{self.model})")
        self.spec = spec_from_hf_config(self.config, dtype=embed.dtype if embed else None)
        self.optimizer = any(n.startswith("optim/") for n in self.names_all)
        self.step, self.state, self.rng = self.manifest.step, dict(self.manifest.state), self.manifest.rng
        whole = tuple(
            TensorLayout.trusted(name=n, shape=t.shape, dtype=t.dtype, shards=(Shard(rank=0, offsets=(0,) * len(t.shape), lengths=t.shape),))
            for n, t in layouts.items()
        )
        target = EMU.trusted(model="convert", stage="whole", replica=0, config=ParallelConfig.on(), ranks=(0,), tensors=whole)
        self.plan = plan_transfers(src, [target], live=set(), staged=True)
        self.by_tensor: dict[str, list] = {}
        for t in self.plan.transfers:
            self.by_tensor.setdefault(t.tensor, []).append(t)
        self.files = {(f.tensor, f.offsets): f for f in self.manifest.files}
        self.data_url = self.store.data_url(self.manifest.data)
        self._reader = reader_for(self.store, self.manifest)
        self._legacy = self.manifest.checksum != CHECKSUM

    def side_files(self) -> dict[str, bytes]:
        """The model's HF side files kept in the checkpoint (``hf/<model>/<name>``), verified."""
        prefix = f"hf/{self.model}/"
        entries = [a for a in self.manifest.aux if a.path.startswith(prefix)]
        return {a.path[len(prefix):]: self.store.read_file(self.manifest, a) for a in entries}  # each read once

    def names(self) -> list[str]:
        return self.names_all

    def shape(self, name: str) -> tuple[torch.Size, torch.dtype]:
        layout = self.plan.layouts[f"{self.model}/{name}"]
        return torch.Size(layout.shape), DTYPES[layout.dtype]

    def read(self, name: str, scratch: Scratch | None = None) -> torch.Tensor:
        """The whole tensor, loaded through the staged reader into ``scratch`` (or a new
        tensor) after every file it comes from was checked: present, whole, block checksums
        as committed."""
        key = f"{self.model}/{name}"
        entries = self._entries(name)
        self.store.check_files(self.manifest, entries)
        if self._legacy:  # wsum64: verified in its own pass; CRC32C: on the bytes the load reads
            self.store.verify(self.manifest, {e: range(len(e.checksums)) for e in entries})
        layout = self.plan.layouts[key]
        shape, dtype = torch.Size(layout.shape), DTYPES[layout.dtype]
        target = torch.empty(shape, dtype=dtype) if scratch is None else scratch.take(shape, dtype)
        self._load(self.by_tensor.get(key, []), {key: target})
        return target

    def runs(self, name: str) -> Interleaved | None:
        """The tensor's bytes as zero-copy runs of its box files (``Interleaved``) — when its
        saved boxes cut it along one dimension only (each box whole in every other dimension;
        dim-0 slabs, or column blocks of row-parallel weights) — after checking the files;
        None otherwise.

        A shortcut for streaming out whole tensors: each box file (located by the staged
        reader) is memory-mapped once (``map_file``), its checksums computed on that map, and
        the writer ``writev``s from it, so bytes go from the page cache to the output with no
        copy in this process; other tensors are loaded by :meth:`read`.
        """
        key = f"{self.model}/{name}"
        layout = self.plan.layouts[key]
        shape = tuple(layout.shape)
        entries = self._entries(name)
        if not shape or not math.prod(shape) or not isinstance(self._reader.fs, LocalFileSystem):
            return None  # 0-d and empty tensors: nothing to gain
        cut = [d for d in range(len(shape)) if any(e.lengths[d] != shape[d] for e in entries)] or [0]
        if len(cut) > 1:
            return None
        k = cut[0]
        entries = sorted(entries, key=lambda e: e.offsets[k])
        at = 0
        for e in entries:
            if e.offsets[k] != at:  # a gap or an overlap (replicas are saved once)
                return None
            at += e.lengths[k]
        if at != shape[k]:
            return None
        self.store.check_files(self.manifest, entries)
        self._reader.read_metadata()
        parts = []
        for e in entries:
            path = self._reader.boxes[MetadataIndex(key, torch.Size(e.offsets))].path
            raw = map_file(path, 0, e.nbytes)
            if checksums_of(self.manifest.checksum, raw.numpy(), self.manifest.checksum_block) != e.checksums:
                self.store.verify(self.manifest, {e: range(len(e.checksums))})  # names the bad block
            parts.append(raw)
        rows = math.prod(shape[:k])
        return Interleaved(tuple(parts), tuple(p.numel() // rows for p in parts), rows, DTYPES[layout.dtype])

    def _load(self, transfers: list, out: dict[str, torch.Tensor]) -> None:
        """``load_staged`` for a few transfers, with ONE ``StagedReader`` kept for every call:
        ``load_staged`` builds a reader per call, which re-parses ``metadata.json`` (every
        tensor's boxes) each time, quadratic over a model's tensors."""
        planner = StagedLoadPlanner(transfers, out)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.load({}, storage_reader=self._reader, planner=planner, no_dist=True)
            except CheckpointException as e:
                cause = unwrap(e)
                if isinstance(cause, TransferError):  # a block that fails its CRC32C
                    raise CorruptCheckpointError(f"checkpoint step {self.step}: {cause}") from None
                raise cause from None

    def _entries(self, name: str) -> list:
        key = f"{self.model}/{name}"
        needed = sorted({(t.item.storage_index.fqn, tuple(t.item.storage_index.offset)) for t in self.by_tensor.get(key, [])})
        missing = [k for k in needed if k not in self.files]
        if missing:
            raise StoreError(f"checkpoint step {self.step}: no file for tensor {missing[0][0]!r} box at {list(missing[0][1])}")
        return [self.files[k] for k in needed]

def open_source(path: str, model: str | None = None):
    if os.path.isdir(path) and is_hf_dir(path):
        if model not in (None, MODEL):
            raise StoreError(f"{path} is a HuggingFace model directory: it holds one model, --model does not apply")
        return HFSource(path)
    root = normalize_root(path)
    if "://" not in root and not os.path.isdir(os.path.join(root, "meta")):
        if not os.path.exists(root):
            raise StoreError(f"{path} does not exist")
        raise StoreError(f"{path} is neither a HuggingFace model directory (model.safetensors[.index.json]) nor a Nereus checkpoint (meta/)")
    return NereusSource(root, model=model)


# ------------------------------------------------------------------------------ writing


def _cast(t: torch.Tensor, dtype: str) -> torch.Tensor:
    return t if t.dtype == DTYPES[dtype] else t.to(DTYPES[dtype])


class Prefetcher:
    """Reads tensors in a known order, the next one on a helper thread while the caller
    writes the current one: two input buffers, used in turn, so memory stays at the
    tensor being written plus the one being read. ``get(name)`` must follow the order;
    the tensor it returns is valid until the next ``get``. Reads run ``source.read`` with
    verification, so a tensor is checked before the caller sees it.
    """

    def __init__(self, source, names: list[str], dtypes: Mapping[str, str], *, runs: bool = False) -> None:
        self.source, self.names, self.dtypes = source, names, dtypes
        self.runs = runs and hasattr(source, "runs")
        self.scratch = [Scratch(), Scratch()]
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nereus-read")
        self.pending: dict[int, object] = {}
        self.next = 0
        self._submit(0)

    def _read(self, i: int) -> torch.Tensor | Interleaved:
        name = self.names[i]
        if self.runs and dtype_name(self.source.shape(name)[1]) == self.dtypes[name]:
            runs = self.source.runs(name)
            if runs is not None:
                return runs
        loaded = self.source.read(name, self.scratch[i % 2])
        return _cast(loaded, self.dtypes[name])

    def _submit(self, i: int) -> None:
        if i < len(self.names):
            self.pending[i] = self.pool.submit(self._read, i)

    def get(self, name: str) -> torch.Tensor:
        i = self.next
        if i >= len(self.names) or self.names[i] != name:
            raise StoreError(f"internal: tensor {name!r} requested out of order (expected {self.names[i:i + 1]})")
        tensor = self.pending.pop(i).result()
        self.next = i + 1
        self._submit(i + 1)  # into the other buffer: the one of tensor i - 1, now written
        return tensor

    def close(self) -> None:
        for f in self.pending.values():
            f.cancel()
        self.pool.shutdown(wait=True)


def convert_to_hf(source, dst: str, *, dtype: str | None, overwrite: bool, progress: Progress | None,
                  max_shard_bytes: int = 5_000_000_000, sync: bool = True, on_total: Progress | None = None) -> tuple[int, int]:
    """Stream the source's parameters into an HF directory; returns (tensors, bytes)."""
    spec = replace(source.spec, dtype=dtype) if dtype else source.spec
    # --dtype casts every tensor; without it each keeps its own dtype (mixed checkpoints stay mixed)
    entries = [(name, dtype or dtype_name(source.shape(name)[1]), tuple(shape)) for name, shape, _, _ in plan_parameters(spec)]
    if on_total:
        on_total(sum(math.prod(s) * DTYPES[d].itemsize for _, d, s in entries))
    config = one_dtype(dict(source.config or spec.to_hf_config()), spec.dtype)
    writer = HFWriter(dst, entries, config, overwrite=overwrite, max_shard_bytes=max_shard_bytes, sync=sync,
                      side_files=source.side_files())
    total = 0
    reader = Prefetcher(source, [e[0] for e in entries], {e[0]: e[1] for e in entries}, runs=True)
    try:
        for name, _, _ in entries:
            tensor = reader.get(name)  # a tensor, or Interleaved runs straight from the box files
            writer.write(name, tensor)
            nbytes = tensor.nbytes
            total += nbytes
            if progress:
                progress(nbytes)
            del tensor
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        reader.close()
    return len(entries), total


def one_dtype(config: dict, dtype: str) -> dict:
    """``config`` stating ``dtype`` once: ``torch_dtype`` and ``dtype`` (transformers' newer
    key, which wins where both are present) alike, so ``from_pretrained(dtype="auto")``
    loads the weights in the dtype they were written in."""
    config["torch_dtype"] = config["dtype"] = dtype
    return config


def target_emus(spec: DecoderSpec, target: Target, *, optimizer: bool, model: str = MODEL) -> list[EMU]:
    try:
        return derive_emus(spec, ParallelConfig.on(dp=target.dp, tp=target.tp, pp=target.pp), model=model, stage=STAGE, optimizer=optimizer)
    except ValueError as e:
        raise ModelMismatchError(f"layout dp={target.dp},tp={target.tp},pp={target.pp} does not fit the model: {e}") from None


def retype(emu: EMU, dtype_of: Callable[[str], str]) -> EMU:
    """The EMU with each tensor's dtype replaced by ``dtype_of(name)`` (pure)."""
    tensors = tuple(TensorLayout.trusted(name=t.name, shape=t.shape, dtype=dtype_of(t.name), shards=t.shards) for t in emu.tensors)
    return EMU.trusted(model=emu.model, stage=emu.stage, replica=emu.replica, config=emu.config, ranks=emu.ranks,
                       version=emu.version, tensors=tensors)


def convert_to_nereus(source, dst: str, target: Target, *, dtype: str | None, overwrite: bool,
                      progress: Progress | None, sync: bool = True, on_total: Progress | None = None) -> tuple[int, int]:
    """Write the source as a Nereus checkpoint in ``target``'s layout; returns (tensors, bytes)."""
    spec = replace(source.spec, dtype=dtype) if dtype else source.spec
    names = set(source.names())
    model = source.model
    for emu in target_emus(spec, target, optimizer=source.optimizer, model=model):
        for t in emu.tensors:
            if t.name not in names:
                raise ModelMismatchError(f"tensor {t.name!r} of the target layout is not in the source")

    def dtype_of(name: str) -> str:  # --dtype casts parameters; everything else keeps its saved dtype
        return dtype if dtype and not name.startswith("optim/") else dtype_name(source.shape(name)[1])

    emus = [retype(e, dtype_of) for e in target_emus(spec, target, optimizer=source.optimizer, model=model)]
    layouts = checkpoint_layouts(emus)
    if os.path.isdir(dst) and is_hf_dir(dst) and not overwrite:
        raise CheckpointExistsError(f"{dst} holds a HuggingFace model; pass --overwrite to write a checkpoint there")
    created = _absent(dst)
    try:
        store = CheckpointStore(dst)
        snapshot = store.snapshot()  # the destination as checked: the commit expects exactly this
        steps = store.steps()
        if steps and not overwrite:
            raise CheckpointExistsError(f"{dst} already holds checkpoints at steps {steps}; pass --overwrite to replace them")
        if on_total:
            on_total(layouts_nbytes(layouts))
        config = one_dtype(dict(source.config), spec.dtype)
        state = {**source.state, "hf_configs": {model: config}}
        extras = {f"hf/{model}/{name}": data for name, data in source.side_files().items()}
        boxes = all_boxes(layouts)
        order = list(dict.fromkeys(name.partition("/")[2] for name, _, _ in boxes))
        reader = Prefetcher(source, order, {n.partition("/")[2]: t.dtype for n, t in layouts.items()})
    except BaseException:
        if created:
            _remove_root(dst)
        raise
    current: dict[str, torch.Tensor] = {}

    def resolve(name: str, offsets, lengths) -> torch.Tensor:
        if name not in current:  # boxes arrive grouped by tensor, in ``order``
            current.clear()
            current[name] = reader.get(name.partition("/")[2])
        return box_view(current[name], tuple(offsets), tuple(lengths))

    data_dirs: list[str] = []
    committed: list[bool] = []

    def prepare() -> str:
        data_dirs.append(store.new_data_dir(source.step))
        return data_dirs[-1]

    def commit(data_dir, metadata, results, aux):
        manifest = build_manifest(source.step, data_dir, emus, layouts, results, state=state, rng=source.rng, aux=aux)
        store.commit_exclusive(manifest, snapshot)
        committed.append(True)

    planner = BoxSavePlanner(layouts, boxes, resolve, None)
    writer = BoxWriter(store.root, layouts, prepare, commit, sync=sync, progress=progress, extras=extras)
    try:
        dcp_save(planner, writer, no_dist=True)
    except BaseException:
        if not committed:
            for d in data_dirs:
                store.remove_data(d)
            _remove_if_empty(store, "data")
            if created and not store.steps() and not os.path.exists(os.path.join(normalize_root(dst), "data")):
                _remove_root(dst)  # nothing of anyone's is there: leave no trace of this attempt
        raise
    finally:
        reader.close()
    return len(layouts), layouts_nbytes(layouts)


def _absent(dst: str) -> bool:
    """Whether a destination does not exist yet (a local path; URLs: no committed store)."""
    if "://" not in dst or dst.startswith("file://"):
        return not os.path.exists(normalize_root(dst))
    return False


def _remove_root(dst: str) -> None:
    """Remove a destination this conversion created, once it holds nothing but an empty
    metadata store (no checkpoint, no data: a concurrent writer's data would be in data/)."""
    import shutil

    root = normalize_root(dst)
    if ("://" in dst and not dst.startswith("file://")) or not os.path.isdir(root):
        return
    if set(os.listdir(root)) <= {"meta"}:
        shutil.rmtree(root, ignore_errors=True)


def _remove_if_empty(store: CheckpointStore, sub: str) -> None:
    path = f"{store.path.rstrip('/')}/{sub}"
    try:
        if store.fs.exists(path) and not store.fs.ls(path, detail=False):
            store.fs.rmdir(path)
    except (OSError, NotImplementedError):
        pass


def layouts_nbytes(layouts: Mapping[str, TensorLayout]) -> int:
    return sum(math.prod(t.shape) * DTYPES[t.dtype].itemsize for t in layouts.values())


def convert(src: str, dst: str, *, to: str, dtype: str | None = None, overwrite: bool = False,
            progress: Progress | None = None, on_total: Progress | None = None, sync: bool = True,
            max_shard_bytes: int = 5_000_000_000, model: str | None = None) -> Summary:
    """Convert ``src`` (HF directory or Nereus checkpoint, detected) to ``dst`` (see module doc).

    ``model``: which model of a checkpoint that holds several (``nereus train``'s actor and
    critic); needed then, refused for an HF source (it holds one).
    ``on_total(bytes)`` is called once the output size is known, ``progress(bytes)`` as
    pieces are written. ``sync``: fsync data before the commit (off only for benchmarks
    that compare against a copy that does not sync).
    """
    target = parse_target(to)
    out_dtype = parse_dtype(dtype)
    if "://" not in src + dst and os.path.abspath(src) == os.path.abspath(dst):
        raise StoreError(f"source and destination are the same path: {src}")
    start = time.perf_counter()
    source = open_source(src, model)
    kwargs = dict(dtype=out_dtype, overwrite=overwrite, progress=progress, sync=sync, on_total=on_total)
    if target.hf:
        tensors, nbytes = convert_to_hf(source, dst, max_shard_bytes=max_shard_bytes, **kwargs)
    else:
        tensors, nbytes = convert_to_nereus(source, dst, target, **kwargs)
    return Summary(source=source.kind, destination=to, tensors=tensors, nbytes=nbytes, seconds=time.perf_counter() - start)


__all__ = ["convert", "parse_target", "parse_dtype", "Summary", "Target", "open_source"]
