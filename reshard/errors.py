"""Errors raised by resharding, each naming the tensor, rank or layout at fault.

Every check that can fail runs before any byte moves (docs/architecture.md, principle 5), so
catching one of these means the source state is untouched.
"""

from __future__ import annotations


class ReshardError(ValueError):
    """Base class: bad input to planning or execution."""


class LayoutError(ReshardError):
    """A layout or EMU is malformed: shards out of bounds, replicas that disagree, ..."""


class MismatchError(ReshardError):
    """Source and target disagree on a tensor's global shape or dtype, or on its presence."""


class CoverageError(ReshardError):
    """A target region that no live source rank and no staged checkpoint holds."""


class MemoryBudgetError(ReshardError):
    """No transition schedule keeps every rank within its memory budget."""


class ProcessGroupError(ReshardError):
    """A plan names a rank that is not in the process group, or local buffers are wrong."""


class TransferError(RuntimeError):
    """Bytes moved but arrived wrong (checksum mismatch) or a peer failed mid-transfer."""


class TransitionTimeout(TransferError):
    """A collective or point-to-point op of a transition missed the transition's deadline.

    The process group is then unusable: ops of the transition may still be pending (a
    receive posted on gloo, a batch queued on NCCL's stream, a collective's worker thread
    still waiting) and would match later traffic. Destroy the group and create a new one
    (in ``nereus train``: restart the workers, ``--resume``) before anything else runs on it.
    ``rebuild_group`` is always True, for callers that test for it.
    """

    rebuild_group = True
