"""How point-to-point ops are posted and awaited: gloo's semantics or NCCL's, from the group.

The executor never guesses from a buffer. :func:`transport_for` reads the process group:
when its backend config maps ``cuda`` to ``nccl`` and CUDA is available, tensors live on
``cuda:<current device>`` and ops follow NCCL's semantics; otherwise on the CPU with gloo's.
Every rank reads the same group, so every rank takes the same branch — a rank with no
buffer at all included (it used to fall back to the CPU and post gloo ops among NCCL
peers: a hang).

The two semantics (torch 2.13, ``distributed_c10d.batch_isend_irecv``):

- gloo: each ``isend``/``irecv`` returns its own work; ``work.wait(timeout)`` enforces the
  timeout (it raises, the op stays pending);
- NCCL: a round is ONE ``batch_isend_irecv``, which returns ONE coalesced work for the
  whole batch (``_coalescing_manager``'s ``cm.works``), not one per op; and
  ``work.wait(timeout)`` does not enforce the timeout unless ``TORCH_NCCL_BLOCKING_WAIT``
  is set. So completion is polled with ``is_completed()`` against the deadline, and
  ``wait()`` is called only once the work is complete (to order the current CUDA stream).

:class:`Deadline` is the one stated deadline of a transition: every collective and every
wait of one ``execute_stream`` call runs against it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import TransitionTimeout


@dataclass(slots=True)
class Deadline:
    """``seconds`` from construction; ``left()`` is what remains (never below 1 ms)."""

    seconds: float
    end: float = field(init=False)

    def __post_init__(self) -> None:
        self.end = time.monotonic() + self.seconds

    def left(self) -> float:
        return max(self.end - time.monotonic(), 1e-3)

    def passed(self) -> bool:
        return time.monotonic() >= self.end


@dataclass(frozen=True, slots=True)
class Transport:
    """Posting and waiting for one group: ``device`` of the tensors, ``coalesced`` (NCCL:
    one batch per round, one work for it), ``enforces_timeout`` (gloo's ``wait``)."""

    device: torch.device
    coalesced: bool
    enforces_timeout: bool
    name: str

    def isend(self, tensor, *, group, tag: int, peer: int):
        return dist.isend(tensor, group=group, tag=tag, group_dst=peer)

    def irecv(self, tensor, *, group, tag: int, peer: int):
        return dist.irecv(tensor, group=group, tag=tag, group_src=peer)

    def batch(self, ops: list) -> list:
        """``batch_isend_irecv`` of ``dist.P2POp`` s (from :meth:`p2p_op`); its works (NCCL: one)."""
        return dist.batch_isend_irecv(ops)

    def p2p_op(self, kind: str, tensor, *, group, tag: int, peer: int):
        return dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, group=group, tag=tag, group_peer=peer)

    def wait(self, work, deadline: Deadline, what: str) -> None:
        """Wait for ``work`` until ``deadline``; TransitionTimeout naming ``what`` past it.

        gloo: ``wait(timeout)``; NCCL: poll ``is_completed()`` (sleeping 50 us, doubling to
        1 ms), then ``wait()`` once complete."""
        if self.enforces_timeout:
            try:
                work.wait(timeout=timedelta(seconds=deadline.left()))
            except RuntimeError as e:
                if deadline.passed() or "timed out" in str(e).lower() or "timeout" in str(e).lower():
                    raise TransitionTimeout(f"{what} did not complete within the deadline ({deadline.seconds:g} s): {e}") from e
                raise
            return
        pause = 50e-6
        while not work.is_completed():
            if deadline.passed():
                raise TransitionTimeout(f"{what} did not complete within the deadline ({deadline.seconds:g} s)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        work.wait()


def backend_config(group) -> str:
    return str(dist.get_backend_config(group))


def transport_for(group, device: torch.device | str | None = None) -> Transport:
    """The transport of ``group`` (module docstring); ``device`` overrides where tensors live."""
    config = backend_config(group)
    nccl = "cuda:nccl" in config or config == "nccl"
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if nccl and torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and nccl:
        return Transport(device=device, coalesced=True, enforces_timeout=False, name="nccl")
    return Transport(device=device, coalesced=False, enforces_timeout=True, name="gloo")


def object_device(group, transport: Transport) -> torch.device:
    """Where the agreement's small tensors go: the CPU when the group has a CPU backend."""
    config = backend_config(group)
    return torch.device("cpu") if ("cpu:" in config or transport.device.type == "cpu") else transport.device


_NCCL_READY: dict[int, object] = {}
"""Groups whose NCCL communicator exists, by id (the value pins the group so ids stay unique)."""


def ready_nccl(group, transport: Transport, deadline: Deadline) -> None:
    """Create the group's NCCL communicator with one tiny all-reduce, once per group.

    torch.distributed: when ``batch_isend_irecv`` is the first NCCL call on a group, every
    rank of the group must take part, or the behaviour is undefined (a hang); a transition's
    rounds often involve only some ranks. Every rank calls ``execute_stream`` (its contract)
    and derives the same transport from the same group, so every rank runs this or none does.
    """
    pg = group if group is not None else dist.group.WORLD
    if not transport.coalesced or id(pg) in _NCCL_READY:
        return
    work = dist.all_reduce(torch.zeros(1, device=transport.device), group=group, async_op=True)
    try:
        transport.wait(work, deadline, f"rank {dist.get_rank()}: the NCCL communicator's first all-reduce")
    except TransitionTimeout as e:
        raise TransitionTimeout(f"{e}. The process group is unusable now: destroy it and create a new one") from e
    _NCCL_READY[id(pg)] = pg


__all__ = ["Deadline", "Transport", "transport_for", "object_device", "ready_nccl"]
