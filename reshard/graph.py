"""The transition graph: a memory-bounded, deadlock-free schedule of a transition's transfers.

Memory model, per rank, in bytes. A rank starts holding all its source buffers. A target
buffer is allocated just in time, before the first round that writes into it (local copies
included), and is kept. With ``release_sources`` a source buffer is freed after the round
of its last read, and one that no transfer reads is freed before round 0. During a round a
non-local transfer costs transient bytes: ``nbytes`` on the sender when its source region
is not one contiguous span of the buffer (it is packed into a send buffer), ``nbytes`` on
the receiver when its destination region is not (it is received into a staging buffer,
then copied), and ``nbytes`` on both sides when it is smaller than ``coalesce`` (small
transfers travel packed together, ``messages.COALESCE_BYTES``); local copies (``copy_``
between views) cost nothing transient. Staged reads (``src == STAGED``) count on the receiver
only, and differently: a staged read fetches its bytes in pieces and copies each into its
target at once, and the staged reads of one rank's round run one after another, so they
share one allowance of ``STAGED_PIECE_BYTES`` — the reader never holds more fetched bytes
at a time: a verified read fetches whole checksum blocks (one default block is
``STAGED_PIECE_BYTES``), however small its region, and a read into a strided device target
is copied through pieces of that size (a read from a memory-mapped local file into a CPU
or contiguous target holds none).
So during round k a rank holds

    held(k) = sources not yet freed + targets allocated at or before k + transients of k,

and the peak is the maximum of that over rounds and of the initial holding.

Rounds. Each rank takes part in at most ``max_messages`` non-local transfers (sends plus
receives, staged reads included) per round; local copies don't count. The schedule is
greedy and deterministic. Transfers go in a fixed priority order: by shift
``(dst - src) mod world`` first, as the steps of a ring all-to-all, so the messages each
rank wants first go to different partners and rounds fill up (on Llama-70B, 1,024 ranks,
with 16 messages a round: 28 rounds against a lower bound of 27, where source-buffer order
needs 54; with the default 64: 7, the lower bound); then by source
buffer, so a sender drains one buffer before the next; then plan order. In each round a
transfer is taken when every rank it touches still has a message slot and its bytes fit
under the rank's budget; with a budget, transfers that cannot fit wait for frees. See
:func:`plan_graph` for how a round is filled with numpy rather than one transfer at a time.

Every rank must build the graph from the same, whole transition (``estimate_transfers`` or
``arrays_from_plan`` of a plan over all ranks): the schedule is a pure function of it, so
all ranks agree on every round without talking.

Deadlock freedom. The executor posts, per round, all of a rank's sends and receives of
that round at once (``batch_isend_irecv``) and waits for them before the next round. Every
send of round k is matched by the receive of the same transfer on its partner, and that
receive is in round k too (a transfer has one round). Induction over rounds: if every rank
finishes round k-1, every rank posts round k, so every op of round k has its partner
posted and round k completes; round 0 needs nothing before it. Within a round, two ranks
that exchange several messages post them in ascending transfer index on both sides
(``RoundOps`` lists them so), so point-to-point matching in posting order pairs each send
with its own receive. Allocations, local copies and frees are rank-local and never wait.

Time, by the alpha-beta model of :class:`LinkCost`: per round, each rank's time is
max(send time, receive time) over its messages plus the time of its local copies; a round
lasts as long as its slowest rank; the transition, the sum of its rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from .arrays import TransferArrays
from .errors import MemoryBudgetError
from .links import LinkCost
from .messages import COALESCE_BYTES
from .plan import STAGED

STAGED_PIECE_BYTES = 4 << 20
"""The most a rank's staged reads of one round hold at once beside their targets (fetched
bytes not yet copied; ``staged_load.StagedReader``): what the graph charges a round with any."""

RESERVE_BYTES = 64 << 10
"""What ``reshard()`` leaves free per rank under a budget for the executor's bookkeeping:
agreement records, checksum vectors (8 bytes a message), a gloo work's lingering outputs."""

FREED_BEFORE = -1
"""``free_round`` of a source buffer that no transfer reads, freed before round 0."""
KEPT = -2
"""``free_round`` of a source buffer the transition keeps (``release_sources=False``)."""

