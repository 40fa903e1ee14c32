"""Stream executor: a transfer plan run with point-to-point sends between live ranks.

Every rank of the process group calls :func:`execute_stream` with the same plan and
graph (SPMD); plan ranks are global ranks, mapped to group ranks for each P2P op.

Order of work on one rank, and why it cannot deadlock:

0. *Validate, then agree.* Each rank checks what it can see (plan ranks in the group,
   its source buffers, given target buffers) and the group all-gathers the verdicts, so a
   problem anywhere makes EVERY rank raise the same :class:`ProcessGroupError` before a
   byte moves — no rank is left waiting in a receive. On an NCCL group the first call
   then runs one all-reduce so the communicator exists before any subset of ranks posts
   a batched point-to-point (torch's rule for ``batch_isend_irecv``).
1. *Rounds* come from the transition graph (``graph.ops_for(rank)``, global round order).
   Within a round a rank allocates its new target buffers (``torch.empty``, just in time),
   posts ALL its receives, then packs and sends each message at once (packing of the
   next message overlaps the previous send), does its local copies while bytes move,
   then waits for the receives (unpacking each as it lands) and finally the sends.
   A rank only blocks after every receive of its round is posted, and a send only needs
   its receiver to reach the same round; by induction on rounds every op completes.
   On gloo, strided sends are packed into a ring of ``SEND_SLOTS`` reused slots; reusing
   a slot waits for the send that last held it, which only needs the peer's receive,
   posted when the peer entered the round, so that wait cannot deadlock either (local
   copies fill it). The graph still counts a strided send's whole size on the sender,
   an upper bound of the ring's (each slot is as large as its largest message). NCCL
   launches a round's ops together, so there every packed message has its own staging.
2. *Messages.* A rank pair's transfers in a round go in one fixed order: those whose
   source region is contiguous (sent as their own view, no copy, so bytes flow at once),
   then one packed byte message of all transfers under ``COALESCE_BYTES`` (each piece at
   an ``ALIGN``-byte offset, so mixed dtypes view cleanly), then strided ones (packed just
   before their send); plan order within each class. Sender and receiver derive the same
   list from the same plan, and a per-(peer, direction) counter gives each message a tag
   unique over the whole transition: gloo matches on tags; on NCCL (tags ignored) a round
   is one ``batch_isend_irecv`` whose per-peer order is this same order. On gloo a
   transfer strided on either side and larger than ``CHUNK_BYTES`` travels as slices of
   its first non-unit dimension, so packing, sending and unpacking pipeline within it and
   a send slot stays small. A contiguous target region is received in place; strided
   regions go through a staging arena sized once per round and reused across rounds (and
   calls, if the caller keeps it: first-touch allocation costs 0.3–0.6 s/GiB on this CPU).
3. *Checksums* (optional): per message, crc32 of the bytes on the wire; the sender's
   crcs for a peer travel after that peer's data as one int64 tensor per round. A bad
   message is recorded, the schedule still runs to its end (so nobody hangs), and the
   group then agrees, every rank raising the same :class:`TransferError`.
4. *Sources* are never touched unless ``release_sources=True``, in which case the graph's
   frees pop them from ``src_buffers`` (the caller handed them over) after their round.

The result is a :class:`StreamResult`: the dict ``buffer name -> tensor`` of this rank's
target buffers, with ``.stats`` (:class:`StreamStats`): bytes by kind, seconds by phase,
and one :class:`MessageSample` per received message (link, bytes, seconds of service on
that link); ``stats.link_samples(cost)`` feeds ``graph.calibrate`` for the alpha-beta model.
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterable, Mapping, MutableMapping, Sequence

import torch
import torch.distributed as dist

from .arrays import region_is_contiguous
from .errors import ProcessGroupError, TransferError
from .layout import DTYPES
from .plan import STAGED, TransferPlan

COALESCE_BYTES = 1 << 20
"""Transfers smaller than this travel packed with the pair's other small ones."""
CHUNK_BYTES = 4 << 20
"""A strided transfer larger than this travels as several messages of about this size."""
SEND_SLOTS = 4
"""Gloo: strided sends are packed into this many reused slots (a ring), not one buffer each."""
ALIGN = 64
"""Byte alignment of pieces inside packed messages and the staging arena."""


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True, slots=True)
class MessageSample:
    """One received message: ``nbytes`` over link ``src -> dst`` took ``seconds``.

    ``seconds`` runs from the later of (receive posted, previous message on the same link
    done) to this message observed done, i.e. the link's service time for it, which is
    what an alpha-beta model ``alpha + nbytes / beta`` predicts.
    """

    src: int
    dst: int
    nbytes: int
    seconds: float
    round: int
    transfers: int


