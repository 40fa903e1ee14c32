"""Stream executor: a transfer plan run with point-to-point sends between live ranks.

Every rank of the process group calls :func:`execute_stream` with the same plan and
graph (SPMD); plan ranks are global ranks, mapped to group ranks for each P2P op. The
pieces live in their own modules: :mod:`.messages` (which transfers travel together, pure),
:mod:`.agreement` (every rank's verdict, the plan's fingerprint), :mod:`.rounds` (the
round engine, the staging arena), :mod:`.transport` (gloo's or NCCL's semantics, the
deadline). Order of work on one rank, and why it cannot deadlock:

0. *Validate, then agree.* Each rank checks what it can see (plan ranks in the group, its
   source buffers, given target buffers, their device against the group's) — any
   exception a check raises becomes this rank's verdict — and the group exchanges the
   verdicts and a fingerprint of (plan, graph, options), so a problem anywhere, or ranks
   that planned differently, make EVERY rank raise the same error before a byte moves.
   On an NCCL group the first call then runs one all-reduce so the communicator exists
   before a round that involves only some ranks posts its batched point-to-point.
1. *Rounds* come from the transition graph (``graph.ops_for(rank)``, global round order)
   and run in :func:`.rounds.run_round`; see there for the per-round order.
2. *After the last round*, when the plan reads staged data or ``checksums`` is on, the
   group agrees once more: a bad message or a failed staged read anywhere makes every
   rank raise the same :class:`TransferError`.
3. *Sources* are never touched unless ``release_sources=True``, in which case the graph's
   frees pop them from ``src_buffers`` (the caller handed them over) after their round.

Deadline. ``timeout`` is the whole call's: the agreements, the NCCL warm-up and every wait
of every round run against one deadline set at entry (``execute``'s entry, before its staged
pre-check, when called from there). A rank that reaches an agreement after the deadline
raises at once, posting nothing; past it every waiting rank raises
:class:`~.errors.TransitionTimeout` and the process group is unusable (ops may be
pending): destroy it and create a new one.

Device and backend come from the process group (:func:`.transport.transport_for`), never
from a buffer; ``device=`` overrides. Buffers on another device are a verdict error.

The result is a :class:`StreamResult`: the dict ``buffer name -> tensor`` of this rank's
target buffers, with ``.stats`` (:class:`StreamStats`): bytes by kind, seconds by phase,
and one :class:`MessageSample` per received message (link, bytes, seconds of service on
that link). The trainer hands a sample of them, ``(src, dst, bytes, seconds)``, to the
controller (``trainer/runtime/transition.measured_messages``), which refits the alpha-beta
link model on them (``links.calibrate``).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, MutableMapping, Sequence

import torch
import torch.distributed as dist

from .agreement import Verdict, agree, combine, fingerprint, verdict_of
from .checksum import tensor_crc32c
from .errors import ProcessGroupError, TransferError
from .layout import DTYPES
from .messages import CHUNK_BYTES, COALESCE_BYTES, Message, plan_messages  # noqa: F401 - public names
from .plan import STAGED, TransferPlan
from .rounds import Ctx, MessageSample, StagingArena, StreamStats, alloc, run_round
from .transport import Deadline, Transport, ready_nccl, transport_for


class StreamResult(dict):
    """This rank's target buffers (``name -> tensor``), plus ``.stats``."""

    stats: StreamStats


def rounds_for(plan: TransferPlan, graph, rank: int) -> list:
    """The graph's rounds for ``rank``; ``graph=None``: an unbounded graph of the plan."""
    return list(graph_of(plan, graph).ops_for(rank))