@dataclass(frozen=True, kw_only=True, slots=True)
class RoundOps:
    """What one rank does in one round, in this order: allocate, copy, exchange, free.

    ``allocs``: target buffers to allocate before the round; ``copies``: local copies;
    ``sends``/``recvs``: transfer indices to post together (ascending index; a receive
    whose source is STAGED is read from the staged checkpoint, it has no partner);
    ``frees``: source buffers to release after the round. Round -1 only frees (source
    buffers no transfer reads, released before round 0).
    """

    round: int
    allocs: tuple[str, ...] = ()
    copies: tuple[int, ...] = ()
    sends: tuple[int, ...] = ()
    recvs: tuple[int, ...] = ()
    frees: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TransitionGraph:
    """A schedule: the round of every transfer, when each buffer comes and goes, and its cost.

    ``alloc_round[b]``: target buffer b is allocated before that round; ``free_round[b]``:
    source buffer b is freed after that round (FREED_BEFORE: before round 0; KEPT: never).
    ``peak_bytes``: per rank, the most it holds at any moment (module docstring);
    ``round_seconds``/``seconds``: the alpha-beta estimate per round and in total;
    ``held``: per round and rank, the bytes held without the round's transients (sources not
    yet freed + targets allocated); ``limit``: the budget per rank (``_UNBOUNDED``: none);
    ``coalesce``: the size under which transfers were counted as packed on both sides.
    """

    arrays: TransferArrays
    round_of: np.ndarray
    num_rounds: int
    alloc_round: np.ndarray
    free_round: np.ndarray
    peak_bytes: dict[int, int]
    round_seconds: np.ndarray
    seconds: float
    max_messages: int
    held: np.ndarray = None
    limit: np.ndarray = None
    coalesce: int = COALESCE_BYTES

    _by_rank: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def ops_for(self, rank: int) -> list[RoundOps]:
        """The rounds in which ``rank`` does something, in order (see :class:`RoundOps`)."""
        a, mine = self.arrays, self._mine(rank)
        allocs, frees = mine["allocs"], mine["frees"]
        frees = frees[self.free_round[frees] != KEPT]
        groups = {key: mine[key] for key in ("copies", "sends", "recvs")}
        rounds = set(self.alloc_round[allocs].tolist()) | set(self.free_round[frees].tolist())
        for idx in groups.values():
            rounds |= set(self.round_of[idx].tolist())
        out = []
        for k in sorted(rounds):
            ops = {key: tuple(idx[self.round_of[idx] == k].tolist()) for key, idx in groups.items()}
            out.append(
                RoundOps(
                    round=k,
                    allocs=tuple(a.dst_buffers.name[b] for b in allocs[self.alloc_round[allocs] == k].tolist()),
                    frees=tuple(a.src_buffers.name[b] for b in frees[self.free_round[frees] == k].tolist()),
                    **ops,
                )
            )
        return out

    def budget_of(self, rank: int) -> int | None:
        """The budget the graph was planned under for ``rank`` (None: unbounded)."""
        if self.limit is None or rank < 0 or rank >= len(self.limit) or self.limit[rank] >= _UNBOUNDED:
            return None
        return int(self.limit[rank])

    def held_bytes(self, rank: int, round_: int) -> int:
        """Bytes ``rank`` holds during ``round_`` without that round's transients."""
        if self.held is None or not (0 <= round_ < self.held.shape[0]) or rank >= self.held.shape[1]:
            return 0
        return int(self.held[round_, rank])

    def _mine(self, rank: int) -> dict[str, np.ndarray]:
        """Transfer and buffer ids of ``rank``, ascending, from per-rank indexes built once."""
        a = self.arrays
        if not self._by_rank:
            local = a.src == a.dst
            for key, ranks, mask in (
                ("copies", a.dst, local),
                ("sends", a.src, ~local),
                ("recvs", a.dst, ~local),
                ("allocs", a.dst_buffers.rank, None),
                ("frees", a.src_buffers.rank, None),
            ):
                idx = np.arange(len(ranks)) if mask is None else np.flatnonzero(mask)
                order = idx[np.argsort(ranks[idx], kind="stable")]
                self._by_rank[key] = (ranks[order], order)
        out = {}
        for key, (ranks, order) in self._by_rank.items():
            lo, hi = np.searchsorted(ranks, [rank, rank + 1])
            out[key] = order[lo:hi]
        return out


_UNBOUNDED = np.int64(2**62)