@dataclass(kw_only=True, slots=True)
class StreamStats:
    """What one rank did: bytes per kind (``bytes_staged``: read from a staged checkpoint
    by :func:`nereus.reshard.execute.execute`), wall time, messages received."""

    rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    bytes_staged: int = 0
    staging_bytes: int = 0
    seconds: float = 0.0
    samples: list[MessageSample] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Seconds of this rank's own work by phase: validate (incl. the agreement), alloc,
    pack, post, copy (local), wait, unpack, checksum — where the wall time went."""

    def link_samples(self, cost) -> list[tuple[str, int, float]]:
        """``(link class, bytes, seconds)`` per received message, for ``graph.calibrate``
        (``cost`` is the graph's ``LinkCost``, which knows ranks per node)."""
        return [(cost.link(s.src, s.dst), s.nbytes, s.seconds) for s in self.samples]


class StreamResult(dict):
    """This rank's target buffers (``name -> tensor``), plus ``.stats``."""

    stats: StreamStats


# ---------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Message:
    """Transfers (plan indices) travelling together between this rank and ``peer``.

    ``offsets`` are the byte offsets of the pieces in a packed message; empty for a
    single transfer sent as its own view. ``part``: ``(dim, start, length)`` when the
    message carries only that slice of its one transfer's region (a chunk).
    """

    peer: int
    tag: int
    transfers: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int
    part: tuple[int, int, int] = ()

    @property
    def packed(self) -> bool:
        return bool(self.offsets)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_messages(
    plan: TransferPlan,
    indices: Iterable[int],
    *,
    peer_of: str,
    tags: dict[int, int],
    coalesce: int = COALESCE_BYTES,
    chunk: int = 0,
) -> dict[int, list[Message]]:
    """Group one round's transfers into messages per peer, in sending order (pure).

    ``peer_of`` is ``"dst_rank"`` for sends and ``"src_rank"`` for receives; ``tags``
    maps peer -> next tag and is advanced; transfers under ``coalesce`` bytes are packed
    together (0: never). Order per peer: transfers whose source region
    is contiguous and keeps its dtype (sent without packing, so bytes flow at once; a
    dtype cast is packed, converted, like a strided region), then the packed group of
    small transfers, then strided ones (packed just before sending); plan order within
    each class. A transfer strided on either side and larger than ``chunk`` bytes (0:
    never split) goes as consecutive slices of its first non-unit dimension of about
    ``chunk`` bytes each: the sender packs each slice into a reused slot, and the receiver
    unpacks each slice while later ones travel. Sender and receiver compute the same list
    from the same plan.
    """
    by_peer: dict[int, list[int]] = defaultdict(list)
    for i in sorted(indices):
        t = plan.transfers[i]
        if t.nbytes:
            by_peer[getattr(t, peer_of)].append(i)
    out: dict[int, list[Message]] = {}
    for peer, idx in sorted(by_peer.items()):
        small = [i for i in idx if plan.transfers[i].nbytes < coalesce]
        big = [i for i in idx if plan.transfers[i].nbytes >= coalesce]
        if len(small) == 1:
            big, small = sorted(big + small), []
        contiguous = {i: _contiguous(plan, i, "src") and not plan.casts(plan.transfers[i]) for i in big}
        direct = [[i] for i in big if contiguous[i]]
        strided = [[i] for i in big if not contiguous[i]]
        msgs = []

        def add(transfers, offsets, nbytes, part=()):
            tag = tags.get(peer, 0)
            tags[peer] = tag + 1
            msgs.append(Message(peer, tag, transfers, offsets, nbytes, part))

        for group in [*direct, *([small] if small else []), *strided]:
            if len(group) == 1:
                for part, nbytes in _parts(plan, group[0], chunk, contiguous[group[0]]):
                    add((group[0],), (), nbytes, part)
                continue
            offsets, end = [], 0
            for i in group:
                offsets.append(end)
                end = _aligned(end + plan.transfers[i].nbytes)
            add(tuple(group), tuple(offsets), end)
        out[peer] = msgs
    return out


def _parts(plan: TransferPlan, i: int, chunk: int, src_contiguous: bool) -> list[tuple[tuple[int, ...], int]]:
    """``[(part, nbytes)]`` of transfer ``i``: itself (``part == ()``), or slices of its
    first non-unit dimension of about ``chunk`` bytes when it is strided and larger."""
    t = plan.transfers[i]
    lengths = tuple(t.item.lengths)
    if not chunk or t.nbytes <= chunk or (src_contiguous and _contiguous(plan, i, "dst")):
        return [((), t.nbytes)]
    dim = next(d for d, n in enumerate(lengths) if n > 1)  # a strided region has one
    step = t.nbytes // lengths[dim]  # bytes per index of ``dim``
    rows = max(1, chunk // step)
    return [((dim, a, min(rows, lengths[dim] - a)), min(rows, lengths[dim] - a) * step) for a in range(0, lengths[dim], rows)]


def _contiguous(plan: TransferPlan, i: int, side: str) -> bool:
    """Whether transfer ``i``'s region is one span of its ``side`` (``"src"``/``"dst"``) buffer."""
    t = plan.transfers[i]
    if side == "src":
        shape = plan.src_buffers[t.src_rank][t.src_buffer].shape
    else:
        shape = plan.dst_buffers[t.dst_rank][t.dst_buffer].shape
    return region_is_contiguous(tuple(t.item.lengths), shape)


# ------------------------------------------------------------------------------ rounds


def rounds_for(plan: TransferPlan, graph, rank: int) -> list:
    """The graph's rounds for ``rank``; ``graph=None``: an unbounded graph of the plan."""
    if graph is None:
        from .arrays import arrays_from_plan
        from .graph import plan_graph

        graph = plan_graph(arrays_from_plan(plan))
    return list(graph.ops_for(rank))


# -------------------------------------------------------------------------- validation


def stream_ranks(plan: TransferPlan) -> set[int]:
    """Global ranks that send or receive a streamed (non-staged) transfer."""
    return {r for t in plan.transfers if t.src_rank != STAGED for r in (t.src_rank, t.dst_rank)}


def group_ranks(group) -> list[int]:
    """Global ranks of ``group`` (None: the default group), in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def check_stream_inputs(
    plan: TransferPlan,
    rounds: Sequence,
    src_buffers: Mapping[str, torch.Tensor],
    dst_buffers: Mapping[str, torch.Tensor] | None,
    *,
    rank: int,
    members: Sequence[int],
) -> str | None:
    """What is wrong on this rank (None: nothing); reads no bytes, moves none."""
    problems = []
    if dist.get_rank() != rank:
        problems.append(f"was called with rank={rank} but is global rank {dist.get_rank()}")
    outside = sorted(stream_ranks(plan) - set(members))
    if outside:
        problems.append(f"the plan names rank(s) {outside}, which are not in the process group (global ranks {list(members)})")
    specs = plan.src_buffers.get(rank, {})
    needed = {plan.transfers[i].src_buffer for ops in rounds for i in (*ops.copies, *ops.sends)}
    for name in sorted(needed):
        problems += _check_buffer("source", name, src_buffers.get(name), specs.get(name), rank)
    targets = plan.dst_buffers.get(rank, {})
    for name, tensor in (dst_buffers or {}).items():
        problems += _check_buffer("target", name, tensor, targets.get(name), rank)
    if len(problems) > 4:
        problems = problems[:4] + [f"{len(problems) - 4} more problems"]
    return "; ".join(problems) or None


def _check_buffer(side: str, name: str, tensor, spec, rank: int) -> list[str]:
    if spec is None:
        return [f"{side} buffer {name!r} is not in the plan's {side} buffers of rank {rank}"]
    if tensor is None:
        return [f"{side} buffer {name!r} ({list(spec.shape)} {spec.dtype}) is missing"]
    if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != DTYPES[spec.dtype]:
        return [
            f"{side} buffer {name!r} is {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}, "
            f"the plan needs {list(spec.shape)} {spec.dtype}"
        ]
    if not tensor.is_contiguous():
        return [f"{side} buffer {name!r} is not contiguous"]
    return []


def agree(error: tuple[str, str] | None, *, group, rank: int, members: Sequence[int]) -> None:
    """All-gather each rank's ``(error class name, message)``; if any rank failed, raise
    the first failing rank's class on EVERY rank, with all messages."""
    verdicts: list = [None] * len(members)
    dist.all_gather_object(verdicts, error, group=group)
    failed = [(r, v) for r, v in zip(members, verdicts) if v is not None]
    if not failed:
        return
    from . import errors

    cls = getattr(errors, failed[0][1][0], ProcessGroupError)
    by_message: dict[str, list[int]] = {}
    for r, (_, msg) in failed:
        by_message.setdefault(msg, []).append(r)
    detail = "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {msg}" for msg, rs in by_message.items())
    raise cls(f"reshard rejected on every rank before any byte moved — {detail}")


# ----------------------------------------------------------------------------- executor


class StagingArena:
    """One reusable uint8 staging tensor, carved per round at ALIGN-byte offsets.

    It grows to the largest round's strided bytes and keeps its (already touched) pages:
    a caller that reshards repeatedly (weight sync every step) passes the same arena to
    skip first-touch allocation (~0.33 s/GiB on CPU); ``release()`` gives the memory back.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.tensor = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.used = 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def release(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8, device=self.device)

    def reserve(self, nbytes: int) -> None:
        self.used = 0
        if nbytes > self.tensor.numel():
            self.tensor = torch.empty(0, dtype=torch.uint8, device=self.device)  # free the old one first
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def take(self, nbytes: int) -> torch.Tensor:
        out = self.tensor.narrow(0, self.used, nbytes)
        self.used = _aligned(self.used + nbytes)
        return out


def crc32(t: torch.Tensor) -> int:
    """crc32 of a contiguous tensor's bytes (copied to host first if on a device)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())


@dataclass(slots=True)
class _Op:
    """One posted message: ``tensor`` travels; ``views`` are its transfers' regions;
    ``packed``: it travels through staging (pack before sending / unpack on arrival)."""

    kind: str
    msg: Message | None  # None: the round's checksum tensor for this peer
    peer: int
    tag: int
    tensor: torch.Tensor
    views: list[torch.Tensor]
    packed: bool
    work: object = None
    posted: float = 0.0
    slot: int = -1  # a strided send's slot in the round's ring (-1: its own staging)
    wire: list[torch.dtype] = field(default_factory=list)  # per view, its dtype on the wire (the target's)

    def pack(self) -> None:
        _copy_pieces(self, to_wire=True)

    def unpack(self) -> None:
        _copy_pieces(self, to_wire=False)


def _copy_pieces(op: _Op, *, to_wire: bool) -> None:
    """Pack (``to_wire``: views -> message bytes, casting to the wire dtype) or unpack."""
    offsets = op.msg.offsets or (0,)
    for off, view, dtype in zip(offsets, op.views, op.wire or [v.dtype for v in op.views]):
        raw = op.tensor.narrow(0, off, view.numel() * dtype.itemsize)
        wire = raw.view(dtype).view(view.shape)
        (wire.copy_(view) if to_wire else view.copy_(wire))


@dataclass(kw_only=True, slots=True)
class _Ctx:
    plan: TransferPlan
    rank: int
    group: object
    group_rank: dict[int, int]
    src: MutableMapping[str, torch.Tensor]
    dst: dict[str, torch.Tensor]
    arena: StagingArena
    checksums: bool
    timeout: float
    nccl: bool
    release: bool
    coalesce: int
    chunk: int
    stats: StreamStats
    send_tags: dict[int, int] = field(default_factory=dict)
    recv_tags: dict[int, int] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)


