"""A model-stage's candidate stage configs as arrays, to be priced all at once (pure).

The search prices thousands of stage configs per model-stage. They are few *layouts*
(dp, tp, pp, dp_shard, ranks) times the settings that retune a running stage in place
(``RETUNED`` below: micro_batch_size, micro_batch_tokens, recompute). ``Candidates``
holds the distinct layouts once and each candidate as a row of arrays, so the memory and
step-time models compute what depends on the layout alone (weights per pipeline stage,
links) once per layout and the rest elementwise; ``config(i)`` rebuilds candidate ``i``'s
``StageConfig`` (only the chosen ones are ever built).

``micro_batching`` is the one place both models read a replica's micro-batches from:

- ``micro_batch_tokens`` T: the replica's rows, padding removed, packed first-fit
  decreasing into packs of at most T tokens (``trainer/parallel/packing.py``). With ``real`` = rows
  × the mean tokens of a row: ``n = ceil(real / T)`` packs (first-fit decreasing fills all
  but the last nearly full when rows are short against T), at least ``min(pp, rows)`` under
  a pipeline (``stages._pack``); the largest holds ``min(T, real)`` tokens (memory). Without
  a pipeline each pack runs at its own length (``real / n`` each on average); a pipeline
  runs them all at the widest's. Attention runs causally within each row of a pack, one
  SDPA call per row and no mask (``model.document_attention``), a token attending over its
  row (the mean row). The memory model passes the longest row as the mean: every row full,
  the worst step of that width. Left out: FSDP2's count (the largest over the replicas, of
  balanced replicas about the same) and attention's E[L²]/E[L] span (the mean row is low
  when lengths vary);
- else ``StageConfig.micro_batches(rows)`` micro-batches of ``ceil(rows / n)`` padded rows
  of the batch's width, each token attending over the width under a bool mask.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nereus.reshard.derive import plan_layer_ranges, plan_parameters, vocab_shard_rows

from ..config import StageConfig

RECOMPUTE = ("none", "selective", "full")
"""Activation recompute modes, by their index in ``Candidates.recompute``."""


DERIVED = 64
"""How many derived terms a candidate set keeps (``Candidates.derived``)."""


def read_only(value):
    """``value`` with its arrays made read-only: at the top, in a tuple or list, or a
    dataclass's fields (a shared cached term a caller could otherwise change in place for
    every later caller). A dict is left as it is (a memo, filled later: ``memory.memory_at``
    makes its own entries read-only)."""
    if isinstance(value, np.ndarray):
        value.flags.writeable = False
    elif isinstance(value, (tuple, list)):
        for x in value:
            read_only(x)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            read_only(getattr(value, f.name))
    return value


@dataclass(frozen=True, kw_only=True)
class Candidates:
    """A model-stage's candidate stage configs: the distinct layouts, and per candidate (one
    array entry each) its layout and its retunes."""

    layouts: tuple[StageConfig, ...]
    """The distinct layouts (micro-batching and recompute at their neutral values)."""
    layout: np.ndarray
    """Per candidate: the index of its layout."""
    micro_batch_size: np.ndarray
    """Per candidate: rows per micro-batch, 0 for none."""
    micro_batch_tokens: np.ndarray
    """Per candidate: the token budget of a pack, 0 for none (no packing)."""
    recompute: np.ndarray
    """Per candidate: its index in ``RECOMPUTE``."""
    _derived: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """What ``derived`` computed once for these candidates (per-layout terms the models share)."""

    @classmethod
    def of(cls, configs: Sequence[StageConfig]) -> Candidates:
        """Given stage configs, in their order."""
        layouts: dict[StageConfig, int] = {}
        index = [layouts.setdefault(layout_of(sc), len(layouts)) for sc in configs]
        return cls(
            layouts=tuple(layouts), layout=np.array(index, dtype=np.int64),
            micro_batch_size=np.array([sc.micro_batch_size or 0 for sc in configs], dtype=np.int64),
            micro_batch_tokens=np.array([sc.micro_batch_tokens or 0 for sc in configs], dtype=np.int64),
            recompute=np.array([RECOMPUTE.index(sc.recompute) for sc in configs], dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.layout)

    def retunes_of(self, sc: StageConfig) -> Candidates:
        """The candidates of ``sc``'s layout only (what retunes it in place), or none."""
        keep = layout_of(sc)
        if keep not in self.layouts:
            return Candidates(layouts=(), layout=np.zeros(0, np.int64), micro_batch_size=np.zeros(0, np.int64),
                              micro_batch_tokens=np.zeros(0, np.int64), recompute=np.zeros(0, np.int64))
        rows = np.flatnonzero(self.layout == self.layouts.index(keep))
        return Candidates(layouts=(keep,), layout=np.zeros(len(rows), np.int64), micro_batch_size=self.micro_batch_size[rows],
                          micro_batch_tokens=self.micro_batch_tokens[rows], recompute=self.recompute[rows])

    def config(self, i: int) -> StageConfig:
        mbs, mbt = int(self.micro_batch_size[i]), int(self.micro_batch_tokens[i])
        return dataclasses.replace(self.layouts[self.layout[i]], micro_batch_size=mbs or None, micro_batch_tokens=mbt or None,
                                   recompute=RECOMPUTE[self.recompute[i]])

    def configs(self) -> list[StageConfig]:
        return [self.config(i) for i in range(len(self))]

    def per_layout(self, fn, dtype=np.float64) -> np.ndarray:
        """``fn(layout)`` of each candidate's layout (computed once per layout)."""
        return np.array([fn(sc) for sc in self.layouts], dtype=dtype)[self.layout]

    def derived(self, key, fn):
        """``fn()``, computed once per ``key`` for these candidates (the models' per-layout
        terms, shared by the features of a stage's modes and its memory). The last
        ``DERIVED`` keys used are kept: a long-lived candidate set (``kept_of``: the running
        plan's stages) is priced for every config a job moves through, and a dropped entry is
        only computed again (a pure function of its key). Arrays come back read-only: they
        are shared by every later caller."""
        kept = self._derived
        if key in kept:
            kept[key] = kept.pop(key)  # the most recently used last
            return kept[key]
        value = kept[key] = read_only(fn())
        while len(kept) > DERIVED:
            del kept[next(iter(kept))]
        return value

    def elements(self, spec) -> np.ndarray:
        """``local_elements`` (below) of every layout, [layouts, its largest pp] (0 past a layout's pp)."""
        def table():
            held = [local_elements(spec, sc.tp, sc.pp, sc.dp, sc.dp_shard) for sc in self.layouts]
            out = np.zeros((len(held), max(map(len, held), default=1)), dtype=np.int64)
            for i, row in enumerate(held):
                out[i, : len(row)] = row
            return out

        return self.derived(("elements", spec), table)

    @functools.cached_property
    def tp(self) -> np.ndarray:
        return self.per_layout(lambda sc: sc.tp, np.int64)

    @functools.cached_property
    def pp(self) -> np.ndarray:
        return self.per_layout(lambda sc: sc.pp, np.int64)

    @functools.cached_property
    def dp(self) -> np.ndarray:
        return self.per_layout(lambda sc: sc.dp, np.int64)

    @functools.cached_property
    def fsdp(self) -> np.ndarray:
        """FSDP2 in effect: state sharded over dp > 1."""
        return self.per_layout(lambda sc: sc.dp_shard and sc.dp > 1, bool)


