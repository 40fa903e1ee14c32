"""Vectorized global estimator: the exact transfers of ``plan_transfers``, as numpy arrays.

``plan_transfers`` builds one DCP ``ReadItem`` and one ``Transfer`` object per region,
which is right for one rank's plan and too slow for the whole transition of a 1,024-rank
job (the controller and ``nereus simulate`` price many candidate transitions). This module
computes the same transfers — same rows, same order, same senders — without building a
Python object per transfer:

1. shards of both sides become arrays (tensor id, rank, box, buffer id), in merged order
   (``merge_layouts``'); dims are padded to a common rank ``D`` with trailing (offset 0,
   length 1) — a 0-d tensor is a (1,)-box — which changes no volume, intersection or
   contiguity. Each distinct ``shards`` tuple is read once (an optimizer moment shares
   its parameter's), the only Python-level pass over shards;
2. distinct non-empty boxes per tensor, numbered in first-seen order (as
   ``TensorLayout.unique_boxes`` does): a dense code per distinct (offsets, lengths),
   then one ``np.unique`` over (tensor, code);
3. intersections by a join on tensor id with a sweep over one dim (per tensor, the dim
   where the source boxes have the most distinct starts): candidates are the source boxes
   whose sweep interval overlaps the target box's, found by ``searchsorted``;
4. every intersection of source box ``b`` and target box ``d`` becomes a request per
   target replica of ``d``; requests sorted by (tensor, b, dst rank, d) are plan order;
5. the sender rule of ``plan.py``: the destination itself when it is a live holder of
   ``b``, else the k-th remote request of ``b`` goes to live holder
   ``(k + b + tensor index) mod n_live`` (holders ordered by rank), else STAGED.

Checks raise what ``plan_transfers`` raises, in the same order: LayoutError when replicas
disagree on a tensor, MismatchError when source and target disagree, CoverageError for
the first tensor (target order) with an uncovered region or a region without a live
holder. Not repeated here: ``local_buffers``' check that fused pieces tile their buffer
(a malformed fused layout is rejected by ``plan_transfers``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import chain, count
from operator import attrgetter
from typing import Collection, Sequence

import numpy as np

from .arrays import BufferTable, TransferArrays
from .errors import CoverageError, LayoutError
from .layout import EMU, TensorLayout, itemsize
from .plan import STAGED, check_compatible


_shards = attrgetter("shards")
_rank, _buffer = attrgetter("rank"), attrgetter("buffer")
_name, _shape, _dtype = attrgetter("name"), attrgetter("shape"), attrgetter("dtype")


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _Side:
    """One side (sources or targets) merged over its EMUs, as arrays.

    Per shard, in merged order (tensor by tensor, EMU by EMU): tensor id, rank, box id
    (-1 for an empty box) and buffer id. Per non-empty box, numbered tensor by tensor in
    first-seen order: tensor, offsets and lengths (padded to D dims); ``box_start[t]`` is
    tensor t's first box.
    """

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    tid: np.ndarray
    rank: np.ndarray
    box: np.ndarray
    buf: np.ndarray
    table: BufferTable
    box_tid: np.ndarray
    box_off: np.ndarray
    box_len: np.ndarray
    box_start: np.ndarray


def _merge(emus: Sequence[EMU], side: str) -> dict[str, list[TensorLayout]]:
    """Layouts per tensor name, in first-seen order; replicas must agree (as ``merge_layouts``).

    Replicas usually list the same tensors in the same order: their layouts are appended
    tuple-wise once names, shapes and dtypes are seen to match.
    """
    groups: dict[str, list[TensorLayout]] = {}
    known: dict[tuple[str, ...], tuple[list, tuple, tuple]] = {}
    for emu in emus:
        tensors = emu.tensors
        names = tuple(map(_name, tensors))
        same = known.get(names)
        if same is not None and same[1] == tuple(map(_shape, tensors)) and same[2] == tuple(map(_dtype, tensors)):
            deque(map(list.append, same[0], tensors), maxlen=0)
            continue
        for layout in tensors:
            group = groups.get(layout.name)
            if group is None:
                groups[layout.name] = [layout]
                continue
            first = group[0]
            if first.shape != layout.shape or first.dtype != layout.dtype:
                raise LayoutError(
                    f"{side} replicas disagree on tensor {layout.name!r}: shape {first.shape} "
                    f"{first.dtype} vs {layout.shape} {layout.dtype} in {emu.label}"
                )
            group.append(layout)
        if len(set(names)) == len(names):
            firsts = [groups[n][0] for n in names]
            known[names] = ([groups[n] for n in names], tuple(map(_shape, firsts)), tuple(map(_dtype, firsts)))
    return groups


def _check_compatible(src: dict[str, list[TensorLayout]], dst: dict[str, list[TensorLayout]], cast: bool) -> None:
    """``plan.check_compatible`` on the merged groups (its messages and its cast rule)."""
    check_compatible({n: g[0] for n, g in src.items()}, {n: g[0] for n, g in dst.items()}, cast=cast)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + c)`` for every (s, c)."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    shift = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return np.arange(total, dtype=np.int64) + shift


def _first_seen(values: np.ndarray) -> np.ndarray:
    """For each element, the index of the first element equal to it (one dict pass)."""
    seen: dict = {}
    return np.fromiter(map(seen.setdefault, values, count()), np.int64, len(values))


def _side(groups: dict[str, list[TensorLayout]], dims: int) -> _Side:
    """Shard arrays in merged order, boxes and the buffer table.

    Layouts often share one ``shards`` tuple (an optimizer moment and its parameter, the
    steps of one holder set), so each distinct tuple is read once, then gathered.
    """
    names = list(groups)
    layouts = list(chain.from_iterable(groups.values()))
    owner = np.repeat(np.arange(len(names)), np.fromiter(map(len, groups.values()), np.int64, len(names)))
    tuples = list(map(_shards, layouts))
    first = _first_seen(list(map(id, tuples)))
    distinct = np.flatnonzero(first == np.arange(len(first)))
    which = (np.cumsum(first == np.arange(len(first))) - 1)[first]
    u_layouts = [layouts[i] for i in distinct.tolist()]
    u_count = np.fromiter(map(len, (tuples[i] for i in distinct.tolist())), np.int64, len(distinct))
    u_start = np.concatenate([[0], np.cumsum(u_count)[:-1]]).astype(np.int64)
    u_rank, u_off, u_len, u_fused, u_buf = _read_shards(u_layouts, u_count, dims)
    strings = {name: i for i, name in enumerate(names)}
    u_name = np.full(len(u_buf), -1, dtype=np.int64)
    for i in np.flatnonzero(u_fused).tolist():
        u_name[i] = strings.setdefault(u_buf[i], len(strings))
    # Gather to merged shards.
    counts = u_count[which]
    pos = _ranges(u_start[which], counts)
    tid = np.repeat(owner, counts)
    rank = u_rank[pos]
    dtypes = [group[0].dtype for group in groups.values()]
    sizes = np.array([itemsize(d) for d in dtypes], dtype=np.int64)
    code, code_off, code_len = _box_codes(u_off, u_len)
    box, box_tid, box_code = _boxes(tid, code[pos], code_len.prod(axis=1) > 0, len(code_len))
    nbytes = code_len.prod(axis=1)[code[pos]] * sizes[tid]
    name_id = np.where(u_fused[pos], u_name[pos], tid)
    buf, table = _buffer_table(rank, name_id, u_fused[pos], nbytes, list(strings))
    return _Side(
        names=names,
        shapes=[group[0].shape for group in groups.values()],
        dtypes=dtypes,
        tid=tid,
        rank=rank,
        box=box,
        buf=buf,
        table=table,
        box_tid=box_tid,
        box_off=code_off[box_code],
        box_len=code_len[box_code],
        box_start=np.searchsorted(box_tid, np.arange(len(names) + 1)),
    )


def _read_shards(layouts: list[TensorLayout], counts: np.ndarray, dims: int):
    """rank, offsets, lengths (padded with (0, 1) to ``dims``), fused flag and buffer name
    (fused shards only, else "") of every shard."""
    shards = list(chain.from_iterable(map(_shards, layouts)))
    n = len(shards)
    rank = np.fromiter(map(_rank, shards), np.int64, n)
    off = np.zeros((n, dims), dtype=np.int64)
    length = np.ones((n, dims), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    ndim = np.fromiter(map(len, map(_shape, layouts)), np.int64, len(layouts))
    for k in np.unique(ndim).tolist():
        if k == 0:
            continue
        chosen = np.flatnonzero(ndim == k)
        pos = _ranges(starts[chosen], counts[chosen])
        part = list(chain.from_iterable(map(_shards, [layouts[i] for i in chosen.tolist()])))
        for attr, out in (("offsets", off), ("lengths", length)):
            flat = chain.from_iterable(map(attrgetter(attr), part))
            out[pos, :k] = np.fromiter(flat, np.int64, len(pos) * k).reshape(-1, k)
    fused = np.fromiter(map(bool, map(_buffer, shards)), bool, n)
    buffers = [""] * n
    for i in np.flatnonzero(fused).tolist():
        buffers[i] = shards[i].buffer
    return rank, off, length, fused, buffers


def _box_codes(off: np.ndarray, length: np.ndarray):
    """A dense code per distinct (offsets, lengths) row, and the rows per code.

    Each column is replaced by its dense rank, the ranks are packed into one int64 when
    they fit (else a lexsort): ``np.unique(axis=0)`` sorts a structured dtype, 20x slower.
    """
    cols = [off[:, d] for d in range(off.shape[1])] + [length[:, d] for d in range(length.shape[1])]
    if not len(off):
        return np.zeros(0, dtype=np.int64), off, length
    dense = [np.unique(c, return_inverse=True)[1].ravel() for c in cols]
    widths = [int(d.max()).bit_length() for d in dense]
    if sum(widths) <= 62:
        packed = np.zeros(len(off), dtype=np.int64)
        for d, w in zip(dense, widths):
            packed = (packed << w) | d
        _, first, code = np.unique(packed, return_index=True, return_inverse=True)
    else:
        order = np.lexsort(dense[::-1])
        rows = np.stack([d[order] for d in dense], axis=1)
        new = np.ones(len(order), dtype=bool)
        new[1:] = (rows[1:] != rows[:-1]).any(axis=1)
        code = np.empty(len(order), dtype=np.int64)
        code[order] = np.cumsum(new) - 1
        first = order[new]
    code = code.ravel()
    return code, off[first], length[first]


def _boxes(tid: np.ndarray, code: np.ndarray, nonempty: np.ndarray, ncodes: int):
    """Box id per shard (-1: empty), numbered tensor by tensor in first-seen order.

    Returns (box per shard, tensor per box, code per box).
    """
    keep = nonempty[code]
    key = tid * (ncodes + 1) + code
    uniq, first, inverse = np.unique(key[keep], return_index=True, return_inverse=True)
    order = np.argsort(first)  # first-seen order; keys of one tensor stay together
    rank_of = np.empty(len(uniq), dtype=np.int64)
    rank_of[order] = np.arange(len(uniq))
    box = np.full(len(tid), -1, dtype=np.int64)
    box[keep] = rank_of[inverse.ravel()]
    reps = np.flatnonzero(keep)[first[order]]
    return box, tid[reps], code[reps]


def _buffer_table(rank, name_id, fused, nbytes, strings) -> tuple[np.ndarray, BufferTable]:
    """Buffer id per shard, and the table ordered by rank, then first appearance.

    A shard in a buffer of its own is one buffer (``local_buffers`` checks that a rank
    holds at most one shard of a tensor there); the pieces of a fused buffer share one.
    """
    n = len(rank)
    first = np.arange(n)
    idx = np.flatnonzero(fused)
    if len(idx):
        first[idx] = idx[_first_seen((rank[idx] * (len(strings) + 1) + name_id[idx]).tolist())]
    heads = np.flatnonzero(first == np.arange(n))
    ranks = rank[heads]
    if len(ranks) and ranks.max() < 2**15:
        ranks = ranks.astype(np.int16)  # a stable sort of int16 is a radix sort
    order = heads[np.argsort(ranks, kind="stable")]
    new_id = np.empty(n, dtype=np.int64)
    new_id[order] = np.arange(len(order))
    buf = new_id[first]
    sums = np.rint(np.bincount(buf, weights=nbytes, minlength=len(order))).astype(np.int64)  # exact below 2**53
    names = tuple(map(strings.__getitem__, name_id[order].tolist()))
    return buf, BufferTable(rank=rank[order], name=names, nbytes=sums)


def estimate_transfers(
    sources: Sequence[EMU],
    targets: Sequence[EMU],
    *,
    live: Collection[int] | None = None,
    staged: bool = False,
    cast: bool = False,
) -> TransferArrays:
    """The transfers of ``plan_transfers(sources, targets, live=live, staged=staged, cast=cast)``,
    row for row.

    Rows come in plan order and the buffer tables in ``arrays_from_plan``'s order, so the
    result equals ``arrays_from_plan(plan_transfers(...))`` array for array (a cast counts
    the target's bytes and is strided on its sender, as there).
    """
    src_groups, dst_groups = _merge(sources, "source"), _merge(targets, "target")
    _check_compatible(src_groups, dst_groups, cast)
    dims = max([1] + [len(g[0].shape) for g in chain(src_groups.values(), dst_groups.values())])
    src, dst = _side(src_groups, dims), _side(dst_groups, dims)
    dst_index = {name: i for i, name in enumerate(dst.names)}
    to_dst = np.array([dst_index.get(name, -1) for name in src.names] + [-1], dtype=np.int64)
    cs, cd, i_off, i_len = _intersections(
        to_dst[src.box_tid], src.box_off, src.box_len, dst.box_tid, dst.box_off, dst.box_len, len(dst.names)
    )
    # Requests: every intersection, once per target replica of its box; plan order.
    d_idx = np.flatnonzero(dst.box >= 0)
    d_box = dst.box[d_idx]
    d_sorted = d_idx[np.argsort(d_box, kind="stable")]
    d_cnt = np.bincount(d_box, minlength=len(dst.box_tid))
    d_beg = np.concatenate([[0], np.cumsum(d_cnt)[:-1]]).astype(np.int64)
    pair = np.repeat(np.arange(len(cs)), d_cnt[cd])
    shard = d_sorted[_ranges(d_beg[cd], d_cnt[cd])]
    tensor = dst.box_tid[cd[pair]]
    b_local = cs[pair] - src.box_start[src.box_tid[cs[pair]]]
    rank = dst.rank[shard]
    order = _sort_order(tensor, b_local, rank, cd[pair] - dst.box_start[tensor])
    pair, shard, tensor, b_local, rank = pair[order], shard[order], tensor[order], b_local[order], rank[order]
    holder, n_alive = _senders(src, cs[pair], b_local, tensor, rank, live)

    def orphan(j: int) -> CoverageError:
        return _orphan_error(dst, src, cs[pair[j]], i_off[pair[j]], i_len[pair[j]], tensor[j], rank[j])

    _check_coverage(dst, cd, i_len, pair, n_alive, staged, orphan)
    is_staged = holder < 0
    sizes = np.array([itemsize(d) for d in dst.dtypes], dtype=np.int64)
    casts = np.array([src_groups[n][0].dtype != d for n, d in zip(dst.names, dst.dtypes)] + [False], dtype=bool)
    region = i_len[pair]
    return TransferArrays(
        src=np.where(is_staged, STAGED, src.rank[holder]),
        dst=rank,
        nbytes=region.prod(axis=1) * sizes[tensor],
        src_buf=np.where(is_staged, -1, src.buf[holder]),
        dst_buf=dst.buf[shard],
        src_contig=is_staged | (~casts[tensor] & _contiguous(region, src.box_len[cs[pair]])),
        dst_contig=_contiguous(region, dst.box_len[cd[pair]]),
        src_buffers=src.table,
        dst_buffers=dst.table,
    )


def _intersections(s_tid, s_off, s_len, d_tid, d_off, d_len, ntensors):
    """Every (source box, target box) pair of one tensor that intersects, with the region.

    Sweep dim per tensor: where the source boxes have the most distinct starts. Source
    boxes sorted by (tensor, start); the candidates for a target box [a, z) are those with
    start in [a - longest + 1, z), which holds every source box that overlaps it there.
    """
    keep = s_tid >= 0
    s_idx = np.flatnonzero(keep)
    s_tid, s_off, s_len = s_tid[keep], s_off[keep], s_len[keep]
    dims = s_off.shape[1]
    span = int(max([1] + [(o + n).max() for o, n in ((s_off, s_len), (d_off, d_len)) if len(o)])) + 1
    if span * (ntensors + 1) >= 2**62:
        raise LayoutError(f"tensor extents up to {span} are too large for the estimator's int64 keys")
    starts = np.zeros((ntensors, dims), dtype=np.int64)
    for d in range(dims):
        distinct = np.unique(s_tid * span + s_off[:, d]) // span
        starts[:, d] = np.bincount(distinct, minlength=ntensors)
    sweep = starts.argmax(axis=1)
    rows = np.arange(len(s_tid))
    a = s_off[rows, sweep[s_tid]]
    length = s_len[rows, sweep[s_tid]]
    key = s_tid * span + a
    order = np.argsort(key, kind="stable")
    key = key[order]
    longest = np.zeros(ntensors, dtype=np.int64)
    np.maximum.at(longest, s_tid, length)
    drows = np.arange(len(d_tid))
    da = d_off[drows, sweep[d_tid]]
    dz = da + d_len[drows, sweep[d_tid]]
    lo = np.searchsorted(key, d_tid * span + np.maximum(da - longest[d_tid] + 1, 0))
    hi = np.searchsorted(key, d_tid * span + dz)
    cnt = np.maximum(hi - lo, 0)
    cd = np.repeat(drows, cnt)
    cs = order[_ranges(lo, cnt)]
    lo_c = np.maximum(s_off[cs], d_off[cd])
    hi_c = np.minimum(s_off[cs] + s_len[cs], d_off[cd] + d_len[cd])
    hit = (hi_c > lo_c).all(axis=1)
    cs, cd, lo_c, hi_c = cs[hit], cd[hit], lo_c[hit], hi_c[hit]
    return s_idx[cs], cd, lo_c, hi_c - lo_c


def _sort_order(*keys: np.ndarray) -> np.ndarray:
    """Stable order by ``keys`` (first key primary), by one packed int64 key when it fits."""
    if not len(keys[0]):
        return np.zeros(0, dtype=np.int64)
    widths = [int(k.max()).bit_length() + 1 for k in keys]
    if sum(widths) > 62:
        return np.lexsort(keys[::-1])
    packed = np.zeros(len(keys[0]), dtype=np.int64)
    for k, w in zip(keys, widths):
        packed = (packed << w) | k
    return np.argsort(packed, kind="stable")


def _senders(src: _Side, box, b_local, tensor, rank, live):
    """Source shard per request (-1: no live holder), and live holders per request's box.

    The destination itself when it is a live holder; else the k-th remote request of box
    ``b`` (k counted in plan order) goes to live holder ``(k + b + tensor) % n_live``.
    """
    s_idx = np.flatnonzero(src.box >= 0)
    h_rank = src.rank[s_idx]
    alive = np.ones(len(s_idx), dtype=bool) if live is None else np.isin(h_rank, np.fromiter(live, np.int64))
    s_idx, h_rank = s_idx[alive], h_rank[alive]
    h_box = src.box[s_idx]
    width = int(max(rank.max(initial=0), h_rank.max(initial=0))) + 2
    h_key = h_box * width + h_rank
    order = np.argsort(h_key, kind="stable")
    s_idx, h_box, h_key = s_idx[order], h_box[order], h_key[order]
    cnt = np.bincount(h_box, minlength=len(src.box_tid))
    beg = np.concatenate([[0], np.cumsum(cnt)[:-1]]).astype(np.int64)
    q_key = box * width + rank
    at = np.minimum(np.searchsorted(h_key, q_key), max(len(h_key) - 1, 0))
    local = (h_key[at] == q_key) if len(h_key) else np.zeros(len(box), dtype=bool)
    n_alive = cnt[box] if len(box) else np.zeros(0, dtype=np.int64)
    remote = ~local
    seen = np.cumsum(remote)
    first = np.ones(len(box), dtype=bool)
    first[1:] = box[1:] != box[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(len(box)), 0))
    k = seen - 1 - (seen[start] - remote[start]) if len(box) else seen
    pick = beg[box] + (k + b_local + tensor) % np.maximum(n_alive, 1)
    holder = np.full(len(box), -1, dtype=np.int64)
    if len(s_idx):
        holder[local] = s_idx[at[local]]
        far = ~local & (n_alive > 0)
        holder[far] = s_idx[pick[far]]
    return holder, n_alive


def _contiguous(region: np.ndarray, extent: np.ndarray) -> np.ndarray:
    """Row-major contiguity: after the first dim longer than 1, every dim spans the buffer."""
    dims = region.shape[1]
    big = region > 1
    first = np.where(big.any(axis=1), big.argmax(axis=1), dims)
    later = np.arange(dims)[None, :] > first[:, None]
    return ~(later & (region != extent)).any(axis=1)


def _check_coverage(dst: _Side, cd, i_len, pair, n_alive, staged, orphan_error) -> None:
    """Raise plan_transfers' first CoverageError: tensors in target order, and within one
    tensor an under-covered target box before a region with no live holder."""
    d_tid, d_off, d_len = dst.box_tid, dst.box_off, dst.box_len
    filled = np.zeros(len(d_tid), dtype=np.int64)
    np.add.at(filled, cd, i_len.prod(axis=1))
    short = np.flatnonzero(filled != d_len.prod(axis=1))
    orphans = np.zeros(0, dtype=np.int64) if staged else np.flatnonzero(n_alive == 0)
    if not len(short) and not len(orphans):
        return
    short_tensor = d_tid[short[0]] if len(short) else len(dst.names)
    if len(orphans) and d_tid[cd[pair[orphans[0]]]] < short_tensor:
        raise orphan_error(orphans[0])
    box = short[0]
    ndim = len(dst.shapes[short_tensor])
    offsets, lengths = tuple(d_off[box, :ndim].tolist()), tuple(d_len[box, :ndim].tolist())
    raise CoverageError(
        f"tensor {dst.names[short_tensor]!r}: target box at offsets {offsets} lengths {lengths} is only "
        f"{int(filled[box])} of {math.prod(lengths)} elements covered by the source shards"
    )


def _orphan_error(dst: _Side, src: _Side, box, offsets, lengths, tensor, rank) -> CoverageError:
    ndim = len(dst.shapes[tensor])
    holders = sorted(src.rank[src.box == box].tolist())
    return CoverageError(
        f"tensor {dst.names[tensor]!r}: region at offsets {tuple(offsets[:ndim].tolist())} lengths "
        f"{tuple(lengths[:ndim].tolist())} needed by rank {int(rank)} is held only by ranks {holders}, "
        "none live, and no staged checkpoint was given"
    )
