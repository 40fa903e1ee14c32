"""One front door for executing a transition: stream what live ranks hold, load the rest.

:func:`execute` runs a transfer plan on every rank of a process group (SPMD). A plan
built with ``staged=True`` marks regions whose source ranks are gone as read from the
staged checkpoint (``src_rank == STAGED``); one transition may mix both per EMU. Order:

1. each rank checks its staged part (the boxes it reads exist whole at the staged
   version, and with ``checksums`` each has its block checksums) from the metadata and a
   listing, reading no byte of the data and touching no buffer; any exception there (a
   damaged ``metadata.json`` included) becomes the rank's verdict;
2. :func:`~nereus.reshard.stream.execute_stream` validates its own part and AGREES across
   the group: a problem on any rank (staged or stream) makes every rank raise the same
   error before any byte moves;
3. the rounds run: streamed transfers point-to-point, staged regions read through DCP
   (:func:`~nereus.reshard.staged_load.load_staged`) in the round the graph placed them, so
   the memory the graph planned is the memory used. With ``checksums`` each staged block
   is verified on the bytes that read fetches (one read per byte, object stores included);
   a block that fails is recorded and, after the last round, every rank raises the same
   :class:`~nereus.reshard.errors.TransferError` (as for a streamed message that fails its
   checksum). Sources handed over (``release_sources``) are then already freed: the old
   state survives such a failure only where the caller kept it.

:func:`reshard_staged` is the full fallback on live ranks, for when no memory-feasible
stream schedule exists: every rank stages its source boxes, the group agrees (which is
also the barrier) and agrees again that every box it reads is there whole, sources are
released if the caller handed them over, then every rank loads all its target regions from
the staged checkpoint (verified on the bytes read) and the group agrees a last time, so a
load that fails anywhere fails everywhere. Peak memory per rank is then ``max(source,
target)`` (plus one piece of at most ``graph.STAGED_PIECE_BYTES`` on object stores) instead
of up to ``source + target``.

:func:`reshard` is the documented pattern tying them together: plan the transition graph
under a memory budget; if the graph planner raises :class:`MemoryBudgetError`, fall back to
:func:`reshard_staged` (the decision is a pure function of the plan, so every rank takes
the same branch).

Every collective of one call runs under the call's ``timeout``: one deadline, set when the
call starts (before the pre-check and any staging), so time a rank spends in its own checks
or I/O counts. A rank that reaches an agreement past it raises at once; its peers raise
when their wait reaches it: :class:`~nereus.reshard.errors.TransitionTimeout` on every
rank, and the process group must be rebuilt.
"""

from __future__ import annotations

import math
from typing import Collection, MutableMapping

import torch

from .agreement import agree, verdict_of
from .errors import CoverageError, MemoryBudgetError, ProcessGroupError, TransferError
from .layout import DTYPES
from .plan import STAGED, Transfer, TransferPlan
from .staged import save_staged
from .staged_load import StagedLoadPlanner, StagedReader, check_staged, load_staged, run_load, staged_transfers
from .stream import StagingArena, StreamResult, StreamStats, check_buffer, execute_stream, group_ranks
from .transport import Deadline, transport_for


def execute(
    plan: TransferPlan,
    graph,
    src_buffers: MutableMapping[str, torch.Tensor],
    *,
    rank: int,
    group=None,
    dst_buffers: MutableMapping[str, torch.Tensor] | None = None,
    staged_path: str | None = None,
    checksums: bool = False,
    release_sources: bool = False,
    timeout: float = 300.0,
    staging: StagingArena | None = None,
    staged_version: int | None = None,
    device=None,
    transport=None,
) -> StreamResult:
    """Run ``plan`` on this rank: stream from live ranks, load staged regions from
    ``staged_path`` (at ``staged_version``; default: the newest staged there). Every rank
    of ``group`` calls it; ranks that are gone do not.

    Returns this rank's target buffers (a :class:`StreamResult`, with ``.stats``).
    Raises, on every rank and before any byte moves, CoverageError when the plan reads
    staged regions but ``staged_path`` is None or lacks a box (or has it at another
    version, or without checksums when ``checksums``), ProcessGroupError for stream
    problems or ranks that planned differently; on every rank after the last round,
    TransferError when a staged block fails its CRC32C or a message its checksum
    (``checksums``: verified on the bytes read); TransitionTimeout past ``timeout``.
    ``device``/``transport``: as for :func:`~nereus.reshard.stream.execute_stream`.
    """
    deadline = Deadline(timeout)  # the transition's one deadline: the pre-check counts
    mine = staged_transfers(plan, rank)
    readers: list[StagedReader] = []

    def precheck() -> None:  # without a path, every rank names the plan's staged regions
        reader = check_staged(staged_path, mine if staged_path else _all_staged(plan), checksums=checksums,
                              version=staged_version)
        if reader is not None:
            reader.deadline = deadline  # checked between the pieces the load fetches
            readers.append(reader)

    extra = verdict_of(precheck)

    def staged_load(indices: list[int], dst: dict) -> int:
        transfers = [plan.transfers[i] for i in indices]
        run_load(readers[0], StagedLoadPlanner(transfers, dst))
        return sum(math.prod(t.item.lengths) * DTYPES[plan.src_layouts[t.tensor].dtype].itemsize for t in transfers)

    out = execute_stream(
        plan,
        graph,
        src_buffers,
        rank=rank,
        group=group,
        dst_buffers=dst_buffers,
        checksums=checksums,
        timeout=timeout,
        release_sources=release_sources,
        staging=staging,
        extra_error=extra,
        device=device,
        transport=transport,
        staged_load=staged_load,
        options=(staged_path is not None, staged_version),
        deadline=deadline,
    )
    if dst_buffers is not None:
        dst_buffers.update(out)
    return out


