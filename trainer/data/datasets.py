"""Prompt datasets as RL users bring them, and the seeded, epoch-aware prompt sampler.

Files. ``.parquet`` (pyarrow), ``.jsonl``/``.json`` (one JSON object per line; a ``.json``
holding one JSON array of objects is read too), ``.arrow`` (an Arrow IPC stream or file), or
a directory written by HF ``datasets``' ``save_to_disk`` (its ``state.json`` lists the
``*.arrow`` IPC stream files, read with pyarrow; ``datasets`` itself is not needed). Several
files are concatenated in the order given; a row's ``index`` is its number in that
concatenation, stable whatever is filtered out later.

Rows. verl's schema as its preprocessing scripts write it: ``data_source``, ``prompt``
(chat messages ``[{"role", "content"}, ...]``), ``reward_model: {"ground_truth", "style"}``,
``extra_info`` (a dict, may be absent). The plain schema: ``data.prompt_key`` (text or chat
messages) and ``data.answer_key`` (a column, or a dotted path into nested columns; None means
verl's ``reward_model.ground_truth``). ``data_source`` absent: the file's stem. Values come
back as plain Python (numpy arrays and Arrow lists as lists, structs as dicts).

Prompts are encoded once, at load, in batches (``TextTokenizer.encode_prompts``): chat
messages through the tokenizer's chat template with the generation prompt. A prompt longer
than ``data.max_prompt_length`` tokens is an error naming its file, row and length, or with
``filter_overlong_prompts`` is dropped and counted (``PromptDataset.filtered``).

Sampling (``PromptSampler``). The sampler's whole state is one integer, the position p =
prompts consumed so far, which the trainer checkpoints. With n rows, position p is in epoch
e = p // n and draws row ``perm_e[p % n]``, where ``perm_e`` is ``torch.randperm(n)`` from a
``torch.Generator`` seeded by a hash of (seed, e) (the identity without shuffle). A step that
crosses an epoch boundary takes the end of one epoch and the start of the next, so every
epoch visits every row exactly once. Every rank draws the step's full prompt list from the
same position and replicas then take their rows: the sequence depends on nothing but
(n, seed, shuffle), never on the number of ranks or replicas, so a job resumes at another
world size on the same prompts.

Errors are ``DataError`` (a ValueError), one line naming the file, and the key or row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

from ..seeds import epoch_seed
from .tokenizer import TextTokenizer, TokenizerError

if TYPE_CHECKING:
    from ..config import DataConfig

SUFFIXES = (".parquet", ".jsonl", ".json", ".arrow")
VERL_ANSWER = "reward_model.ground_truth"
ENCODE_CHUNK = 4096  # prompts per batched tokenizer call
_MISSING = object()


class DataError(ValueError):
    """A data file that cannot be read as prompts; the message names the file, key or row."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptRow:
    """One prompt as a reward function sees it (verl's fields)."""

    index: int  # row number over the concatenated files, stable under filtering
    prompt: str | list[dict]  # text, or chat messages [{"role", "content"}, ...]
    data_source: str
    ground_truth: object  # whatever the file holds (often a string)
    extra_info: dict


# ---------------------------------------------------------------- reading files


def read_records(file: str) -> list[dict]:
    """Every row of one data file (or ``save_to_disk`` directory) as a dict of plain values."""
    if os.path.isdir(file):
        return _read_saved_dataset(file)
    if not os.path.exists(file):
        raise DataError(f"{file}: no such data file")
    suffix = os.path.splitext(file)[1].lower()
    if suffix not in SUFFIXES:
        raise DataError(
            f"{file}: unknown data format {suffix or '(no extension)'!r}: expected .parquet, .jsonl, .json, .arrow "
            "or a directory written by datasets' save_to_disk"
        )
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(file).to_pylist()
        if suffix == ".arrow":
            return _read_arrow(file).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{file}: not a readable {suffix[1:]} file ({type(e).__name__}: {_first_line(e)})") from None
    return _read_json_lines(file)


def _read_json_lines(file: str) -> list[dict]:
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{file}: not UTF-8 text (byte {e.start}: {e.reason}); JSON lines must be UTF-8") from None
    if file.lower().endswith(".json") and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{file}: not valid JSON ({e})") from None
        lines = list(enumerate(records, 1))
    else:
        lines = []
        for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 inside a string is no line end
            if line.strip():
                try:
                    lines.append((number, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{file}: line {number} is not valid JSON ({e})") from None
    for number, record in lines:
        if not isinstance(record, dict):
            raise DataError(f"{file}: line {number} is a JSON {type(record).__name__}, not an object (one row per line)")
    return [record for _, record in lines]


def _read_arrow(file: str) -> pa.Table:
    """An Arrow IPC file as ``datasets`` writes it (a stream), or in the random-access format."""
    with pa.memory_map(file) as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).read_all()


def _read_saved_dataset(path: str) -> list[dict]:
    """A ``Dataset.save_to_disk`` directory: the arrow files its ``state.json`` lists, in order."""
    splits_file = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(splits_file):
        splits = _read_json(splits_file).get("splits", [])
        raise DataError(f"{path}: a DatasetDict with splits {splits}: give one split's directory, e.g. "
                        f"{os.path.join(path, splits[0] if splits else 'train')}")
    state_file = os.path.join(path, "state.json")
    if not os.path.isfile(state_file):
        raise DataError(f"{path}: a directory, but not one written by datasets' save_to_disk (no state.json)")
    entries = _read_json(state_file).get("_data_files")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "filename" in e for e in entries):
        raise DataError(f"{state_file}: no '_data_files' list of {{'filename'}} entries")
    records: list[dict] = []
    for entry in entries:
        file = os.path.join(path, entry["filename"])
        if not os.path.isfile(file):
            raise DataError(f"{state_file}: lists {entry['filename']!r}, which does not exist ({file})")
        try:
            records += _read_arrow(file).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{file}: not a readable Arrow file ({type(e).__name__}: {_first_line(e)})") from None
    return records


