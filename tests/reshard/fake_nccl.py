"""A transport with NCCL's semantics over gloo, so the NCCL branches run on CPU.

What it imitates (torch 2.13, read from ``distributed_c10d.batch_isend_irecv`` and
``ProcessGroupNCCL``): a batch of point-to-point ops returns ONE coalesced work for the
whole batch, and ``work.wait(timeout)`` does NOT enforce its timeout (without
``TORCH_NCCL_BLOCKING_WAIT`` it only orders the CUDA stream): here it blocks until every op
of the batch is done, however long that takes. An executor that relied on one work per op
or on ``wait(timeout)`` would miscount or hang under it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nereus.reshard.transport import Transport


class CoalescedWork:
    """One work standing for a whole batch; ``wait`` ignores its timeout.

    The batch progresses on its own (as NCCL's kernels do on the GPU): a helper thread
    waits for the gloo ops — gloo's point-to-point works only learn they are complete
    inside ``wait`` — and ``is_completed`` reports that thread's progress."""

    def __init__(self, works: list) -> None:
        self.works = works
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for w in self.works:
                w.wait()
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - NCCL does not enforce it
        self._done.wait()
        return True


@dataclass(frozen=True, slots=True)
class FakeNccl(Transport):
    """``batch`` posts every op on gloo and returns ``[one CoalescedWork]``; ``isend`` /
    ``irecv`` (gloo's one-op path) must never be used under it."""

    def batch(self, ops: list) -> list:
        works = []
        for op in ops:
            if op.op is dist.isend:
                works.append(dist.isend(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer))
            else:
                works.append(dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer))
        return [CoalescedWork(works)]

    def isend(self, *args, **kwargs):
        raise AssertionError("an NCCL transport posts batches, never a single isend")

    def irecv(self, *args, **kwargs):
        raise AssertionError("an NCCL transport posts batches, never a single irecv")


def fake_nccl() -> FakeNccl:
    return FakeNccl(device=torch.device("cpu"), coalesced=True, enforces_timeout=False, name="fake-nccl")