def _all_staged(plan: TransferPlan) -> list[Transfer]:
    return [t for t in plan.transfers if t.src_rank == STAGED]


def reshard_staged(
    plan: TransferPlan,
    src_buffers: MutableMapping[str, torch.Tensor],
    *,
    rank: int,
    path: str,
    group=None,
    live: Collection[int] | None = None,
    dst_buffers: MutableMapping[str, torch.Tensor] | None = None,
    checksums: bool = False,
    release_sources: bool = False,
    timeout: float = 300.0,
    version: int | None = None,
    device=None,
    transport=None,
) -> StreamResult:
    """The whole transition through a staged checkpoint at ``path`` (every group rank).

    Targets are allocated where the stream path would put them: on the device of the
    group's transport (``cuda:<current>`` on NCCL), never on the CPU by default;
    ``device``/``transport`` as for :func:`~nereus.reshard.stream.execute_stream`.

    ``live``: ranks whose source buffers may be staged (default: the group's ranks);
    boxes no live rank holds must already be in ``path`` at ``version``, the version of
    the state the live ranks hold (``save_staged``). ``version=None`` means 0 when every
    box has a live holder (all are rewritten, nothing old is read); when some box has
    none, it is refused on every rank before any byte moves (a CoverageError naming the
    boxes): under a default the live ranks' fresh boxes would be read beside whatever an
    earlier state left at that version, silently mixed. With
    ``release_sources`` this rank's source buffers are popped from ``src_buffers`` once
    every box is staged and present whole; otherwise local regions are copied in memory
    and sources stay intact. With ``checksums`` every block is verified on the bytes the
    load reads (one read); a rank whose load fails (a block that fails its CRC32C, an I/O
    error) makes every rank raise the same error in the last agreement — sources released
    before the load are gone by then. The three agreements and the work between them run
    under one ``timeout`` from entry.
    """
    members = group_ranks(group)
    live = set(members) if live is None else set(live)
    transport = transport if transport is not None else transport_for(group, device)
    deadline = Deadline(timeout)
    holderless = _holderless_boxes(plan, live)
    if version is None and not holderless:
        version = 0
    verdict = verdict_of(lambda: _stage_sources(plan, src_buffers, rank=rank, path=path, live=live, checksums=checksums,
                                                version=version, holderless=holderless))
    # also the barrier: all boxes are staged
    agree(verdict, group=group, members=members, transport=transport, deadline=deadline,
          name="the agreement after staging")
    wanted = [t for t in plan.transfers if t.dst_rank == rank]
    local = [] if release_sources else [t for t in wanted if t.src_rank == rank]
    loads = [t for t in wanted if release_sources or t.src_rank != rank]
    readers: list[StagedReader] = []
    agree(verdict_of(lambda: readers.extend(_precheck(plan, rank, dst_buffers, path, loads, checksums=checksums, version=version,
                                                      deadline=deadline))),
          group=group, members=members, transport=transport, deadline=deadline,
          name="the agreement after the staged pre-check")
    if release_sources:
        for name in plan.src_buffers.get(rank, {}):
            src_buffers.pop(name, None)
    out = StreamResult(dst_buffers or {})
    out.stats = StreamStats()
    agree(verdict_of(lambda: _load(plan, rank, out, src_buffers, local, loads, path=path, version=version,
                                   reader=readers[0] if readers else None, device=transport.device)),
          group=group, members=members, transport=transport, deadline=deadline,
          what="the staged load failed", default=TransferError, name="the agreement after the staged load")
    if dst_buffers is not None:
        dst_buffers.update(out)
    return out


def _stage_sources(plan: TransferPlan, src_buffers, *, rank: int, path: str, live: set[int], checksums: bool,
                   version: int | None, holderless: list) -> None:
    """This rank's share of the source boxes into the staged checkpoint at ``path``; refused
    (CoverageError) when some box has no live holder and no version says which state it is."""
    if version is None:
        shown = ", ".join(f"{n!r} at {list(o)}" for n, o in holderless[:3])
        raise CoverageError(
            f"{len(holderless)} source box(es) ({shown}{', ...' if len(holderless) > 3 else ''}) have no live holder "
            f"and would be read from the staged checkpoint {path!r}, but no version was given: pass the version they "
            "were staged at (reshard_staged(version=), reshard(staged_version=)), so that boxes an earlier state "
            "left there are refused instead of mixed with the live ranks' fresh ones"
        )
    save_staged(path, plan.src_layouts, src_buffers, rank=rank, live=live, checksums=checksums, version=version)