def plan_graph(
    arrays: TransferArrays,
    *,
    budget: int | Mapping[int, int] | None = None,
    release_sources: bool = False,
    max_messages: int = 64,
    cost: LinkCost = LinkCost(),
    coalesce: int = COALESCE_BYTES,
    reserve: int = 0,
) -> TransitionGraph:
    """Schedule ``arrays`` into rounds within every rank's memory budget (module docstring).

    ``budget``: bytes per rank, one int for all or a mapping (ranks it omits are
    unbounded); None: unbounded. Raises MemoryBudgetError, naming the rank, the bytes it
    would need and its budget, when a rank's sources alone exceed its budget or when no
    remaining transfer fits; the caller then falls back to the staged path.

    A round is filled in a few vectorized passes rather than one transfer at a time. The
    candidates are the pending transfers whose messages are among the first
    ``2 * max_messages`` pending messages of each rank they touch (local copies always
    are). A pass takes every candidate whose position among the candidates of each of its
    ranks (priority order) is below the rank's free message slots, and whose bytes,
    counted with those of every candidate before it on the rank, fit the rank's headroom
    (a target buffer's allocation is charged to its first candidate) — so the set taken
    never exceeds slots or budget. The highest-priority candidate comes first on all its
    ranks, so every pass takes at least one transfer once candidates that cannot fit even
    alone are dropped.
    """
    if max_messages < 1:
        raise ValueError(f"max_messages must be >= 1, got {max_messages}")
    n = len(arrays)
    ranks = (arrays.src_buffers.rank, arrays.dst_buffers.rank, arrays.dst)
    width = int(max(r.max(initial=-1) for r in (*ranks, arrays.src))) + 1
    present = np.zeros(width, dtype=bool)
    for r in ranks:
        present[r] = True
    limit = _limits(budget, width)
    if reserve:
        limit = np.where(limit < _UNBOUNDED, np.maximum(limit - int(reserve), 0), limit)
    schedule = _Schedule(arrays, limit, release_sources, max_messages, width, coalesce)
    schedule.run()
    num_rounds = max(1, int(schedule.round_of.max(initial=-1)) + 1)
    alloc_round = np.zeros(len(arrays.dst_buffers), dtype=np.int64)
    if n:
        alloc_round[:] = np.iinfo(np.int64).max
        np.minimum.at(alloc_round, arrays.dst_buf, schedule.round_of)
        alloc_round[alloc_round == np.iinfo(np.int64).max] = 0
    free_round = np.full(len(arrays.src_buffers), KEPT, dtype=np.int64)
    if release_sources:
        free_round[:] = FREED_BEFORE
        reads = arrays.src_buf >= 0
        np.maximum.at(free_round, arrays.src_buf[reads], schedule.round_of[reads])
    peak, held = _peaks(arrays, schedule.round_of, alloc_round, free_round, num_rounds, width, coalesce)
    round_seconds = _round_seconds(arrays, schedule.round_of, num_rounds, width, cost)
    return TransitionGraph(
        arrays=arrays,
        round_of=schedule.round_of,
        num_rounds=num_rounds,
        alloc_round=alloc_round,
        free_round=free_round,
        peak_bytes={r: int(peak[r]) for r in np.flatnonzero(present).tolist()},
        round_seconds=round_seconds,
        seconds=float(round_seconds.sum()),
        max_messages=max_messages,
        held=held,
        limit=limit,
        coalesce=coalesce,
    )


def _limits(budget: int | Mapping[int, int] | None, width: int) -> np.ndarray:
    limit = np.full(width, _UNBOUNDED, dtype=np.int64)
    if isinstance(budget, Mapping):
        for r, b in budget.items():
            if 0 <= r < width:
                limit[r] = b
    elif budget is not None:
        limit[:] = budget
    return limit


def _transients(a: TransferArrays, coalesce: int = COALESCE_BYTES) -> tuple[np.ndarray, np.ndarray]:
    """Transient bytes per transfer on the sender and on the receiver (module docstring); a
    staged read's is its claim on its round's shared allowance (the largest claim)."""
    local = a.src == a.dst
    live = a.src != STAGED
    small = live & (a.nbytes < coalesce)
    sender = np.where(~local & live & (~a.src_contig | small), a.nbytes, 0)
    receiver = np.where(live, np.where(~local & (~a.dst_contig | small), a.nbytes, 0), STAGED_PIECE_BYTES)
    return sender, receiver


