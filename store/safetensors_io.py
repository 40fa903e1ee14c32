"""The safetensors file format, read and written a tensor (or a box of one) at a time.

Format: an 8-byte little-endian header length ``N``, ``N`` bytes of JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the byte buffer; offsets are relative to the buffer's start (byte ``8 + N``) and the
tensors tile it without holes. Data are row-major, little-endian.

Why not ``safetensors.torch.load_file``/``save_file``: those memory-map the whole file
(every page read stays in the process's RSS while the file is open) or need every tensor
in memory at once. Here a reader ``readinto``s the bytes of one box straight into the
caller's buffer, and a writer streams tensors in a declared order after writing the
header first, so memory stays at the tensors in flight. The files are byte-compatible with
the ``safetensors`` library (tests read and write both ways).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from .errors import StoreError

ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
             "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
MAX_HEADER = 100 * 1024 * 1024  # the library's own limit


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorInfo:
    """One tensor of a safetensors file: dtype name (torch's), shape, absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Interleaved:
    """A tensor's row-major bytes taken in turn from several byte buffers, without a copy.

    For each of ``rows`` outer rows, the next ``chunks[j]`` bytes of ``parts[j]`` for every j
    in order. A tensor cut along one dimension k into boxes that are whole in every other
    dimension is this, with rows = prod(shape[:k]) and chunks[j] = box j's bytes per row:
    whole dim-0 slabs are the case rows = 1 (the parts simply follow each other).
    ``parts`` are uint8 tensors (typically maps of box files), each ``rows * chunks[j]`` long.
    """

    parts: tuple[torch.Tensor, ...]
    chunks: tuple[int, ...]
    rows: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.rows * sum(self.chunks)

    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def runs(self) -> Iterable[memoryview]:
        """The byte runs in file order (memoryviews of ``parts``, no copy)."""
        views = [memoryview(p.numpy()).cast("B") for p in self.parts]
        if self.rows == 1:
            yield from views
            return
        pairs = list(zip(views, self.chunks))
        for r in range(self.rows):
            for view, chunk in pairs:
                yield view[r * chunk : (r + 1) * chunk]


IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def write_runs(file, runs: Iterable[memoryview]) -> None:
    """Write byte runs in order with ``writev``, up to IOV_MAX runs a call; a short write
    (allowed, rare on regular files) finishes run by run."""
    batch: list[memoryview] = []

    def flush() -> None:
        done = os.writev(file.fileno(), batch)
        for b in batch:
            if done >= len(b):
                done -= len(b)
                continue
            rest, done = b[done:], 0
            while len(rest):
                rest = rest[file.write(rest) :]
        batch.clear()

    for run in runs:
        batch.append(run)
        if len(batch) == IOV_MAX:
            flush()
    if batch:
        flush()


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's storage (any dtype, 0-d included)."""
    if not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


# torch warns (once per process) when it wraps a read-only buffer; the maps below are
# read-only on purpose, so spend that one warning here, silently, at import.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


def map_file(path: str, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
    """Bytes ``[offset, offset + nbytes)`` of a local file as a uint8 tensor over a read-only
    shared memory map, populated up front (``MAP_POPULATE``).

    Why populated: a ``write`` or checksum over a fresh map takes a page fault per 4 KiB page
    and runs at ~1.6 GB/s here; populating maps the (page-cached) pages in one batch and
    the same write runs at ~3.5 GB/s. The pages are the page cache's: no copy is made, and
    they leave the process when the tensor (which holds the map) is dropped.
    """
    if nbytes is None:
        nbytes = os.path.getsize(path) - offset
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), nbytes + offset - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ, offset=start)
    return torch.frombuffer(mapped, dtype=torch.uint8)[offset - start :]


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(tensors by name, ``__metadata__``) of a safetensors file, checked against its size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise StoreError(f"{path}: not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise StoreError(f"{path}: header length {n} does not fit the file ({size} bytes); truncated?")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise StoreError(f"safetensors file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: header is not valid JSON ({e})") from None
    base = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        dtype = ST_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise StoreError(f"{path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
        shape = tuple(int(s) for s in entry["shape"])
        begin, end = entry["data_offsets"]
        expected = math.prod(shape) * _TORCH[dtype].itemsize
        if end - begin != expected:
            raise StoreError(f"{path}: tensor {name!r} of shape {shape} {dtype} spans {end - begin} bytes, needs {expected}")
        if base + end > size:
            raise StoreError(
                f"{path}: tensor {name!r} ends at byte {base + end} but the file has {size} bytes (truncated)"
            )
        infos[name] = TensorInfo(name=name, dtype=dtype, shape=shape, start=base + begin, end=base + end)
    return infos, metadata


def _read_exact(fd: int, view: memoryview, offset: int, path: str, what: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise StoreError(f"{path}: unexpected end of file reading {what} at byte {offset + done}")
        done += got


def read_box(path: str, info: TensorInfo, offsets: tuple[int, ...], lengths: tuple[int, ...], out: torch.Tensor) -> None:
    """Fill ``out`` (contiguous, shaped ``lengths``, of the file's dtype) with a box of the tensor.

    The box's rows are read with one positioned read; when the box is narrower than the
    tensor in a later dimension, the whole rows ``offsets[0] : offsets[0] + lengths[0]``
    are read into a temporary and the box copied out (the bytes needed and no more rows).
    """
    shape = info.shape
    if out.dtype != _TORCH[info.dtype] or tuple(out.shape) != tuple(lengths):
        raise StoreError(f"{path}: reading {info.name!r} box {lengths} {info.dtype} into {tuple(out.shape)} {out.dtype}")
    fd = os.open(path, os.O_RDONLY)
    try:
        if not shape:
            _read_exact(fd, byte_view(out), info.start, path, info.name)
            return
        row = math.prod(shape[1:]) * out.element_size()
        start = info.start + offsets[0] * row
        if tuple(lengths[1:]) == tuple(shape[1:]):
            _read_exact(fd, byte_view(out), start, path, info.name)
            return
        rows = torch.empty((lengths[0], *shape[1:]), dtype=out.dtype)
        _read_exact(fd, byte_view(rows), start, path, info.name)
        view = rows
        for dim in range(1, len(shape)):
            view = view.narrow(dim, offsets[dim], lengths[dim])
        out.copy_(view)
    finally:
        os.close(fd)


def plan_header(entries: Iterable[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The header bytes (length prefix included) and byte range per tensor, in the given order (pure).

    The JSON is padded with spaces to a multiple of 8 bytes, as the library does, so every
    tensor starts 8-byte aligned when offsets are.
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    ranges: dict[str, tuple[int, int]] = {}
    pos = 0
    for name, dtype, shape in entries:
        if name in ranges:
            raise StoreError(f"tensor {name!r} is listed twice")
        nbytes = math.prod(shape) * _TORCH[dtype].itemsize
        header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        ranges[name] = (pos, pos + nbytes)
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, ranges


class SafetensorsWriter:
    """Streams tensors into a safetensors file, in the order they were declared.

    Call order: ``SafetensorsWriter(path, entries)`` (writes the header to a temporary
    file), ``write(name, tensor)`` once per entry in order, ``close()`` (renames the
    temporary file into place). ``abort()`` removes the temporary file.
    """

    def __init__(
        self,
        path: str,
        entries: list[tuple[str, str, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
        *,
        sync: bool = True,
    ):
        self.path = path
        self._sync = sync
        self._entries = list(entries)
        self._next = 0
        header, _ = plan_header(self._entries, metadata)
        self._tmp = f"{path}.tmp-{os.getpid()}"
        self._file = open(self._tmp, "wb", buffering=0)
        self._file.write(header)

    def write(self, name: str, tensor: torch.Tensor | Interleaved) -> None:
        """Write the next declared tensor: one tensor of its shape, or its row-major bytes as
        ``Interleaved`` runs (their element count must be the tensor's)."""
        if self._next >= len(self._entries):
            raise StoreError(f"{self.path}: tensor {name!r} written past the declared entries")
        want, dtype, shape = self._entries[self._next]
        runs = isinstance(tensor, Interleaved)
        whole = (tensor.numel(),) if runs else tuple(tensor.shape)
        fits = math.prod(shape) == whole[0] if runs else tuple(shape) == whole
        if name != want or tensor.dtype != _TORCH[dtype] or not fits:
            raise StoreError(
                f"{self.path}: expected tensor {want!r} {shape} {dtype} next, got {name!r} "
                f"{whole} {tensor.dtype}"
            )
        write_runs(self._file, tensor.runs() if runs else [byte_view(tensor.contiguous())])
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._entries):
            missing = [e[0] for e in self._entries[self._next :]]
            self.abort()
            raise StoreError(f"{self.path}: {len(missing)} declared tensors never written, first {missing[0]!r}")
        if self._sync:
            os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)
