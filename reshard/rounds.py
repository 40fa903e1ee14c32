"""The round engine: one rank's part of a transition graph, round by round.

Within a round a rank allocates its new target buffers (``torch.empty``, just in time),
posts ALL its receives, then packs and sends each message at once (packing of the next
message overlaps the previous send), does its local copies and its staged reads (the
regions the graph placed in this round) while bytes move, then waits for the receives
(unpacking each as it lands) and finally the sends. A rank only blocks after every
receive of its round is posted, and a send only needs its receiver to reach the same
round; by induction on rounds every op completes (graph.py).

On gloo, strided sends are packed into a ring of ``SEND_SLOTS`` reused slots; reusing a
slot waits for the send that last held it, which only needs the peer's receive, posted
when the peer entered the round, so that wait cannot deadlock either (local copies fill
it). On NCCL a round's ops go out as ONE ``batch_isend_irecv`` with its own staging per
packed message, and the batch is ONE coalesced work: it is awaited once, and the round's
samples are one per peer (its bytes over the batch's time, ``coalesced=True``).

Memory: staging comes from a :class:`StagingArena` carved per round. When the graph had a
budget, an arena larger than this round needs is given back before the round if keeping
it would lift the rank above the budget (the graph's holdings of that round plus the
arena), so a kept arena never pushes a rank past the budget the graph was given.

Checksums (optional): per message, CRC32C of the bytes on the wire; the sender's checksums
for a peer travel after that peer's data as one int64 tensor per round. A bad message or a
failed staged read is recorded, the schedule still runs to its end (so nobody hangs), and
the group then agrees (``stream.execute_stream``), every rank raising the same error.
Every wait runs against the transition's one :class:`~.transport.Deadline`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, MutableMapping

import torch

from .checksum import tensor_crc32c
from .errors import TransferError, TransitionTimeout
from .layout import DTYPES
from .messages import Message, aligned, plan_messages
from .plan import STAGED, TransferPlan
from .transport import Deadline, Transport

SEND_SLOTS = 4
"""Gloo: strided sends are packed into this many reused slots (a ring), not one buffer each."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MessageSample:
    """One received message: ``nbytes`` over link ``src -> dst`` took ``seconds``.

    ``seconds`` runs from the later of (receive posted, previous message on the same link
    done) to this message observed done, i.e. the link's service time for it, which is
    what an alpha-beta model ``alpha + nbytes / beta`` predicts. ``coalesced``: NCCL ran
    the round as one batch, so the sample is a peer's bytes of the round over the whole
    batch's time (an upper bound of the link's).
    """

    src: int
    dst: int
    nbytes: int
    seconds: float
    round: int
    transfers: int
    coalesced: bool = False


@dataclass(kw_only=True, slots=True)
class StreamStats:
    """What one rank did: bytes per kind (``bytes_staged``: read from a staged checkpoint),
    wall time, messages received, the largest staging of a round."""

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
    pack, post, copy (local), staged, wait, unpack, checksum — where the wall time went."""


class StagingArena:
    """One reusable uint8 staging tensor, carved per round at ALIGN-byte offsets.

    It grows to the largest round's staging and keeps its (already touched) pages: a
    caller that reshards repeatedly (weight sync every step) passes the same arena to
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
        self.used = aligned(self.used + nbytes)
        return out


@dataclass(slots=True)
class Op:
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


def _copy_pieces(op: Op, *, to_wire: bool) -> None:
    """Pack (``to_wire``: views -> message bytes, casting to the wire dtype) or unpack."""
    offsets = op.msg.offsets or (0,)
    for off, view, dtype in zip(offsets, op.views, op.wire or [v.dtype for v in op.views]):
        raw = op.tensor.narrow(0, off, view.numel() * dtype.itemsize)
        wire = raw.view(dtype).view(view.shape)
        (wire.copy_(view) if to_wire else view.copy_(wire))


