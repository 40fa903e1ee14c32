"""HuggingFace checkpoints: a directory with ``config.json`` and safetensors weights.

Reading: a single ``model.safetensors`` or shards listed by ``model.safetensors.index.json``
(``weight_map``: name -> file). Every file the index names must exist, every tensor it
names must be in that file, and names and shapes must match the decoder described by
``config.json`` (:func:`check_against_spec`); each mismatch is an error naming the tensor
and the file. Tensors are read one at a time (``read``), never the whole model.

Writing (:class:`HFWriter`): tensors are streamed in the order of
``derive.plan_parameters`` into one file, or into ``model-0000k-of-0000n.safetensors``
shards of at most ``max_shard_bytes`` plus the index, inside a temporary directory that
is renamed into place at the end, so a failed export leaves no directory that looks whole.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from typing import Mapping

import torch

from nereus.reshard.derive import DecoderSpec, plan_parameters
from nereus.reshard.layout import DTYPES

from .errors import CheckpointExistsError, ModelMismatchError, StoreError
from .safetensors_io import Interleaved, SafetensorsWriter, TensorInfo, map_file, read_box, read_header

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
"""Files of an HF model directory that conversion carries over unchanged (generation
settings, tokenizer): read from an HF source, kept in Nereus checkpoints (``hf/<model>/``),
written into an HF export."""


def side_files(path: str) -> dict[str, bytes]:
    """The :data:`SIDE_FILES` present in an HF directory (or any directory), by name."""
    out = {}
    for name in SIDE_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                out[name] = f.read()
    return out


def exported_file(name: str) -> bool:
    """Whether an HF export writes a file of this name (what ``--overwrite`` may replace)."""
    return name in (CONFIG, INDEX, SINGLE, *SIDE_FILES) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name) is not None
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some old exports carry; recomputed by models


def spec_from_hf_config(config: Mapping, *, dtype: str | None = None) -> DecoderSpec:
    """The decoder shapes of a Llama/Qwen2-family ``config.json`` (``DecoderSpec.from_hf_config``),
    errors as StoreError.

    Only shapes are read: features that change the forward pass but not the parameters
    (RoPE scaling, sliding windows) are accepted, since conversion does not run the model.
    ``trainer.model.ModelArgs.from_hf_config`` is the strict reader for training.
    """
    try:
        return DecoderSpec.from_hf_config(config, dtype=dtype)
    except ValueError as e:
        raise StoreError(str(e)) from None


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX))


@dataclass(frozen=True, kw_only=True, slots=True)
class HFCheckpoint:
    """An opened HF directory: its config and, per tensor, the file and byte range."""

    path: str
    config: dict
    tensors: dict[str, TensorInfo]
    files: dict[str, str]

    @classmethod
    def open(cls, path: str) -> HFCheckpoint:
        config_path = os.path.join(path, CONFIG)
        if not os.path.isfile(config_path):
            raise StoreError(f"{path}: no {CONFIG} (a HuggingFace model directory needs one)")
        config = _read_json(config_path)
        index_path = os.path.join(path, INDEX)
        if os.path.isfile(index_path):
            weight_map = _read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise StoreError(f"{index_path}: no 'weight_map'")
        elif os.path.isfile(os.path.join(path, SINGLE)):
            weight_map = None
        else:
            raise StoreError(f"{path}: neither {SINGLE} nor {INDEX}")
        tensors: dict[str, TensorInfo] = {}
        files: dict[str, str] = {}
        shards = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        for shard in shards:
            file = os.path.join(path, shard)
            if not os.path.isfile(file):
                raise StoreError(f"{index_path}: points to {shard!r}, which does not exist ({file})")
            infos, _ = read_header(file)
            for name, info in infos.items():
                if weight_map is not None and weight_map.get(name) != shard:
                    continue  # a tensor the index places elsewhere (or not at all) is not read from here
                tensors[name], files[name] = info, file
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in tensors:
                    raise StoreError(f"{index_path}: tensor {name!r} is mapped to {shard!r}, which does not hold it")
        return cls(path=path, config=config, tensors=tensors, files=files)

    def spec(self, dtype: str | None = None) -> DecoderSpec:
        return spec_from_hf_config(self.config, dtype=dtype)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor ``name`` in its stored dtype, read into ``out`` (or a new tensor)."""
        info = self.tensors[name]
        out = torch.empty(info.shape, dtype=DTYPES[info.dtype]) if out is None else out
        read_box(self.files[name], info, (0,) * len(info.shape), info.shape, out)
        return out

    def mapped(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a read-only view of a memory map of its bytes (``map_file``):
        no copy; the pages leave the process's memory when the last view is dropped."""
        info = self.tensors[name]
        dtype = DTYPES[info.dtype]
        raw = map_file(self.files[name], info.start, info.nbytes)
        if raw.data_ptr() % dtype.itemsize:  # an unaligned tensor in a foreign file: copy it
            return self.read(name)
        return raw.view(dtype).view(info.shape)


def check_against_spec(ckpt: HFCheckpoint, spec: DecoderSpec) -> None:
    """Every parameter of ``spec`` is present with its shape; no unknown tensors."""
    expected = {name: shape for name, shape, _, _ in plan_parameters(spec)}
    for name, shape in expected.items():
        info = ckpt.tensors.get(name)
        if info is None:
            raise ModelMismatchError(f"{ckpt.path}: tensor {name!r} is missing (the config describes it)")
        if info.shape != tuple(shape):
            raise ModelMismatchError(
                f"{ckpt.files[name]}: tensor {name!r} has shape {list(info.shape)}, the config says {list(shape)}"
            )
        if not DTYPES[info.dtype].is_floating_point:
            raise ModelMismatchError(f"{ckpt.files[name]}: tensor {name!r} has non-float dtype {info.dtype}")
    tied_head = spec.tie_embeddings and "lm_head.weight" in ckpt.tensors
    extra = [
        n for n in ckpt.tensors
        if n not in expected and not n.endswith(IGNORED_SUFFIXES) and not (tied_head and n == "lm_head.weight")
    ]
    if extra:
        raise ModelMismatchError(
            f"{ckpt.files[extra[0]]}: tensor {extra[0]!r} is not a parameter of the model the config describes"
            f" ({len(extra)} such tensors)"
        )


def plan_hf_files(entries: list[tuple[str, str, tuple[int, ...]]], max_shard_bytes: int) -> dict[str, list]:
    """File name -> its entries, in order: one file if all fit, else ``model-k-of-n`` shards (pure)."""
    sizes = [math.prod(shape) * DTYPES[dtype].itemsize for _, dtype, shape in entries]
    if sum(sizes) <= max_shard_bytes:
        return {SINGLE: list(entries)}
    groups: list[list] = [[]]
    used = 0
    for entry, size in zip(entries, sizes):
        if groups[-1] and used + size > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(entry)
        used += size
    n = len(groups)
    return {f"model-{k + 1:05d}-of-{n:05d}.safetensors": g for k, g in enumerate(groups)}


class HFWriter:
    """Writes a HF directory tensor by tensor: ``write(name, tensor)`` in declared order, then ``close()``.

    Everything goes into ``<dst>.tmp-<id>/``; ``close`` renames it to ``dst`` (moving an
    existing ``dst`` aside first when ``overwrite``, then deleting it). ``overwrite`` only
    replaces a directory that holds nothing but what an HF export writes (``exported_file``):
    anything else in it is refused before a byte is written, and again at ``close``.
    Without ``overwrite`` the final rename only replaces an absent or empty ``dst``: of
    two exports into one destination the second to close fails (CheckpointExistsError)
    and removes its temporary directory, never replacing the first. ``side_files`` (name
    -> bytes: generation config, tokenizer) are written beside ``config.json``. ``abort``
    removes the temporary directory.
    """

    def __init__(
        self,
        dst: str,
        entries: list[tuple[str, str, tuple[int, ...]]],
        config: Mapping,
        *,
        overwrite: bool = False,
        max_shard_bytes: int = 5_000_000_000,
        sync: bool = True,
        side_files: Mapping[str, bytes] | None = None,
    ):
        dst = os.path.abspath(dst)
        if os.path.exists(dst) and (os.listdir(dst) if os.path.isdir(dst) else True) and not overwrite:
            raise CheckpointExistsError(f"{dst} already exists and is not empty; pass --overwrite to replace it")
        _refuse_foreign(dst)
        self.dst = dst
        self._overwrite = overwrite
        self._sync = sync
        self._tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
        os.makedirs(self._tmp)
        self._files = plan_hf_files(entries, max_shard_bytes)
        self._order = [(file, e[0]) for file, es in self._files.items() for e in es]
        self._pos = 0
        self._writer: SafetensorsWriter | None = None
        self._total = sum(math.prod(s) * DTYPES[d].itemsize for _, d, s in entries)
        with open(os.path.join(self._tmp, CONFIG), "w") as f:
            json.dump(dict(config), f, indent=2, sort_keys=True)
        for name, data in (side_files or {}).items():
            if os.path.basename(name) != name or name not in SIDE_FILES:
                raise StoreError(f"{dst}: side file {name!r} is not one an HF export carries ({', '.join(SIDE_FILES)})")
            with open(os.path.join(self._tmp, name), "wb") as f:
                f.write(data)

    def write(self, name: str, tensor: torch.Tensor | Interleaved) -> None:
        """Write the next tensor: a tensor, or its bytes as ``Interleaved`` runs (see SafetensorsWriter)."""
        if self._pos >= len(self._order):
            raise StoreError(f"{self.dst}: tensor {name!r} written past the declared tensors")
        file, expected = self._order[self._pos]
        if name != expected:
            raise StoreError(f"{self.dst}: expected tensor {expected!r} next, got {name!r}")
        if self._writer is None or os.path.basename(self._writer.path) != file:
            if self._writer is not None:
                self._writer.close()
            self._writer = SafetensorsWriter(
                os.path.join(self._tmp, file), self._files[file], {"format": "pt"}, sync=self._sync
            )
        self._writer.write(name, tensor)
        self._pos += 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._pos != len(self._order):
            self.abort()
            raise StoreError(f"{self.dst}: {len(self._order) - self._pos} tensors were never written")
        if len(self._files) > 1:
            index = {
                "metadata": {"total_size": self._total},
                "weight_map": {e[0]: file for file, es in self._files.items() for e in es},
            }
            with open(os.path.join(self._tmp, INDEX), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        # The check of __init__ and this rename are one compare-and-swap: rename(2) replaces
        # only an EMPTY directory, so an export that landed at dst meanwhile (another
        # conversion's) makes this one fail instead of being silently replaced.
        old = None
        try:
            if self._overwrite and os.path.lexists(self.dst):
                _refuse_foreign(self.dst)  # what is there now, not what was there at the start
                old = f"{self.dst}.old-{uuid.uuid4().hex[:8]}"
                os.rename(self.dst, old)
            os.rename(self._tmp, self.dst)
        except (OSError, CheckpointExistsError) as e:
            if old is not None and not os.path.lexists(self.dst):
                os.rename(old, self.dst)  # put back what was replaced
            self.abort()
            if isinstance(e, CheckpointExistsError):
                raise
            raise CheckpointExistsError(
                f"{self.dst}: another export was put there while this one was written ({e.strerror or e}); "
                "nothing of this conversion was kept"
            ) from None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.unlink(old)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        shutil.rmtree(self._tmp, ignore_errors=True)


def _refuse_foreign(dst: str) -> None:
    """CheckpointExistsError unless ``dst`` is absent or a directory holding only what an
    HF export writes (what ``--overwrite`` may replace)."""
    if not os.path.lexists(dst):
        return
    if not os.path.isdir(dst):
        raise CheckpointExistsError(f"{dst} is a file, not a directory; refusing to replace it")
    foreign = sorted(n for n in os.listdir(dst) if not exported_file(n))
    if foreign:
        raise CheckpointExistsError(
            f"{dst} holds files an HF export does not write ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); --overwrite replaces only an HF export: choose an empty directory"
        )


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise StoreError(f"{path}: not a JSON object")
    return value