def _names(ctx: _Ctx, msg: Message, limit: int = 4) -> str:
    """The tensors a message carries, for error messages (the first ``limit``)."""
    names = sorted({ctx.plan.transfers[i].tensor for i in msg.transfers})
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def _tick(ctx: _Ctx, phase: str, since: float) -> float:
    """Add the time since ``since`` to ``phase``; returns now."""
    now = time.perf_counter()
    ctx.stats.phases[phase] += now - since
    return now


def _alloc(ctx: _Ctx, names: Iterable[str]) -> None:
    t0 = time.perf_counter()
    specs = ctx.plan.dst_buffers.get(ctx.rank, {})
    for name in names:
        if name not in ctx.dst:
            spec = specs[name]
            ctx.dst[name] = torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=ctx.arena.device)
    _tick(ctx, "alloc", t0)


def _build(ctx: _Ctx, kind: str, msgs: Iterable[Message]) -> list[_Op]:
    """Ops for messages: a lone contiguous region travels as itself, others packed."""
    ops = []
    for m in msgs:
        t = [ctx.plan.transfers[i] for i in m.transfers]
        views = [x.src_view(ctx.src) for x in t] if kind == "send" else [x.dst_view(ctx.dst) for x in t]
        if m.part:
            views = [views[0].narrow(*m.part)]
        wire = [DTYPES[ctx.plan.layouts[x.tensor].dtype] for x in t]  # the target's dtype
        packed = m.packed or not views[0].is_contiguous() or views[0].dtype != wire[0]
        ops.append(_Op(kind, m, m.peer, m.tag, views[0] if not packed else None, views, packed, wire=wire))
    return ops