def _read_json(file: str) -> dict:
    try:
        with open(file) as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise DataError(f"{file}: not a JSON object")
    return value


# ---------------------------------------------------------------- rows


def read_rows(
    files: Sequence[str], *, prompt_key: str = "prompt", answer_key: str | None = None
) -> tuple[list[PromptRow], list[tuple[str, int, int]]]:
    """The rows of ``files`` concatenated, and each file's (path, first index, row count)."""
    rows: list[PromptRow] = []
    sources: list[tuple[str, int, int]] = []
    for file in files:
        records = read_records(file)
        sources.append((file, len(rows), len(records)))
        rows += rows_of(records, file, first_index=len(rows), prompt_key=prompt_key, answer_key=answer_key)
    return rows, sources


def rows_of(
    records: Sequence[dict], file: str, *, first_index: int = 0, prompt_key: str = "prompt", answer_key: str | None = None
) -> list[PromptRow]:
    """``PromptRow`` s of one file's records (pure); ``file`` only names the file in errors and
    gives the default ``data_source`` (its stem)."""
    answer = answer_key or VERL_ANSWER
    prompts = _column(records, file, prompt_key, "data.prompt_key")
    truths = _column(records, file, answer, "data.answer_key" if answer_key else "verl's answer; set data.answer_key for a plain file")
    stem = os.path.splitext(os.path.basename(os.path.normpath(file)))[0]
    rows = []
    for r, (record, prompt, truth) in enumerate(zip(records, prompts, truths)):
        source = record.get("data_source")
        extra = _plain(record.get("extra_info"))
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise DataError(f"{file}: row {r}: 'extra_info' must be an object, got {type(extra).__name__}")
        rows.append(PromptRow(
            index=first_index + r, prompt=_prompt(prompt, file, r, prompt_key),
            data_source=stem if source is None else str(source), ground_truth=_plain(truth), extra_info=extra,
        ))
    return rows


def _lookup(record: dict, key: str) -> object:
    """``record[key]``, else ``key`` as a dotted path into nested dicts; ``_MISSING`` if absent or None."""
    value = record.get(key, _MISSING)
    if value is _MISSING and "." in key:
        value = record
        for part in key.split("."):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
            if value is _MISSING:
                break
    return _MISSING if value is None else value


def _column(records: Sequence[dict], file: str, key: str, what: str) -> list:
    values = [_lookup(r, key) for r in records]
    missing = [i for i, v in enumerate(values) if v is _MISSING]
    if missing and len(missing) == len(records):
        keys = sorted(records[0]) if records else []
        raise DataError(f"{file}: no {key!r} in any row ({what}); the rows have {keys}")
    if missing:
        raise DataError(f"{file}: row {missing[0]} has no {key!r} ({what}); {len(missing)} of {len(records)} rows lack it")
    return values