@dataclass(kw_only=True, slots=True)
class Ctx:
    """One rank's state through a transition."""

    plan: TransferPlan
    rank: int
    group: object
    group_rank: dict[int, int]
    src: MutableMapping[str, torch.Tensor]
    dst: dict[str, torch.Tensor]
    arena: StagingArena
    transport: Transport
    deadline: Deadline
    checksums: bool
    release: bool
    coalesce: int
    chunk: int
    stats: StreamStats
    base_held: Callable[[int], int] | None = None  # the graph's holdings of a round (budgeted graphs)
    limit: int | None = None
    staged: Callable[[list[int], dict], int] | None = None  # loads this rank's staged transfers of a round
    crc: Callable[[torch.Tensor], int] = tensor_crc32c
    send_tags: dict[int, int] = field(default_factory=dict)
    recv_tags: dict[int, int] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)

    @property
    def nccl(self) -> bool:
        return self.transport.coalesced


def names(ctx: Ctx, msg: Message, limit: int = 4) -> str:
    """The tensors a message carries, for error messages (the first ``limit``)."""
    found = sorted({ctx.plan.transfers[i].tensor for i in msg.transfers})
    more = f" and {len(found) - limit} more" if len(found) > limit else ""
    return ", ".join(repr(n) for n in found[:limit]) + more


def _tick(ctx: Ctx, phase: str, since: float) -> float:
    now = time.perf_counter()
    ctx.stats.phases[phase] += now - since
    return now


def alloc(ctx: Ctx, buffers: Iterable[str]) -> None:
    t0 = time.perf_counter()
    specs = ctx.plan.dst_buffers.get(ctx.rank, {})
    for name in buffers:
        if name not in ctx.dst:
            spec = specs[name]
            ctx.dst[name] = torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=ctx.transport.device)
    _tick(ctx, "alloc", t0)


def _build(ctx: Ctx, kind: str, msgs: Iterable[Message]) -> list[Op]:
    """Ops for messages: a lone contiguous region travels as itself, others packed."""
    ops = []
    for m in msgs:
        t = [ctx.plan.transfers[i] for i in m.transfers]
        views = [x.src_view(ctx.src) for x in t] if kind == "send" else [x.dst_view(ctx.dst) for x in t]
        if m.part:
            views = [views[0].narrow(*m.part)]
        wire = [DTYPES[ctx.plan.layouts[x.tensor].dtype] for x in t]  # the target's dtype
        packed = m.packed or not views[0].is_contiguous() or views[0].dtype != wire[0]
        ops.append(Op(kind, m, m.peer, m.tag, views[0] if not packed else None, views, packed, wire=wire))
    return ops


def _round_ops(ctx: Ctx, ops) -> tuple[list[Op], list[Op], list[torch.Tensor], list[int]]:
    """This round's receives, sends (peers in rotated order), send ring and staged reads."""
    plan = ctx.plan
    recv_ids = [i for i in ops.recvs if plan.transfers[i].src_rank != STAGED]
    staged = [i for i in ops.recvs if plan.transfers[i].src_rank == STAGED]
    if ctx.limit is not None and ctx.arena.nbytes and ops.round >= 0:
        if ctx.base_held(ops.round) + ctx.arena.nbytes > ctx.limit:
            ctx.arena.release()  # before this round's targets: a kept arena must not lift the rank above its budget
    alloc(ctx, ops.allocs)
    alloc(ctx, {plan.transfers[i].dst_buffer for i in (*ops.recvs, *ops.copies)})
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
    sizes = [max(aligned(op.msg.nbytes) for op in ringed[k::slots]) for k in range(slots)]
    own = [op for op in (*recvs, *sends) if op.packed and op.slot < 0]
    need = sum(aligned(op.msg.nbytes) for op in own) + sum(sizes)
    ctx.arena.reserve(need)
    ctx.stats.staging_bytes = max(ctx.stats.staging_bytes, need)
    for op in own:
        op.tensor = ctx.arena.take(op.msg.nbytes)
    ring = [ctx.arena.take(n) for n in sizes]
    if ctx.checksums:  # one int64 crc per message, per peer, after the data (next tag)
        device = ctx.transport.device
        for peers, tags, kind, out in ((by_src, ctx.recv_tags, "recv", recvs), (by_dst, ctx.send_tags, "send", sends)):
            for p in peers:
                out.append(Op(kind, None, p, tags[p], torch.zeros(len(peers[p]), dtype=torch.int64, device=device), [], False))
                tags[p] += 1
    return recvs, sends, ring, staged