def _round_ops(ctx: _Ctx, ops) -> tuple[list[_Op], list[_Op], list[torch.Tensor]]:
    """This round's receives, sends (peers in rotated order) and send ring, staging carved out.

    On gloo a strided send (a chunk of at most about ``ctx.chunk`` bytes, see
    :func:`plan_messages`) is packed into one of ``SEND_SLOTS`` ring slots, reused once the
    send that held it completes; NCCL launches a round's ops together, so there every
    packed message has its own staging. Receives always have their own (posted at once).
    """
    plan = ctx.plan
    recv_ids = [i for i in ops.recvs if plan.transfers[i].src_rank != STAGED]
    _alloc(ctx, ops.allocs)
    _alloc(ctx, {plan.transfers[i].dst_buffer for i in (*recv_ids, *ops.copies)})
    chunk = 0 if ctx.nccl else ctx.chunk
    by_src = plan_messages(plan, recv_ids, peer_of="src_rank", tags=ctx.recv_tags, coalesce=ctx.coalesce, chunk=chunk)
    by_dst = plan_messages(plan, ops.sends, peer_of="dst_rank", tags=ctx.send_tags, coalesce=ctx.coalesce, chunk=chunk)
    world = max(len(ctx.group_rank), 1)
    recvs = _build(ctx, "recv", (m for p in sorted(by_src) for m in by_src[p]))
    sends = _build(ctx, "send", (m for p in sorted(by_dst, key=lambda p: (p - ctx.rank) % world) for m in by_dst[p]))
    ringed = [op for op in sends if op.packed and not op.msg.packed] if chunk else []
    slots = min(SEND_SLOTS, len(ringed))
    for n, op in enumerate(ringed):
        op.slot = n % slots
    # slot k is as large as the largest of its messages, so the ring never needs more
    # than separate buffers would: the graph's per-transfer count stays an upper bound
    sizes = [max(_aligned(op.msg.nbytes) for op in ringed[k::slots]) for k in range(slots)]
    own = [op for op in (*recvs, *sends) if op.packed and op.slot < 0]
    staged = sum(_aligned(op.msg.nbytes) for op in own) + sum(sizes)
    ctx.arena.reserve(staged)
    ctx.stats.staging_bytes = max(ctx.stats.staging_bytes, staged)
    for op in own:
        op.tensor = ctx.arena.take(op.msg.nbytes)
    ring = [ctx.arena.take(n) for n in sizes]
    if ctx.checksums:  # one int64 crc per message, per peer, after the data (next tag)
        device = ctx.arena.device
        for peers, tags, kind, out in ((by_src, ctx.recv_tags, "recv", recvs), (by_dst, ctx.send_tags, "send", sends)):
            for p in peers:
                out.append(_Op(kind, None, p, tags[p], torch.zeros(len(peers[p]), dtype=torch.int64, device=device), [], False))
                tags[p] += 1
    return recvs, sends, ring


