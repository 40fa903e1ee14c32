"""Agreement: every rank of a transition learns every rank's verdict, under the deadline.

Before any byte moves (and, when a transition checks checksums or reads staged data, once
more after the last round) the group exchanges one small record per rank: a fingerprint
of what the rank is about to run and its verdict — None, or ``(error class name,
message)`` for ANY exception its local checks raised (a truncated ``metadata.json``'s
parse error included). If any rank failed, every rank raises the first failing rank's
class with every rank's message; if two ranks' fingerprints differ, every rank raises a
:class:`ProcessGroupError` naming the ranks that planned differently. So no rank goes
on into a round its peers never reach: the failure modes of a mismatch are errors, not
hangs.

The fingerprint is the CRC32C of the plan's transfers (ranks, tensor, boxes, bytes,
buffers), the graph's rounds, the group's ranks and the options that shape messages
(checksums, coalescing, chunking, release), computed once per (plan, graph) pair.

The exchange is two ``all_gather`` s (sizes, then the pickled records, padded), posted
asynchronously and awaited against the transition's :class:`~.transport.Deadline`;
past it, :class:`~.errors.TransitionTimeout` (the group must be rebuilt); a rank that arrives
after the deadline raises it at once, without posting. On a group with
a CPU backend (gloo, or ``cpu:gloo,cuda:nccl``) the records travel as CPU tensors.
"""

from __future__ import annotations

import pickle
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import errors
from .checksum import crc32c
from .errors import ProcessGroupError, ReshardError, TransferError, TransitionTimeout
from .plan import TransferPlan
from .transport import Deadline, Transport, object_device

Verdict = tuple[str, str] | None
"""None (fine), or (error class name, message)."""


def verdict_of(step: Callable[[], object]) -> Verdict:
    """Run a local step; ANY exception it raises becomes a verdict (never escapes, so the
    rank still reaches the agreement). I/O failures count as TransferError; exceptions
    that are not reshard errors keep their class name in the message."""
    try:
        step()
    except (ReshardError, TransferError) as e:
        return type(e).__name__, str(e)
    except OSError as e:
        return "TransferError", f"I/O error: {e}"
    except Exception as e:  # noqa: BLE001 - a verdict must reach the agreement whatever it is
        return "ReshardError", f"{type(e).__name__}: {e}"
    return None


def combine(*verdicts: Verdict) -> Verdict:
    """One verdict of several: the first failure's class, every failure's message."""
    failed = [v for v in verdicts if v is not None]
    if not failed:
        return None
    return failed[0][0], "; ".join(v[1] for v in failed)


_FINGERPRINTS: dict[tuple[int, int], tuple[object, object, int]] = {}


def fingerprint(plan: TransferPlan, graph, options: Sequence = ()) -> int:
    """CRC32C of the plan's transfers, the graph's rounds and ``options`` (module docstring)."""
    key = (id(plan), id(graph))
    hit = _FINGERPRINTS.get(key)
    if hit is None or hit[0] is not plan or hit[1] is not graph:
        rows = [
            (t.src_rank, t.dst_rank, t.tensor, tuple(t.item.storage_index.offset or ()), tuple(t.item.storage_offsets),
             tuple(t.item.dest_index.offset or ()), tuple(t.item.dest_offsets), tuple(t.item.lengths), t.nbytes,
             t.src_buffer, t.dst_buffer)
            for t in plan.transfers
        ]
        value = crc32c(repr(rows).encode())
        if graph is not None:
            value = crc32c(np.ascontiguousarray(graph.round_of, dtype=np.int64).tobytes(), value)
            value = crc32c(repr((graph.num_rounds, graph.max_messages)).encode(), value)
        if len(_FINGERPRINTS) > 16:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[key] = hit = (plan, graph, value)
    return crc32c(repr(tuple(options)).encode(), hit[2])


def agree(
    verdict: Verdict,
    *,
    group,
    members: Sequence[int],
    transport: Transport,
    deadline: Deadline,
    print_: int | None = None,
    what: str = "reshard rejected on every rank before any byte moved",
    default: type[Exception] = ProcessGroupError,
    name: str | None = None,
) -> None:
    """Exchange ``(print_, verdict)`` with every rank of ``group``; raise on EVERY rank when
    any rank failed (its class, all messages) or when fingerprints differ. A rank that gets
    here after the deadline raises TransitionTimeout without posting anything (its peers
    time out waiting for it), naming the agreement (``name``) and keeping its own verdict.
    ``what`` is the failure message's lead, used only when some rank failed."""
    if deadline.passed():
        own = "" if verdict is None else f"; its own verdict, never posted: {verdict[0]}: {verdict[1]}"
        raise TransitionTimeout(
            f"rank {dist.get_rank()} reached {name or 'an agreement'} after the transition's deadline of "
            f"{deadline.seconds:g} s had passed (its own checks, staging or reads took that long); it posted nothing, "
            f"its peers time out waiting for it{own}. The process group is unusable now: destroy it and create a new one"
        )
    records = _all_gather(pickle.dumps((print_, verdict)), group=group, n=len(members), transport=transport, deadline=deadline)
    prints = {}
    failed = []
    for r, raw in zip(members, records):
        p, v = pickle.loads(raw)
        prints.setdefault(p, []).append(r)
        if v is not None:
            failed.append((r, v))
    if failed:
        cls = getattr(errors, failed[0][1][0], None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = default
        by_message: dict[str, list[int]] = {}
        for r, (_, msg) in failed:
            by_message.setdefault(msg, []).append(r)
        detail = "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {msg}" for msg, rs in by_message.items())
        raise cls(f"{what} — {detail}")
    if len(prints) > 1:
        detail = "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {p:08x}" if p is not None else
                           f"ranks {rs}: none" for p, rs in prints.items())
        raise ProcessGroupError(
            f"{what} — the ranks planned different transitions (fingerprints of plan, graph and options: {detail}); "
            "every rank must call with the same plan, graph, group and options"
        )


def _all_gather(payload: bytes, *, group, n: int, transport: Transport, deadline: Deadline) -> list[bytes]:
    """Every rank's ``payload`` (two async all-gathers: sizes, then bytes padded to the largest)."""
    device = object_device(group, transport)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    transport_wait(transport, device, dist.all_gather(sizes, size, group=group, async_op=True), deadline,
                   "the agreement (sizes)")
    lengths = [int(s.item()) for s in sizes]
    width = max(lengths)
    mine = torch.zeros(width, dtype=torch.uint8, device=device)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    out = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(n)]
    transport_wait(transport, device, dist.all_gather(out, mine, group=group, async_op=True), deadline,
                   "the agreement (verdicts)")
    return [bytes(o[:k].cpu().numpy()) for o, k in zip(out, lengths)]


def transport_wait(transport: Transport, device: torch.device, work, deadline: Deadline, what: str) -> None:
    """Wait for a collective: CPU tensors travel on the group's CPU backend (gloo, whose
    wait enforces the timeout), device tensors on the transport's."""
    if device.type == "cpu" and transport.device.type != "cpu":
        transport = Transport(device=device, coalesced=False, enforces_timeout=True, name="gloo")
    try:
        transport.wait(work, deadline, f"rank {dist.get_rank()}: {what} (some rank of the group did not reach it)")
    except TransitionTimeout as e:
        raise TransitionTimeout(f"{e}. The process group is unusable now: destroy it and create a new one") from e


__all__ = ["Verdict", "verdict_of", "combine", "fingerprint", "agree"]