def _post(ctx: Ctx, op: Op, batch: list) -> None:
    """isend/irecv at once (gloo), or queue for the round's one batch (NCCL)."""
    peer = ctx.group_rank[op.peer]
    op.posted = time.perf_counter()
    if ctx.nccl:
        batch.append(ctx.transport.p2p_op(op.kind, op.tensor, group=ctx.group, tag=op.tag, peer=peer))
    elif op.kind == "send":
        op.work = ctx.transport.isend(op.tensor, group=ctx.group, tag=op.tag, peer=peer)
    else:
        op.work = ctx.transport.irecv(op.tensor, group=ctx.group, tag=op.tag, peer=peer)


def run_round(ctx: Ctx, ops) -> None:
    """One round: allocate, post every receive, pack and send each message at once,
    local copies and staged reads while bytes move, then wait (unpacking each arrival)."""
    recvs, sends, ring, staged = _round_ops(ctx, ops)
    batch: list = []
    t = time.perf_counter()
    for op in recvs:
        _post(ctx, op, batch)
    crcs: dict[int, list[int]] = defaultdict(list)
    holder: list[Op | None] = [None] * len(ring)
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
                    _wait(ctx, last, [])
                    t = _tick(ctx, "slot", t)
                holder[op.slot] = op
                op.tensor = ring[op.slot].narrow(0, 0, op.msg.nbytes)
            op.pack()
            t = _tick(ctx, "pack", t)
        if ctx.checksums and op.msg is not None:
            crcs[op.peer].append(ctx.crc(op.tensor))
        _post(ctx, op, batch)
        ctx.stats.bytes_sent += op.msg.nbytes if op.msg else 0
    coalesced = None
    if batch:
        works = list(ctx.transport.batch(batch) or [])
        everything = [*recvs, *sends]
        if len(works) == len(everything):
            for op, work in zip(everything, works):
                op.work = work
        else:  # NCCL: one coalesced work for the whole batch
            coalesced = _Batch(works)
            for op in everything:
                op.work = coalesced
    t = _tick(ctx, "post", t)
    while copies:
        _copy(ctx, copies.pop())
    t = _tick(ctx, "copy", t)
    if staged and ctx.staged is not None:
        try:
            ctx.stats.bytes_staged += ctx.staged(staged, ctx.dst)
        except Exception as e:  # noqa: BLE001 - recorded; the group agrees after the last round
            ctx.bad.append(f"rank {ctx.rank}: staged read of round {ops.round} failed: {type(e).__name__}: {e}")
        _tick(ctx, "staged", t)
    _complete(ctx, ops.round, recvs, sends, coalesced)
    for name in ops.frees if ctx.release else ():
        ctx.src.pop(name, None)


class _Batch:
    """The works of one NCCL batch (one, coalesced), awaited once for all its ops."""

    def __init__(self, works: list) -> None:
        self.works, self.done, self.finished = works, False, 0.0

    def is_completed(self) -> bool:
        return self.done or all(w.is_completed() for w in self.works)


def _copy(ctx: Ctx, i: int) -> None:
    """Local transfer ``i``: a copy between this rank's views."""
    tr = ctx.plan.transfers[i]
    tr.dst_view(ctx.dst).copy_(tr.src_view(ctx.src))
    ctx.stats.bytes_copied += tr.nbytes


