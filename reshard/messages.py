"""Messages: how one round's transfers between two ranks travel together (pure).

A rank pair's transfers in a round go in one fixed order: those whose source region is
contiguous and keeps its dtype (sent as their own view, no copy, so bytes flow at once),
then one packed byte message of all transfers under ``COALESCE_BYTES`` (each piece at an
``ALIGN``-byte offset, so mixed dtypes view cleanly), then strided ones and casts (packed
just before their send); plan order within each class. Sender and receiver derive the same
list from the same plan, and a per-(peer, direction) counter gives each message a tag
unique over the whole transition: gloo matches on tags; NCCL ignores them and matches in
posting order, which is this same order. A transfer strided on either side and larger
than ``chunk`` bytes travels as slices of its first non-unit dimension (gloo only), so
packing, sending and unpacking pipeline within it.

Memory: a packed message needs staging on both sides, a strided region on its side. The
transition graph counts every transfer under ``COALESCE_BYTES`` and every strided region
as a transient of its round (``graph.plan_graph(coalesce=...)``), so the staging this
module asks for never exceeds what the graph planned.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from .arrays import region_is_contiguous
from .plan import TransferPlan

COALESCE_BYTES = 1 << 20
"""Transfers smaller than this travel packed with the pair's other small ones."""
CHUNK_BYTES = 4 << 20
"""A strided transfer larger than this travels as several messages of about this size."""
ALIGN = 64
"""Byte alignment of pieces inside packed messages and the staging arena."""


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


def aligned(n: int) -> int:
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
                end = aligned(end + plan.transfers[i].nbytes)
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


__all__ = ["COALESCE_BYTES", "CHUNK_BYTES", "ALIGN", "Message", "aligned", "plan_messages"]