def _precheck(plan: TransferPlan, rank: int, dst_buffers, path: str, loads: list[Transfer], *, checksums: bool,
              version: int | None, deadline: Deadline) -> list[StagedReader]:
    """The targets given, and the staged boxes' presence, sizes and checksum lists: no byte of
    data read. The reader to load with (none when this rank loads nothing)."""
    targets = plan.dst_buffers.get(rank, {})
    problems = [p for name, tensor in (dst_buffers or {}).items()
                for p in check_buffer("target", name, tensor, targets.get(name), rank)]
    if problems:
        more = f"; {len(problems) - 4} more" if len(problems) > 4 else ""
        raise ProcessGroupError(f"rank {rank}: " + "; ".join(problems[:4]) + more)
    reader = check_staged(path, loads, checksums=checksums, version=version)
    if reader is None:
        return []
    reader.deadline = deadline  # checked between the pieces the load fetches
    return [reader]


def _load(plan: TransferPlan, rank: int, out: StreamResult, src_buffers, local: list[Transfer], loads: list[Transfer], *,
          path: str, version: int | None, reader: StagedReader | None, device) -> None:
    """Allocation, local copies and the staged load into ``out``: any failure reaches the agreement."""
    for name, spec in plan.dst_buffers.get(rank, {}).items():
        if name not in out:
            out[name] = torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=device)
    for t in local:
        t.dst_view(out).copy_(t.src_view(src_buffers))
        out.stats.bytes_copied += t.nbytes
    out.stats.bytes_staged = load_staged(path, plan, rank, out, transfers=loads, verified=True, version=version, reader=reader)


def _holderless_boxes(plan: TransferPlan, live: Collection[int]) -> list[tuple[str, tuple]]:
    """The non-empty source boxes no ``live`` rank holds, as (tensor, offsets) (pure)."""
    return [
        (name, tuple(offsets))
        for name, layout in sorted(plan.src_layouts.items())
        for (offsets, lengths), holders in layout.unique_boxes().items()
        if math.prod(lengths) and not any(s.rank in live for s in holders)
    ]


def plan_or_stage(plan: TransferPlan, *, budget=None, release_sources: bool = False, **graph_kwargs):
    """The transition graph under ``budget``, or None when no stream schedule fits it
    (the caller then takes the staged path). Pure: every rank gets the same answer."""
    from .arrays import arrays_from_plan
    from .graph import RESERVE_BYTES, plan_graph

    graph_kwargs.setdefault("reserve", RESERVE_BYTES if budget is not None else 0)
    try:
        return plan_graph(arrays_from_plan(plan), budget=budget, release_sources=release_sources, **graph_kwargs)
    except MemoryBudgetError:
        return None


def reshard(
    plan: TransferPlan,
    src_buffers: MutableMapping[str, torch.Tensor],
    *,
    rank: int,
    group=None,
    budget=None,
    staged_path: str | None = None,
    dst_buffers: MutableMapping[str, torch.Tensor] | None = None,
    checksums: bool = False,
    release_sources: bool = False,
    timeout: float = 300.0,
    staged_version: int | None = None,
) -> StreamResult:
    """Stream under ``budget`` when a schedule fits, else go through ``staged_path``.

    ``result.stats.rounds == 0`` and ``bytes_staged > 0`` tell the caller the staged path
    ran. Without a staged path an infeasible budget re-raises the MemoryBudgetError.
    ``staged_version``: the version of the state being moved, as staged at ``staged_path``
    (``execute``'s ``staged_version``, ``reshard_staged``'s ``version``). The staged
    fallback needs it whenever some source box has no live holder (see
    :func:`reshard_staged`); the stream path then reads the newest staged version.
    """
    graph = plan_or_stage(plan, budget=budget, release_sources=release_sources)
    if graph is not None:
        return execute(
            plan, graph, src_buffers, rank=rank, group=group, dst_buffers=dst_buffers, staged_path=staged_path,
            checksums=checksums, release_sources=release_sources, timeout=timeout, staged_version=staged_version,
        )
    if staged_path is None:
        raise MemoryBudgetError(
            f"no stream schedule fits the memory budget {budget!r} and no staged_path was given for the fallback"
        )
    return reshard_staged(
        plan, src_buffers, rank=rank, path=staged_path, group=group, dst_buffers=dst_buffers,
        checksums=checksums, release_sources=release_sources, timeout=timeout, version=staged_version,
    )


__all__ = ["execute", "reshard_staged", "plan_or_stage", "reshard"]