def _plain(value: object) -> object:
    """Python lists, dicts and scalars for numpy arrays and scalars, recursively."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _prompt(value: object, file: str, row: int, key: str) -> str | list[dict]:
    value = _plain(value)
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return [{k: v for k, v in m.items() if v is not None} for m in value]  # None: a field other rows' messages have
    shown = repr(value)
    raise DataError(
        f"{file}: row {row}: {key!r} must be text or chat messages (a non-empty list of {{'role': str, 'content': str}}), "
        f"got {shown[:80] + '...' if len(shown) > 80 else shown}"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


# ---------------------------------------------------------------- the dataset


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptDataset:
    """Rows and their prompt token ids, in file order, over-long rows filtered out."""

    rows: tuple[PromptRow, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    filtered: int  # rows dropped for being longer than max_prompt_length
    sources: tuple[tuple[str, int, int], ...]  # (file, first index, rows read) per file

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, position: int) -> PromptRow:
        return self.rows[position]

    def take(self, positions: Sequence[int]) -> tuple[list[PromptRow], list[list[int]]]:
        """The rows at ``positions`` (0 .. len - 1, as the sampler gives them) and their prompt ids."""
        return [self.rows[p] for p in positions], [list(self.prompt_ids[p]) for p in positions]

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(file for file, _, _ in self.sources)

    @property
    def data_sources(self) -> tuple[str, ...]:
        return tuple(sorted({r.data_source for r in self.rows}))


def _locate(sources: Sequence[tuple[str, int, int]], index: int) -> tuple[str, int]:
    for file, first, count in sources:
        if first <= index < first + count:
            return file, index - first
    raise IndexError(f"row index {index} is in none of the files")


def load_prompt_dataset(files: str | Sequence[str], data: DataConfig, tokenizer: TextTokenizer) -> PromptDataset:
    """Read ``files``, encode every prompt, enforce ``data.max_prompt_length``."""
    files = (files,) if isinstance(files, str) else tuple(files)
    if not files:
        raise DataError("no data files given (data.train_files / data.val_files)")
    rows, sources = read_rows(files, prompt_key=data.prompt_key, answer_key=data.answer_key)
    if not rows:
        raise DataError(f"{', '.join(files)}: no rows")
    ids = encode_rows(rows, tokenizer, sources)
    limit = data.max_prompt_length
    empty = [i for i, p in enumerate(ids) if not p]
    if empty:
        file, r = _locate(sources, rows[empty[0]].index)
        raise DataError(f"{file}: row {r}: the prompt encodes to no tokens")
    over = [i for i, p in enumerate(ids) if len(p) > limit]
    if over and not data.filter_overlong_prompts:
        file, r = _locate(sources, rows[over[0]].index)
        raise DataError(
            f"{file}: row {r} (index {rows[over[0]].index}): the prompt is {len(ids[over[0]])} tokens, over "
            f"data.max_prompt_length={limit} ({len(over)} of {len(rows)} rows are); raise the limit or set "
            "data.filter_overlong_prompts: true to drop them"
        )
    if len(over) == len(rows):
        raise DataError(
            f"{', '.join(files)}: every one of the {len(rows)} prompts is longer than data.max_prompt_length={limit} "
            f"(the shortest has {min(map(len, ids))} tokens): nothing is left after filtering"
        )
    drop = set(over)
    keep = [i for i in range(len(rows)) if i not in drop]
    return PromptDataset(
        rows=tuple(rows[i] for i in keep), prompt_ids=tuple(tuple(ids[i]) for i in keep),
        filtered=len(over), sources=tuple(sources),
    )


def encode_rows(
    rows: Sequence[PromptRow], tokenizer: TextTokenizer, sources: Sequence[tuple[str, int, int]] = ()
) -> list[list[int]]:
    """Prompt ids of every row, ``ENCODE_CHUNK`` rows per batched tokenizer call. A prompt the
    tokenizer refuses (a chat template raising on a role) is an error naming its file and row."""
    def where(row: PromptRow) -> str:
        return "{}: row {}".format(*_locate(sources, row.index)) if sources else f"row {row.index}"

    if not tokenizer.has_chat_template:
        chat = next((r for r in rows if not isinstance(r.prompt, str)), None)
        if chat is not None:
            try:
                tokenizer.render(chat.prompt)
            except TokenizerError as e:
                raise TokenizerError(f"{e}; {where(chat)} gives its prompt as chat messages") from None
    out: list[list[int]] = []
    for lo in range(0, len(rows), ENCODE_CHUNK):
        chunk = rows[lo : lo + ENCODE_CHUNK]
        try:
            out += tokenizer.encode_prompts([r.prompt for r in chunk])
        except Exception:
            for row in chunk:  # find the row to name
                try:
                    tokenizer.encode_prompt(row.prompt)
                except Exception as e:
                    raise DataError(f"{where(row)}: the prompt cannot be encoded: {type(e).__name__}: {_first_line(e)}") from None
            raise
    return out


# ---------------------------------------------------------------- the sampler


class PromptSampler:
    """Positions -> dataset rows: a pure function of (num_rows, seed, shuffle) and the position."""

    __slots__ = ("num_rows", "seed", "shuffle", "_perms")

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise ValueError(f"a sampler needs at least one row, got {num_rows}")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self._perms: dict[int, list[int]] = {}  # the last epochs drawn

    def epoch_of(self, position: int) -> int:
        return position // self.num_rows

    def permutation(self, epoch: int) -> list[int]:
        """Row order of ``epoch``: ``torch.randperm`` seeded by ``epoch_seed``, or the identity."""
        if not self.shuffle:
            return list(range(self.num_rows))
        perm = self._perms.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            perm = torch.randperm(self.num_rows, generator=g).tolist()
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm

    def indices(self, start: int, count: int) -> list[int]:
        """Rows of positions ``start .. start + count - 1``, across epoch boundaries."""
        if start < 0 or count < 0:
            raise ValueError(f"positions must be non-negative, got start={start}, count={count}")
        out: list[int] = []
        position, end = start, start + count
        while position < end:
            epoch, offset = divmod(position, self.num_rows)
            take = min(end - position, self.num_rows - offset)
            out += self.permutation(epoch)[offset : offset + take]
            position += take
        return out