def graph_of(plan: TransferPlan, graph):
    if graph is None:
        from .arrays import arrays_from_plan
        from .graph import plan_graph

        graph = plan_graph(arrays_from_plan(plan))
    return graph


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
    device: torch.device | None = None,
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
        problems += check_buffer("source", name, src_buffers.get(name), specs.get(name), rank, device)
    targets = plan.dst_buffers.get(rank, {})
    for name, tensor in (dst_buffers or {}).items():
        problems += check_buffer("target", name, tensor, targets.get(name), rank, device)
    if len(problems) > 4:
        problems = problems[:4] + [f"{len(problems) - 4} more problems"]
    return "; ".join(problems) or None


def check_buffer(side: str, name: str, tensor, spec, rank: int, device=None) -> list[str]:
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
    if device is not None and tensor.device != device:
        return [f"{side} buffer {name!r} is on {tensor.device}, but the stream runs on {device} (from the process group)"]
    return []


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
    coalesce_bytes: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    extra_error: Verdict = None,
    device: torch.device | str | None = None,
    staged_load: Callable[[list[int], dict], int] | None = None,
    options: Sequence = (),
    transport: Transport | None = None,
    deadline: Deadline | None = None,
) -> StreamResult:
    """Run this rank's part of ``plan`` over ``group`` (None: the default group).

    ``graph``: a TransitionGraph (``ops_for(rank)``); None plans one without a budget.
    ``dst_buffers``: target buffers that already exist (filled in place; others are
    allocated just in time; existing ones count from the start, not in the graph's budget).
    ``timeout``: seconds for the whole call (module docstring). ``staging``: an arena to
    reuse across calls. ``coalesce_bytes``: transfers below this share a packed message per
    peer (0: never; default and at most: the graph's). ``chunk_bytes``: on gloo, strided
    transfers above this travel in slices of about this size through the send ring.
    ``extra_error``: a caller's own pre-check verdict, folded into the agreement.
    ``staged_load(transfer indices, target buffers) -> bytes``: reads this rank's staged transfers of a
    round, in that round (``execute`` passes one). ``options``: what else the caller's
    ranks must agree on, folded into the fingerprint. ``transport``: how ops are posted and
    awaited (default: from the group; tests pass one with NCCL's semantics). ``deadline``:
    the transition's, when the caller started it before its own work (``execute``: before its
    staged pre-check); default: ``timeout`` from now.
    Every rank of the group must call this, even with nothing to do.
    """
    t_start = time.perf_counter()
    deadline = deadline if deadline is not None else Deadline(timeout)
    members = group_ranks(group)
    if dist.get_rank() not in members:
        raise ProcessGroupError(f"rank {dist.get_rank()} is not in the process group {members} it was asked to reshard over")
    transport = transport if transport is not None else transport_for(group, device)
    agreed = (tuple(members), checksums, release_sources, chunk_bytes, coalesce_bytes, transport.coalesced, *options)
    graph, rounds, print_ = _agree_to_stream(plan, graph, src_buffers, dst_buffers, rank=rank, group=group, members=members,
                                             transport=transport, deadline=deadline, coalesce_bytes=coalesce_bytes,
                                             chunk_bytes=chunk_bytes, extra_error=extra_error, agreed=agreed)
    ready_nccl(group, transport, deadline)
    stats = StreamStats()
    stats.phases["validate"] = time.perf_counter() - t_start
    budget = graph.budget_of(rank) if hasattr(graph, "budget_of") else None
    arena = staging if staging is not None and staging.device == transport.device else StagingArena(transport.device)
    if budget is not None and arena.nbytes and _held(plan, rank, src_buffers) + arena.nbytes > budget:
        arena.release()  # a kept arena must not lift the rank above its budget before round 0
    ctx = Ctx(
        plan=plan,
        rank=rank,
        group=group,
        group_rank={g: i for i, g in enumerate(members)},
        src=src_buffers,
        dst=dict(dst_buffers or {}),
        arena=arena,
        transport=transport,
        deadline=deadline,
        checksums=checksums,
        release=release_sources,
        coalesce=getattr(graph, "coalesce", COALESCE_BYTES) if coalesce_bytes is None else coalesce_bytes,
        chunk=chunk_bytes,
        stats=stats,
        base_held=(lambda k: graph.held_bytes(rank, k)) if budget is not None else None,
        limit=budget,
        staged=staged_load,
        crc=_crc_hook,
    )
    for ops in rounds:
        run_round(ctx, ops)
        ctx.stats.rounds += 1
    alloc(ctx, plan.dst_buffers.get(rank, {}))
    if checksums or any(t.src_rank == STAGED for t in plan.transfers):
        # every rank learns of every bad message or failed staged read, and all raise together
        bad = ("TransferError", "; ".join(ctx.bad)) if ctx.bad else None
        agree(bad, group=group, members=members, transport=transport, deadline=deadline, print_=print_,
              what="checksum mismatch or failed staged read after streaming", default=TransferError,
              name="the agreement after streaming")
    if dst_buffers is not None:
        dst_buffers.update(ctx.dst)
    ctx.stats.seconds = time.perf_counter() - t_start
    ctx.stats.phases = dict(ctx.stats.phases)
    result = StreamResult(ctx.dst)
    result.stats = ctx.stats
    return result


