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

Loading: ``reshard/staged_load.py``.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Sequence
from urllib.parse import quote

import fsspec
import numpy as np
import torch

from .checksum import BLOCK, block_checksums, crc32c, region_runs
from .errors import CoverageError, LayoutError
from .layout import DTYPES, Dims, TensorLayout, itemsize, shard_view

SCHEMA = 2
METADATA = "metadata.json"
SIDECAR = ".crc32c"
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


def versions_of(fs, root: str, name: str, offsets) -> list[int]:
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


# ------------------------------------------------------------------------------ boxes, as a reader sees them


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