def _grouped_cummax(values: np.ndarray, group_start: np.ndarray) -> np.ndarray:
    """Inclusive running maximum within runs of non-negative values (as ``_grouped_cumsum``)."""
    if not len(values):
        return values
    group = np.cumsum(group_start == np.arange(len(values)))
    lift = group * (int(values.max()) + 1)  # later runs sit above earlier ones: the maximum restarts
    return np.maximum.accumulate(values + lift) - lift


def _priority(a: TransferArrays, width: int) -> np.ndarray:
    """Transfers in priority order: shift ``(dst - src) mod width``, source buffer, index."""
    n = len(a)
    shift = (a.dst - a.src) % max(width, 1)  # a staged read: (dst + 1) mod width
    keys = [shift, a.src_buf + 1, np.arange(n)]
    widths = [int(k.max(initial=0)).bit_length() for k in keys]
    if sum(widths) > 62:
        return np.lexsort(keys[::-1])
    packed = np.zeros(n, dtype=np.int64)
    for k, w in zip(keys, widths):
        packed = (packed << w) | k
    return np.argsort(packed)  # keys are distinct (the index is in them)


def _grouped_cumsum(values: np.ndarray, group_start: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum within runs; ``group_start[i]``: index where i's run begins."""
    total = np.cumsum(values)
    return total - (total[group_start] - values[group_start])


def _run_starts(keys: np.ndarray) -> np.ndarray:
    """For sorted ``keys``, the index where each element's run of equal keys begins."""
    if not len(keys):
        return np.zeros(0, dtype=np.int64)
    new = np.ones(len(keys), dtype=bool)
    new[1:] = keys[1:] != keys[:-1]
    return np.maximum.accumulate(np.where(new, np.arange(len(keys)), 0))


class _Schedule:
    """The greedy round filling of :func:`plan_graph` (private, mutable)."""

    PASSES = 4  # vectorized passes per round before the round is closed
    EVENTS = ("ev_t", "ev_rank", "ev_msg", "ev_cost", "ev_buf", "ev_staged")
    WINDOW = 2  # candidates: each rank's first WINDOW * max_messages pending messages

    def __init__(self, a: TransferArrays, limit: np.ndarray, release: bool, cap: int, width: int, coalesce: int) -> None:
        n = len(a)
        self.coalesce = coalesce
        self.a, self.limit, self.release, self.cap, self.width = a, limit, release, cap, width
        self.bounded = bool((limit < _UNBOUNDED).any())
        self.round_of = np.full(n, -1, dtype=np.int64)
        self.done = np.zeros(n, dtype=bool)
        self.held = np.zeros(width, dtype=np.int64)
        np.add.at(self.held, a.src_buffers.rank, a.src_buffers.nbytes)
        over = np.flatnonzero(self.held > limit)
        if len(over):
            r = int(over[0])
            raise MemoryBudgetError(
                f"rank {r} holds {int(self.held[r])} bytes of source buffers before the transition, "
                f"{int(self.held[r] - limit[r])} over its budget of {int(limit[r])} bytes"
            )
        self.reads_left = np.bincount(a.src_buf[a.src_buf >= 0], minlength=len(a.src_buffers))
        if release:
            unread = np.flatnonzero(self.reads_left == 0)
            np.subtract.at(self.held, a.src_buffers.rank[unread], a.src_buffers.nbytes[unread])
        self.allocated = np.zeros(len(a.dst_buffers), dtype=bool)
        self._events()

    def _events(self) -> None:
        """One event per (transfer, rank it touches), sorted by (rank, priority).

        A transfer's events, in priority order: its send (if it has a live sender), then
        its receive or local copy; a stable radix sort by rank keeps that order per rank.
        """
        a = self.a
        local = a.src == a.dst
        has_send = ~local & (a.src != STAGED)
        sender, receiver = _transients(a, self.coalesce)
        order = _priority(a, self.width)
        pair = 1 + has_send[order]
        t = np.repeat(order, pair)
        is_send = np.zeros(len(t), dtype=bool)
        is_send[(np.cumsum(pair) - pair)[has_send[order]]] = True
        rank = np.where(is_send, a.src[t], a.dst[t])
        o = np.argsort(rank.astype(np.int16 if self.width < 2**15 else np.int64), kind="stable")
        t, is_send = t[o], is_send[o]
        self.ev_t, self.ev_rank = t.astype(np.int32), rank[o].astype(np.int32)
        self.ev_msg = is_send | ~local[t]
        self.ev_staged = ~is_send & (a.src[t] == STAGED)  # a staged read: its cost shares the round's allowance
        self.ev_cost = np.where(is_send, sender[t], receiver[t])
        self.ev_buf = np.where(is_send, -1, a.dst_buf[t]).astype(np.int32)

    def run(self) -> None:
        k = 0
        while not self.done.all():
            self._round(k)
            k += 1

    def _own_cost(self, cost: np.ndarray, buf: np.ndarray) -> np.ndarray:
        """An event's bytes alone: its transient, plus its target buffer if not yet allocated."""
        if not len(self.allocated):
            return cost
        safe = np.maximum(buf, 0)
        new = (buf >= 0) & ~self.allocated[safe]
        return cost + np.where(new, self.a.dst_buffers.nbytes[safe], 0)

    def _round(self, k: int) -> None:
        keep = ~self.done[self.ev_t]
        for name in self.EVENTS:
            setattr(self, name, getattr(self, name)[keep])
        cand = ~self.done
        eligible = np.ones(len(self.ev_t), dtype=bool)
        if self.bounded:  # transfers that cannot fit even alone wait for frees
            over = self.held[self.ev_rank] + self._own_cost(self.ev_cost, self.ev_buf) > self.limit[self.ev_rank]
            cand[self.ev_t[over]] = False
            eligible = cand[self.ev_t]
            if not eligible.any():
                self._stuck(over)
        starts = _run_starts(self.ev_rank)
        position = _grouped_cumsum((self.ev_msg & eligible).astype(np.int64), starts) - 1
        cand[self.ev_t[self.ev_msg & (position >= self.WINDOW * self.cap)]] = False
        pick = cand[self.ev_t]
        ids = np.flatnonzero(cand)
        ev = {name[3:]: getattr(self, name)[pick] for name in self.EVENTS}
        index = np.empty(len(self.a), dtype=np.int64)
        index[ids] = np.arange(len(ids))
        ev["local"] = index[ev["t"]]
        self._end_round(self._passes(k, ids, ev))

    def _stuck(self, over: np.ndarray) -> None:
        """No pending transfer fits even alone: name the rank closest to fitting."""
        own = self._own_cost(self.ev_cost, self.ev_buf)
        excess = self.held[self.ev_rank] + own - self.limit[self.ev_rank]
        worst = np.full(len(self.a), np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(worst, self.ev_t, excess)
        pending = np.flatnonzero(~self.done)
        t = pending[np.argmin(worst[pending])]
        e = np.flatnonzero(self.ev_t == t)
        e = e[np.argmax(excess[e])]
        r = int(self.ev_rank[e])
        need = int(self.held[r] + own[e])
        raise MemoryBudgetError(
            f"no remaining transfer fits: rank {r} would need {need} bytes ({int(self.held[r])} held + "
            f"{int(own[e])} for transfer {int(t)} of {int(self.a.nbytes[t])} bytes), "
            f"{need - int(self.limit[r])} over its budget of {int(self.limit[r])} bytes"
        )

    def _passes(self, k: int, ids: np.ndarray, ev: dict) -> np.ndarray:
        rank, msg, cost, buf, local, staged = ev["rank"], ev["msg"], ev["cost"], ev["buf"], ev["local"], ev["staged"]
        starts = _run_starts(rank)
        slots = np.full(self.width, self.cap, dtype=np.int64)
        headroom = self.limit - self.held
        reads = np.zeros(self.width, dtype=np.int64)  # per rank, the staged allowance taken this round (largest claim)
        open_ = np.ones(len(ids), dtype=bool)  # candidates not yet taken or dropped
        taken = []
        for _ in range(self.PASSES):
            alive = open_[local]
            bad = msg & (slots[rank] <= 0)
            if self.bounded:
                alone = np.where(staged, np.maximum(cost - reads[rank], 0), cost)
                bad |= self._own_cost(alone, buf) > headroom[rank]
            open_[local[alive & bad]] = False
            alive = open_[local]
            if not alive.any():
                break
            position = _grouped_cumsum((msg & alive).astype(np.int64), starts) - 1
            ok = ~msg | (position < slots[rank])
            if self.bounded:
                fresh = np.flatnonzero(alive & (buf >= 0))
                fresh = fresh[~self.allocated[buf[fresh]]]
                _, first = np.unique(buf[fresh], return_index=True)
                charge = np.where(alive & ~staged, cost, 0)
                charge[fresh[first]] += self.a.dst_buffers.nbytes[buf[fresh[first]]]
                used = reads[rank]
                shared = np.maximum(_grouped_cummax(np.where(alive & staged, cost, 0), starts), used) - used
                ok &= _grouped_cumsum(charge, starts) + shared <= headroom[rank]
            accept = open_.copy()
            accept[local[alive & ~ok]] = False
            now = accept[local]
            np.subtract.at(slots, rank[now & msg], 1)
            if self.bounded:
                np.subtract.at(headroom, rank[now & ~staged], cost[now & ~staged])
                grown = reads.copy()
                np.maximum.at(grown, rank[now & staged], cost[now & staged])
                headroom -= grown - reads
                reads = grown
                headroom -= self._allocate(buf[now & (buf >= 0)])
            open_ &= ~accept
            taken.append(ids[accept])
        out = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
        self.round_of[out] = k
        self.done[out] = True
        return out

    def _allocate(self, bufs: np.ndarray) -> np.ndarray:
        """Mark target buffers allocated; bytes newly allocated per rank."""
        new = np.unique(bufs)
        new = new[~self.allocated[new]]
        self.allocated[new] = True
        grown = np.zeros(self.width, dtype=np.int64)
        np.add.at(grown, self.a.dst_buffers.rank[new], self.a.dst_buffers.nbytes[new])
        self.held += grown
        return grown

    def _end_round(self, taken: np.ndarray) -> None:
        """Count the round's reads; with release, free the source buffers read for the last time."""
        reads = self.a.src_buf[taken]
        reads = reads[reads >= 0]
        np.subtract.at(self.reads_left, reads, 1)
        if self.release and self.bounded:
            emptied = np.unique(reads)
            emptied = emptied[self.reads_left[emptied] == 0]
            np.subtract.at(self.held, self.a.src_buffers.rank[emptied], self.a.src_buffers.nbytes[emptied])


def _peaks(a: TransferArrays, round_of, alloc_round, free_round, rounds: int, width: int, coalesce: int):
    """Per rank, the most bytes held at any moment (the schedule replayed round by round),
    and the (rounds, width) holdings without transients."""
    start = np.zeros(width, dtype=np.int64)
    np.add.at(start, a.src_buffers.rank, a.src_buffers.nbytes)
    delta = np.zeros((rounds + 1) * width, dtype=np.int64)
    freed = free_round != KEPT
    np.subtract.at(delta, (free_round[freed] + 1) * width + a.src_buffers.rank[freed], a.src_buffers.nbytes[freed])
    np.add.at(delta, alloc_round * width + a.dst_buffers.rank, a.dst_buffers.nbytes)
    during = start + np.cumsum(delta.reshape(rounds + 1, width), axis=0)[:rounds]
    held = during.copy()
    sender, receiver = _transients(a, coalesce)
    flat = during.reshape(-1)
    live = a.src != STAGED
    np.add.at(flat, round_of[live] * width + a.src[live], sender[live])
    np.add.at(flat, round_of[live] * width + a.dst[live], receiver[live])
    reads = np.zeros(rounds * width, dtype=np.int64)  # a round's staged reads share one allowance: the largest
    np.maximum.at(reads, round_of[~live] * width + a.dst[~live], receiver[~live])
    flat += reads
    return np.maximum(start, during.max(axis=0)), held


def _round_seconds(a: TransferArrays, round_of, rounds: int, width: int, cost: LinkCost) -> np.ndarray:
    """Alpha-beta time per round: max over ranks of max(send, receive) + local copies."""
    if not len(a):
        return np.zeros(rounds)
    secs = cost.transfer_seconds(a.src, a.dst, a.nbytes)
    local = a.src == a.dst
    sends = ~local & (a.src != STAGED)
    size = rounds * width

    def per_rank(mask, ranks):
        keys = round_of[mask] * width + ranks[mask]
        return np.bincount(keys, weights=secs[mask], minlength=size).reshape(rounds, width)

    busy = np.maximum(per_rank(sends, a.src), per_rank(~local, a.dst)) + per_rank(local, a.dst)
    return busy.max(axis=1)