@functools.lru_cache(maxsize=4096)
def kept_of(configs: tuple[StageConfig, ...]) -> Candidates:
    """``Candidates.of(configs)``, kept: what the models derive for them once (``derived``:
    per-layout terms, the terms that do not depend on the lengths) then serves every later
    pricing of the same configs — a running plan's stages are priced every step."""
    return Candidates.of(configs)


RETUNED = {"micro_batch_size": None, "micro_batch_tokens": None, "recompute": "none"}
"""Stage-config fields a running stage changes in place (their neutral values)."""


def layout_of(sc: StageConfig) -> StageConfig:
    """``sc`` with what a running stage retunes in place at its neutral values (``RETUNED``)."""
    return dataclasses.replace(sc, **RETUNED)


@dataclass(frozen=True, kw_only=True, slots=True)
class Batching:
    """Per candidate, how a replica's rows run (arrays): ``count`` micro-batches of
    ``tokens`` tokens each as the schedule runs them (the step-time model's), the largest
    of them ``peak`` tokens (the memory model's), a token attending over ``span`` tokens,
    under a [tokens, mask] bool attention mask per micro-batch (0: none), in ``documents``
    attention calls per layer (a pack's rows one by one; 1 for padded rows, the whole
    micro-batch in one)."""

    count: np.ndarray
    tokens: np.ndarray
    peak: np.ndarray
    span: np.ndarray
    mask: np.ndarray
    documents: np.ndarray