def _post(ctx: _Ctx, op: _Op, batch: list) -> None:
    """isend/irecv at once (gloo), or queue for one batch_isend_irecv (NCCL)."""
    peer = ctx.group_rank[op.peer]
    op.posted = time.perf_counter()
    if ctx.nccl:
        batch.append(dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor, group=ctx.group, tag=op.tag, group_peer=peer))
    elif op.kind == "send":
        op.work = dist.isend(op.tensor, group=ctx.group, tag=op.tag, group_dst=peer)
    else:
        op.work = dist.irecv(op.tensor, group=ctx.group, tag=op.tag, group_src=peer)


def _run_round(ctx: _Ctx, ops) -> None:
    """One round: allocate, post every receive, pack and send each message at once,
    local copies while bytes move, then wait (unpacking each arrival), then free."""
    recvs, sends, ring = _round_ops(ctx, ops)
    batch: list = []
    deadline = time.monotonic() + ctx.timeout
    t = time.perf_counter()
    for op in recvs:
        _post(ctx, op, batch)
    crcs: dict[int, list[int]] = defaultdict(list)
    holder: list[_Op | None] = [None] * len(ring)
    copies = list(reversed(ops.copies))
    for op in sends:
        if op.msg is None:  # the peer's checksum tensor: its data messages are all posted
            op.tensor.copy_(torch.tensor(crcs[op.peer], dtype=torch.int64))
        elif op.packed:
            t = _tick(ctx, "post", t)
            if op.slot >= 0:  # the slot's last send must be done; its peer posted its receives
                last = holder[op.slot]  # at the start of this round, so it completes
                while last is not None and copies and not last.work.is_completed():
                    _copy(ctx, copies.pop())  # local copies fill the wait
                t = _tick(ctx, "copy", t)
                if last is not None:
                    _wait(ctx, last, deadline, [])
                    t = _tick(ctx, "slot", t)
                holder[op.slot] = op
                op.tensor = ring[op.slot].narrow(0, 0, op.msg.nbytes)
            op.pack()
            t = _tick(ctx, "pack", t)
        if ctx.checksums and op.msg is not None:
            crcs[op.peer].append(crc32(op.tensor))
        _post(ctx, op, batch)
        ctx.stats.bytes_sent += op.msg.nbytes if op.msg else 0
    if batch:
        for op, work in zip((*recvs, *sends), dist.batch_isend_irecv(batch)):
            op.work = work
    t = _tick(ctx, "post", t)
    while copies:
        _copy(ctx, copies.pop())
    _tick(ctx, "copy", t)
    _complete(ctx, ops.round, recvs, sends)
    for name in ops.frees if ctx.release else ():
        ctx.src.pop(name, None)


