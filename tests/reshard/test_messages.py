"""How the stream executor groups a round's transfers into messages (pure: no process group).

Sender and receiver each derive their message lists from the plan alone; they must agree
message for message, and chunks must tile their transfer's region exactly.
"""

from __future__ import annotations

import pytest

from nereus.reshard.derive import derive_emus
from nereus.reshard.layout import ParallelConfig
from nereus.reshard.plan import plan_transfers
from nereus.reshard.messages import _contiguous, plan_messages

from .strategies import tiny_spec

SPEC = tiny_spec(hidden_size=64, intermediate_size=128)


def _plan(src: dict, dst: dict):
    return plan_transfers(
        derive_emus(SPEC, ParallelConfig.on(**src), model="actor", stage="s"),
        derive_emus(SPEC, ParallelConfig.on(**dst), model="actor", stage="t"),
    )


# one rank -> TP2 on two others: row-parallel targets are column slices of the source
# (strided to send); TP2 -> replicated: row-parallel shards land in column slices (strided
# to receive).
PLANS = {"tp1 -> tp2": (dict(), dict(tp=2, first_rank=1)), "tp2 -> dp2": (dict(tp=2), dict(dp=2))}


def _both_sides(plan, **kwargs):
    """{(src, dst): (sender's messages to dst, receiver's messages from src)}."""
    remote = [i for i, t in enumerate(plan.transfers) if t.src_rank != t.dst_rank]
    pairs = {(plan.transfers[i].src_rank, plan.transfers[i].dst_rank) for i in remote}
    out = {}
    for s, d in sorted(pairs):
        sends = plan_messages(plan, [i for i in remote if plan.transfers[i].src_rank == s], peer_of="dst_rank", tags={}, **kwargs)
        recvs = plan_messages(plan, [i for i in remote if plan.transfers[i].dst_rank == d], peer_of="src_rank", tags={}, **kwargs)
        out[s, d] = (sends[d], recvs[s])
    return out


@pytest.mark.parametrize("name", PLANS)
@pytest.mark.parametrize("chunk", [0, 512, 3000])
def test_sender_and_receiver_agree_and_chunks_tile_each_region(name, chunk):
    plan = _plan(*PLANS[name])
    split = 0
    for (s, d), (sends, recvs) in _both_sides(plan, coalesce=1024, chunk=chunk).items():
        key = lambda m: (m.tag, m.transfers, m.offsets, m.nbytes, m.part)  # noqa: E731
        assert [key(m) for m in sends] == [key(m) for m in recvs], (s, d)
        assert [m.tag for m in sends] == list(range(len(sends)))
        by_transfer: dict[int, list] = {}
        for m in sends:
            if len(m.transfers) == 1:
                by_transfer.setdefault(m.transfers[0], []).append(m)
        for i, msgs in by_transfer.items():
            t = plan.transfers[i]
            if len(msgs) == 1 and not msgs[0].part:
                assert not chunk or t.nbytes <= chunk or (_contiguous(plan, i, "src") and _contiguous(plan, i, "dst"))
                continue
            split += 1
            assert chunk and not (_contiguous(plan, i, "src") and _contiguous(plan, i, "dst")), t.tensor
            dims = {m.part[0] for m in msgs}
            assert len(dims) == 1
            (dim,) = dims
            assert all(n == 1 for n in t.item.lengths[:dim]) and t.item.lengths[dim] > 1
            starts = [m.part[1] for m in msgs]
            ends = [m.part[1] + m.part[2] for m in msgs]
            assert starts[0] == 0 and ends[-1] == t.item.lengths[dim] and starts[1:] == ends[:-1], t.tensor
            step = t.nbytes // t.item.lengths[dim]
            assert all(m.nbytes == m.part[2] * step and m.nbytes <= max(chunk, step) for m in msgs)
            assert sum(m.nbytes for m in msgs) == t.nbytes
    assert (split > 0) == (chunk in (512, 3000)), split  # the strided transfers are > 3000 bytes


def test_small_transfers_travel_packed_and_unsplit():
    plan = _plan(dict(tp=2), dict(dp=2))
    for sends, _ in _both_sides(plan, coalesce=1 << 20, chunk=64).values():
        packed = [m for m in sends if m.packed]
        assert len(packed) == 1 and not packed[0].part and len(packed[0].transfers) > 1
        assert all(not m.part for m in sends)  # every transfer here is under 1 MiB