def micro_batching(rows: np.ndarray, pp: np.ndarray, size: np.ndarray, budget: np.ndarray, width: int, row_tokens: float,
                   *, fixed: FixedBatching | None = None) -> Batching:
    """A replica of ``rows`` rows, elementwise over candidates of ``micro_batch_size`` ``size``
    and ``micro_batch_tokens`` ``budget`` (0: none) — the module docstring; ``row_tokens``:
    the mean real tokens of a row (the memory model passes ``width``: every row full).

    Packs as ``stages._pack`` makes them: as many as the budget needs, and under a pipeline
    at least ``min(pp, rows)``. Without a pipeline each pack runs at its own length (the
    packs' tokens sum to the real tokens); a pipeline runs every pack at the widest one's
    (``Packing.model_inputs``): the budget when the budget set the count, else an even share.
    ``fixed``: ``FixedBatching.of(rows, pp, size, budget)``, if at hand (what does not depend on
    the lengths); the packed candidates' terms are computed on those candidates only."""
    f = fixed if fixed is not None else FixedBatching.of(rows, pp, size, budget)
    tokens = f.per * width
    wide = np.full(rows.shape, width, dtype=np.int64)
    one = np.ones(rows.shape, dtype=np.int64)
    if not len(f.at):
        return Batching(count=f.count, tokens=tokens, peak=tokens, span=wide, mask=wide, documents=one)
    real = f.rows * float(row_tokens)
    needed = np.maximum(1, np.ceil(real / f.cap)).astype(np.int64)
    packs = np.maximum(needed, f.least)
    largest = np.minimum(f.cap, real)
    run = np.where(f.piped, np.where(packs > needed, np.minimum(f.cap, -(-f.rows // packs) * float(row_tokens)), largest), real / packs)
    count, documents = f.count.copy(), one
    count[f.at], documents[f.at] = packs, -(-f.rows // packs)
    ran, peak = tokens.astype(np.float64), tokens.astype(np.float64)  # (as np.where(packed, run, tokens) promotes them)
    ran[f.at], peak[f.at] = run, np.where(f.piped, run, largest)  # a pipeline: every pack at the widest's
    return Batching(count=count, tokens=ran, peak=peak, span=np.where(f.packed, min(float(row_tokens), width), wide),
                    mask=np.where(f.packed, 0, wide), documents=documents)


@dataclass(frozen=True, kw_only=True, slots=True)
class FixedBatching:
    """What ``micro_batching`` takes from the candidates alone: the count and rows per
    micro-batch of the padded ones, and of the packed ones (``at``) their rows, token budget
    (``cap``), the fewest packs a pipeline takes (``least``) and whether they are pipelined."""

    count: np.ndarray
    per: np.ndarray
    packed: np.ndarray
    at: np.ndarray
    rows: np.ndarray
    cap: np.ndarray
    least: np.ndarray
    piped: np.ndarray

    @classmethod
    def of(cls, rows: np.ndarray, pp: np.ndarray, size: np.ndarray, budget: np.ndarray) -> FixedBatching:
        # without a size: the largest divisor of the rows that is at most pp (StageConfig.micro_batches)
        n = filled_micro_batches(rows, pp)
        n = np.where(size > 0, np.maximum(1, rows // np.maximum(size, 1)), n)
        n = np.where(rows < 1, 1, n)
        packed = budget > 0
        at = np.flatnonzero(packed)
        r, p = rows[at], pp[at]
        return cls(count=n, per=-(-rows // n), packed=packed, at=at, rows=r, cap=np.maximum(budget[at], 1),
                   least=np.where(p > 1, np.minimum(p, np.maximum(r, 1)), 1), piped=p > 1)


def filled_micro_batches(rows: np.ndarray, pp: np.ndarray) -> np.ndarray:
    """Micro-batches of a replica of ``rows`` rows without a size: the largest divisor of the
    rows that is at most pp (``StageConfig.micro_batches``), elementwise."""
    return per_unique(_filled, rows, pp).reshape(rows.shape)


@functools.lru_cache(maxsize=4096)
def _filled(rows: int, pp: int) -> int:
    return StageConfig(pp=pp).micro_batches(rows)


def per_unique(fn, *columns: np.ndarray) -> np.ndarray:
    """``fn(*row)`` (an integer, or a tuple of them) for each row of the non-negative integer
    ``columns``, computed once per distinct row: shape (rows,) or (rows, len(tuple))."""
    columns = [np.asarray(x, dtype=np.int64).ravel() for x in columns]
    if not len(columns[0]):
        return np.zeros(0, dtype=np.int64)
    radices = [int(x.max()) + 1 for x in columns]
    if math.prod(radices) < 1 << 62:  # one mixed-radix integer per row (faster than rows compared whole)
        code = np.zeros(len(columns[0]), dtype=np.int64)
        for x, radix in zip(columns, radices):
            code = code * radix + x
    else:
        code = np.stack(columns, axis=1)
    _, first, inverse = np.unique(code, axis=0, return_index=True, return_inverse=True)
    values = np.array([fn(*row) for row in np.stack(columns, axis=1)[first].tolist()], dtype=np.int64)
    return values[inverse.ravel()]


@functools.lru_cache(maxsize=4096)
def stage_layers(layers: int, pp: int, stage: int, recompute: str) -> tuple[int, int]:
    """(blocks, checkpointed blocks) of pipeline stage ``stage``: ``full`` all of them,
    ``selective`` those of an even global index (``model.recompute_layers``)."""
    r = plan_layer_ranges(layers, pp)[stage]
    ck = len(r) if recompute == "full" else sum(1 for i in r if i % 2 == 0) if recompute == "selective" else 0
    return len(r), ck


@functools.lru_cache(maxsize=64)
def _parameters(spec) -> tuple[np.ndarray, ...]:
    """``plan_parameters(spec)`` as arrays: kind, first dimension, second (1 for a vector),
    the product of the rest, layer (read-only; ``local_elements``)."""
    params = plan_parameters(spec)
    kinds = np.array([_KINDS.index(kind) if kind in _KINDS else len(_KINDS) for _n, _s, kind, _l in params])
    first = np.array([shape[0] for _n, shape, _k, _l in params], dtype=np.int64)
    second = np.array([shape[1] if len(shape) > 1 else 1 for _n, shape, _k, _l in params], dtype=np.int64)
    rest = np.array([math.prod(shape[2:]) for _n, shape, _k, _l in params], dtype=np.int64)
    layers = np.array([layer for *_, layer in params], dtype=np.int64)
    return tuple(read_only(a) for a in (kinds, first, second, rest, layers))


_KINDS = ("vocab", "col", "kv", "row")


@functools.lru_cache(maxsize=256)
def _stage_of(layers: int, pp: int) -> np.ndarray:
    """The pipeline stage of each layer (``plan_layer_ranges``; read-only)."""
    out = np.zeros(max(layers, 1), dtype=np.int64)
    for p, r in enumerate(plan_layer_ranges(layers, pp)):
        out[r.start:r.stop] = p
    return read_only(out)


@functools.lru_cache(maxsize=8192)
def local_elements(spec, tp: int, pp: int, dp: int = 1, dp_shard: bool = False) -> tuple[int, ...]:
    """Elements of weights one rank holds, per pipeline stage: TP rank 0's, the largest (every
    TP rank holds as many but of a vocabulary no tp divides, whose first shards hold
    ceil(V/tp) rows and the last fewer); with ``dp_shard`` the largest FSDP2 chunk. See
    ``memory.py``'s module docstring. (Over every parameter at once: a search asks for
    hundreds of layouts of an 8B model's ~300 parameters.)"""
    kinds, first, second, rest, layers = _parameters(spec)
    vocab, col, kv, row = (kinds == k for k in range(len(_KINDS)))
    kv_rows = spec.dim_head if tp > spec.num_kv_heads else spec.num_kv_heads * spec.dim_head // tp
    rows = np.where(col | (kv & (tp <= spec.num_kv_heads)), first // tp, np.where(kv, kv_rows, first))
    rows = np.where(vocab, vocab_shard_rows(first, tp), rows)
    n = np.where(row, second // tp, second) * rest
    if dp_shard and dp > 1:
        rows = -(-rows // dp)
    stages = np.where(layers >= 0, _stage_of(spec.num_layers, pp)[np.maximum(layers, 0)], np.where(layers == -1, 0, pp - 1))
    held = rows * n
    out = np.zeros(pp, dtype=np.int64)
    np.add.at(out, stages, held)
    if spec.tie_embeddings and spec.head == "lm" and pp > 1:  # the last stage's copy of the tied embedding
        out[pp - 1] += held[layers == -1].sum()
    return tuple(out.tolist())