def _copy(ctx: _Ctx, i: int) -> None:
    """Local transfer ``i``: a copy between this rank's views."""
    tr = ctx.plan.transfers[i]
    tr.dst_view(ctx.dst).copy_(tr.src_view(ctx.src))
    ctx.stats.bytes_copied += tr.nbytes


def _complete(ctx: _Ctx, round_: int, recvs: list[_Op], sends: list[_Op]) -> None:
    """Wait for the round's messages in posting order; unpack, time and check each."""
    deadline = time.monotonic() + ctx.timeout
    everything = [*recvs, *sends]
    link_free: dict[int, float] = {}
    got: dict[int, list[int]] = defaultdict(list)
    t = time.perf_counter()
    for n, op in enumerate(everything):
        _wait(ctx, op, deadline, everything[n + 1 :])
        t = _tick(ctx, "wait", t)
        if op.kind == "send":
            continue
        if op.msg is None:
            _compare(ctx, round_, op, [o for o in recvs if o.peer == op.peer and o.msg], got[op.peer])
            continue
        now = time.perf_counter()
        start = max(op.posted, link_free.get(op.peer, op.posted))
        link_free[op.peer] = now
        m = op.msg
        ctx.stats.samples.append(
            MessageSample(src=m.peer, dst=ctx.rank, nbytes=m.nbytes, seconds=now - start, round=round_, transfers=len(m.transfers))
        )
        ctx.stats.bytes_received += m.nbytes
        if ctx.checksums:
            got[op.peer].append(crc32(op.tensor))
            t = _tick(ctx, "checksum", t)
        if op.packed:
            op.unpack()
            t = _tick(ctx, "unpack", t)