def _complete(ctx: Ctx, round_: int, recvs: list[Op], sends: list[Op], coalesced: _Batch | None) -> None:
    """Wait for the round's messages in posting order; unpack, time and check each."""
    everything = [*recvs, *sends]
    link_free: dict[int, float] = {}
    got: dict[int, list[int]] = defaultdict(list)
    per_peer: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    t = time.perf_counter()
    for n, op in enumerate(everything):
        _wait(ctx, op, everything[n + 1 :])
        t = _tick(ctx, "wait", t)
        if op.kind == "send":
            continue
        if op.msg is None:
            _compare(ctx, round_, op, [o for o in recvs if o.peer == op.peer and o.msg], got[op.peer])
            continue
        now = time.perf_counter()
        m = op.msg
        if coalesced is None:
            start = max(op.posted, link_free.get(op.peer, op.posted))
            link_free[op.peer] = now
            ctx.stats.samples.append(
                MessageSample(src=m.peer, dst=ctx.rank, nbytes=m.nbytes, seconds=now - start, round=round_, transfers=len(m.transfers))
            )
        else:
            per_peer[op.peer][0] += m.nbytes
            per_peer[op.peer][1] += len(m.transfers)
        ctx.stats.bytes_received += m.nbytes
        if ctx.checksums:
            got[op.peer].append(ctx.crc(op.tensor))
            t = _tick(ctx, "checksum", t)
        if op.packed:
            op.unpack()
            t = _tick(ctx, "unpack", t)
    if coalesced is not None and per_peer:
        seconds = coalesced.finished - min(op.posted for op in everything)
        for peer, (nbytes, count) in sorted(per_peer.items()):
            ctx.stats.samples.append(MessageSample(src=peer, dst=ctx.rank, nbytes=nbytes, seconds=seconds, round=round_,
                                                   transfers=count, coalesced=True))


def _compare(ctx: Ctx, round_: int, crc_op: Op, data: list[Op], got: list[int]) -> None:
    for op, want, have in zip(data, crc_op.tensor.tolist(), got):
        if want != have:
            ctx.bad.append(
                f"rank {ctx.rank}: message {op.tag} from rank {op.peer} to rank {ctx.rank} (round {round_}, tensors "
                f"{names(ctx, op.msg)}) has crc32c {have:#010x}, the sender's was {want:#010x}"
            )


def _wait(ctx: Ctx, op: Op, later: list[Op]) -> None:
    """Wait for ``op`` until the transition's deadline, once per op (gloo counts
    completions: a second wait on the same work would block; an NCCL batch is awaited
    once for all its ops). A timeout or a failed peer is a TransferError naming the peer,
    the tensors, and every message of the round not yet seen complete."""
    work = op.work
    if work is None:
        return
    what = "checksums" if op.msg is None else names(ctx, op.msg)
    direction = "from" if op.kind == "recv" else "to"
    try:
        if isinstance(work, _Batch):
            if not work.done:
                for w in work.works:
                    ctx.transport.wait(w, ctx.deadline, f"rank {ctx.rank}: the round's batch")
                work.done, work.finished = True, time.perf_counter()
        else:
            ctx.transport.wait(work, ctx.deadline, f"rank {ctx.rank}: {op.kind} of {what} {direction} rank {op.peer}")
        op.work = None
    except (RuntimeError, TransitionTimeout) as e:
        rest = [f"{o.kind} {'from' if o.kind == 'recv' else 'to'} rank {o.peer} ({names(ctx, o.msg, 2)})" for o in later if o.msg]
        cls = TransitionTimeout if isinstance(e, TransitionTimeout) else TransferError
        raise cls(
            f"rank {ctx.rank}: {op.kind} of {what} {direction} rank {op.peer} failed or timed out "
            f"(deadline {ctx.deadline.seconds:g} s for the transition): {e}. Also not complete: {'; '.join(rest) or 'nothing else'}. "
            "The process group is unusable now: destroy it and create a new one"
        ) from e


__all__ = ["MessageSample", "StreamStats", "StagingArena", "Ctx", "run_round", "alloc", "SEND_SLOTS"]