def _agree_to_stream(plan: TransferPlan, graph, src_buffers, dst_buffers, *, rank: int, group, members: Sequence[int],
                     transport: Transport, deadline: Deadline, coalesce_bytes: int | None, chunk_bytes: int,
                     extra_error: Verdict, agreed: tuple):
    """This rank's checks of its inputs, then one agreement of every rank on them and on the
    plan's fingerprint (with ``agreed``: what else the ranks must share), before any byte
    moves: every rank raises together, or none. Returns (graph, this rank's rounds, fingerprint)."""
    state: dict = {}

    def local_checks() -> None:
        state["graph"] = graph_of(plan, graph)
        state["rounds"] = list(state["graph"].ops_for(rank))
        problems = [check_stream_inputs(plan, state["rounds"], src_buffers, dst_buffers, rank=rank, members=members,
                                        device=transport.device)]
        limit = getattr(state["graph"], "coalesce", COALESCE_BYTES)
        if coalesce_bytes is not None and coalesce_bytes > limit:
            problems.append(f"coalesce_bytes={coalesce_bytes} exceeds the {limit} the graph planned staging for "
                            "(plan_graph(coalesce=...))")
        problems += [f"{k}={v} is negative" for k, v in (("coalesce_bytes", coalesce_bytes or 0), ("chunk_bytes", chunk_bytes)) if v < 0]
        if any(problems):
            raise ProcessGroupError("; ".join(p for p in problems if p))

    verdict = combine(verdict_of(local_checks), extra_error)
    print_ = None
    try:
        print_ = fingerprint(plan, state.get("graph", graph), agreed)
    except Exception as e:  # noqa: BLE001 - a plan this rank cannot even describe is its verdict
        verdict = combine(verdict, ("ReshardError", f"{type(e).__name__}: {e}"))
    agree(verdict, group=group, members=members, transport=transport, deadline=deadline, print_=print_,
          name="the agreement before streaming")
    return state["graph"], state["rounds"], print_


def _held(plan: TransferPlan, rank: int, src_buffers: Mapping[str, torch.Tensor]) -> int:
    """Bytes of this rank's source buffers (what it holds before round 0)."""
    return sum(src_buffers[n].nbytes for n in plan.src_buffers.get(rank, {}) if n in src_buffers)


def _crc_hook(t: torch.Tensor) -> int:
    """The message checksum (a module-level name, so tests can corrupt it on one rank)."""
    return crc32(t)


crc32 = tensor_crc32c
"""CRC32C of a tensor's bytes: the checksum of every streamed message."""


__all__ = [
    "execute_stream", "StreamResult", "StreamStats", "MessageSample", "StagingArena", "group_ranks", "stream_ranks",
    "check_stream_inputs", "rounds_for",
]