def _compare(ctx: _Ctx, round_: int, crc_op: _Op, data: list[_Op], got: list[int]) -> None:
    for op, want, have in zip(data, crc_op.tensor.tolist(), got):
        if want != have:
            ctx.bad.append(
                f"message {op.tag} from rank {op.peer} to rank {ctx.rank} (round {round_}, tensors "
                f"{_names(ctx, op.msg)}) has crc32 {have:#010x}, the sender's was {want:#010x}"
            )


def _wait(ctx: _Ctx, op: _Op, deadline: float, later: list[_Op]) -> None:
    """``op.work.wait`` until ``deadline``, once per op (gloo counts completions: a second
    wait on the same work would block); a timeout or a failed peer is a TransferError
    naming the peer, the tensors, and every message of the round not yet seen complete."""
    if op.work is None:
        return
    try:
        op.work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        op.work = None
    except RuntimeError as e:
        what = "checksums" if op.msg is None else _names(ctx, op.msg)
        rest = [f"{o.kind} {'from' if o.kind == 'recv' else 'to'} rank {o.peer} ({_names(ctx, o.msg, 2)})" for o in later if o.msg]
        raise TransferError(
            f"rank {ctx.rank}: {op.kind} of {what} {'from' if op.kind == 'recv' else 'to'} rank {op.peer} failed or "
            f"timed out ({ctx.timeout:g} s per round): {e}. Also not complete: {'; '.join(rest) or 'nothing else'}"
        ) from e


def execute_stream(
    plan: TransferPlan,
    graph,
    src_buffers: Mapping[str, torch.Tensor],
    *,
    rank: int,
    group=None,
    dst_buffers: MutableMapping[str, torch.Tensor] | None = None,
    checksums: bool = False,
    timeout: float = 300.0,
    release_sources: bool = False,
    staging: StagingArena | None = None,
    coalesce_bytes: int = COALESCE_BYTES,
    chunk_bytes: int = CHUNK_BYTES,
    extra_error: tuple[str, str] | None = None,
) -> StreamResult:
    """Run this rank's part of ``plan`` over ``group`` (None: the default group).

    ``graph``: a TransitionGraph (``ops_for(rank)``); None plans one without a budget.
    ``dst_buffers``: target buffers that already exist (filled in place; others are
    allocated). ``timeout``: seconds each round may take once its ops are posted.
    ``staging``: an arena to reuse across calls (None: a fresh one for this call).
    ``coalesce_bytes``: transfers below this share a packed message per peer (0: never).
    ``chunk_bytes``: on gloo, strided transfers above this travel in slices of about
    this size through the send ring (0: whole, each packed message in its own staging).
    ``extra_error``: a caller's own pre-check verdict ``(error class name, message)``,
    folded into the group's agreement (see :mod:`nereus.reshard.execute`).
    Every rank of the group must call this, even with nothing to do.
    """
    t_start = time.perf_counter()
    members = group_ranks(group)
    if dist.get_rank() not in members:
        raise ProcessGroupError(f"rank {dist.get_rank()} is not in the process group {members} it was asked to reshard over")
    rounds = rounds_for(plan, graph, rank)
    error = check_stream_inputs(plan, rounds, src_buffers, dst_buffers, rank=rank, members=members)
    sizes = [f"{k}={v} is negative" for k, v in (("coalesce_bytes", coalesce_bytes), ("chunk_bytes", chunk_bytes)) if v < 0]
    error = "; ".join(filter(None, [error, *sizes])) or None
    verdict = extra_error
    if error:
        verdict = ("ProcessGroupError", error + (f"; {extra_error[1]}" if extra_error else ""))
    agree(verdict, group=group, rank=rank, members=members)
    _ready_nccl(group)
    stats = StreamStats()
    stats.phases["validate"] = time.perf_counter() - t_start

    ctx = _Ctx(
        plan=plan,
        rank=rank,
        group=group,
        group_rank={g: i for i, g in enumerate(members)},
        src=src_buffers,
        dst=dict(dst_buffers or {}),
        arena=staging if staging is not None else StagingArena(_device(src_buffers, dst_buffers)),
        checksums=checksums,
        timeout=timeout,
        nccl=_device(src_buffers, dst_buffers).type == "cuda" and "cuda:nccl" in dist.get_backend_config(group),
        release=release_sources,
        coalesce=coalesce_bytes,
        chunk=chunk_bytes,
        stats=stats,
    )
    for ops in rounds:
        _run_round(ctx, ops)
        ctx.stats.rounds += 1
    _alloc(ctx, plan.dst_buffers.get(rank, {}))
    if checksums:  # every rank learns of every bad message, and all raise together
        verdicts: list = [None] * len(members)
        dist.all_gather_object(verdicts, "; ".join(ctx.bad) or None, group=group)
        failed = [f"rank {r}: {v}" for r, v in zip(members, verdicts) if v]
        if failed:
            raise TransferError("checksum mismatch after streaming — " + "; ".join(failed))
    if dst_buffers is not None:
        dst_buffers.update(ctx.dst)
    ctx.stats.seconds = time.perf_counter() - t_start
    ctx.stats.phases = dict(ctx.stats.phases)
    result = StreamResult(ctx.dst)
    result.stats = ctx.stats
    return result


_NCCL_READY: dict[int, object] = {}
"""Groups whose NCCL communicator exists, by id (the value pins the group so ids stay unique)."""


def _ready_nccl(group) -> None:
    """Create the group's NCCL communicator with one tiny all-reduce, once per group.

    torch.distributed: when ``batch_isend_irecv`` is the first NCCL call on a group, every
    rank of the group must take part, or the behaviour is undefined (a hang); a transition's
    rounds often involve only some ranks. Every rank calls ``execute_stream`` (its contract)
    and reads the same backend config, so every rank runs this collective or none does.
    """
    pg = group if group is not None else dist.group.WORLD
    if id(pg) in _NCCL_READY or "cuda:nccl" not in dist.get_backend_config(group):
        return
    dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())), group=group)
    _NCCL_READY[id(pg)] = pg


def _device(*maps: Mapping[str, torch.Tensor] | None) -> torch.device:
    """The device of the first buffer given (CPU when there is none)."""
    for m in maps:
        for t in (m or {}).values():
            return t.device
    return torch.device("cpu")
