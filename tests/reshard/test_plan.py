"""Overlap plans: exact on every layout pair, balanced over replicas, and strict on bad input."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.reshard.derive import derive_emus
from nereus.reshard.errors import CoverageError, LayoutError, MismatchError
from nereus.reshard.layout import ParallelConfig, Shard, TensorLayout
from nereus.reshard.plan import STAGED, plan_transfers
from nereus.reshard.reference import mismatches

from .strategies import configs, emu_of, grid_layouts, simulate, tiny_spec


def assert_exact(plan):
    dst = simulate(plan)
    bad = [m for r, buffers in dst.items() for m in mismatches(buffers, plan.layouts.values(), r)]
    assert bad == []


def emus(cfg, first_rank=0, dtype="float32", **kwargs):
    dp, tp, pp = cfg
    spec = tiny_spec(qkv_bias=kwargs.pop("qkv_bias", False), tie_embeddings=kwargs.pop("tied", False), dtype=dtype)
    return derive_emus(spec, ParallelConfig.on(dp=dp, tp=tp, pp=pp, first_rank=first_rank), model="actor", stage="s", **kwargs)


layout_kinds = st.sampled_from([dict(), dict(dp_shard=True), dict(fused=True)])


@settings(max_examples=60, deadline=None)
@given(configs, configs, layout_kinds, layout_kinds, st.booleans(), st.sampled_from(["float32", "bfloat16"]))
def test_random_derived_layout_pairs_are_exact(a, b, ka, kb, tied, dtype):
    src = emus(a, dtype=dtype, tied=tied, qkv_bias=True, **ka)
    dst = emus(b, dtype=dtype, tied=tied, qkv_bias=True, **kb)
    assert_exact(plan_transfers(src, dst))


@settings(max_examples=80, deadline=None)
@given(grid_layouts(name="x", world=4, dtype="int64"), grid_layouts(name="y", world=4, dtype="bfloat16"), st.data())
def test_random_grid_layouts_are_exact(x, y, data):
    x2 = data.draw(grid_layouts(name="x", world=4, dtype="int64", shape=x.shape))
    y2 = data.draw(grid_layouts(name="y", world=4, dtype="bfloat16", shape=y.shape))
    assert_exact(plan_transfers([emu_of([x, y], 4)], [emu_of([x2, y2], 4, stage="t")]))


def test_same_layout_moves_nothing_between_ranks():
    src = emus((2, 2, 1), optimizer=True)
    plan = plan_transfers(src, emus((2, 2, 1), optimizer=True))
    assert all(t.src_rank == t.dst_rank for t in plan.transfers)


def test_training_to_fused_rollout_layout_is_exact_and_mostly_local():
    src = emus((2, 2, 1), optimizer=True, qkv_bias=True)
    dst = emus((1, 4, 1), fused=True, qkv_bias=True)
    plan = plan_transfers(src, dst)
    assert_exact(plan)
    assert {n for n in plan.layouts} == {n for n in plan.layouts if not n.startswith("optim/")}


def test_replicated_sources_share_the_sending():
    # Four full replicas on ranks 0..3 feed a TP4 layout on ranks 4..7.
    src = emus((4, 1, 1))
    dst = emus((1, 4, 1), first_rank=4)
    sent = Counter()
    for (s, d), nbytes in plan_transfers(src, dst).bytes_between().items():
        sent[s] += nbytes
    total = sum(sent.values())
    assert set(sent) == {0, 1, 2, 3}
    assert max(sent.values()) < 0.4 * total  # an even split is 0.25


def test_rank_plan_is_the_global_plan_restricted_to_that_rank():
    src, dst = emus((2, 2, 1), optimizer=True), emus((1, 2, 2), optimizer=True)
    whole = plan_transfers(src, dst)
    for rank in range(4):
        mine = plan_transfers(src, dst, ranks={rank})
        expected = [t for t in whole.transfers if rank in (t.src_rank, t.dst_rank)]
        assert sorted(map(repr, mine.transfers)) == sorted(map(repr, expected))


def test_dead_source_is_read_from_the_staged_checkpoint():
    src, dst = emus((1, 2, 2)), emus((1, 4, 1))
    plan = plan_transfers(src, dst, live={0, 1, 2}, staged=True)
    staged = [t for t in plan.transfers if t.src_rank == STAGED]
    assert staged and all(t.src_rank != 3 for t in plan.transfers)
    assert_exact(plan)


def test_dead_source_without_staged_checkpoint_names_the_region():
    src, dst = emus((1, 2, 2)), emus((1, 4, 1))
    with pytest.raises(CoverageError, match=r"rank \d is held only by ranks \[3\], none live"):
        plan_transfers(src, dst, live={0, 1, 2})


def test_a_live_replica_covers_for_a_dead_one():
    src, dst = emus((2, 2, 1)), emus((1, 4, 1))
    plan = plan_transfers(src, dst, live={0, 1})
    assert {t.src_rank for t in plan.transfers} <= {0, 1}
    assert_exact(plan)


def one(name, shape, dtype="float32", rank=0):
    return TensorLayout(name=name, shape=shape, dtype=dtype, shards=(Shard(rank=rank, offsets=(0,) * len(shape), lengths=shape),))


@pytest.mark.parametrize(
    "target, error, message",
    [
        (one("w", (4, 3)), MismatchError, r"'w': source shape \(4, 4\) != target shape \(4, 3\)"),
        (one("w", (4, 4), "bfloat16"), MismatchError, "'w': source dtype float32 != target dtype bfloat16"),
        (one("v", (4,)), MismatchError, "target tensor 'v' is not in the source"),
    ],
)
def test_mismatched_targets_are_rejected(target, error, message):
    with pytest.raises(error, match=message):
        plan_transfers([emu_of([one("w", (4, 4))], 1)], [emu_of([target], 1)])


def test_replicas_that_disagree_on_shape_are_rejected():
    a = emu_of([one("w", (4, 4))], 1)
    b = emu_of([one("w", (4, 5), rank=0)], 1)
    with pytest.raises(LayoutError, match="source replicas disagree on tensor 'w'"):
        plan_transfers([a, b], [a])


def test_source_that_does_not_cover_a_target_box_is_rejected():
    partial = TensorLayout.trusted(name="w", shape=(4,), dtype="float32", shards=(Shard(rank=0, offsets=(0,), lengths=(2,)),))
    from nereus.reshard.layout import EMU

    src = EMU.trusted(model="m", stage="s", replica=0, config=ParallelConfig.on(), ranks=(0,), tensors=(partial,))
    with pytest.raises(CoverageError, match=r"'w': target box at offsets \(0,\) lengths \(4,\) is only 2 of 4"):
        plan_transfers([src], [emu_of([one("w", (4,))], 1)])


def test_source_replicas_that_cut_a_tensor_differently_are_named():
    """Two replicas of one source, one cut in halves by rows, the other by columns: the
    error says the replicas disagree and names both boxes, not a coverage count."""
    import pytest

    from nereus.reshard.errors import LayoutError
    from nereus.reshard.layout import EMU, ParallelConfig, Shard, TensorLayout

    def emu(replica, shards, ranks):
        layout = TensorLayout(name="w", shape=(4, 4), dtype="float32", shards=tuple(Shard(rank=r, offsets=o, lengths=n) for r, o, n in shards))
        config = ParallelConfig(tp=2, ranks=ranks)
        return EMU(model="m", stage="s", replica=replica, config=config, ranks=ranks, tensors=(layout,))

    rows = emu(0, [(0, (0, 0), (2, 4)), (1, (2, 0), (2, 4))], (0, 1))
    cols = emu(1, [(2, (0, 0), (4, 2)), (3, (0, 2), (4, 2))], (2, 3))
    whole = TensorLayout(name="w", shape=(4, 4), dtype="float32", shards=(Shard(rank=0, offsets=(0, 0), lengths=(4, 4)),))
    target = EMU(model="m", stage="t", replica=0, config=ParallelConfig(ranks=(0,)), ranks=(0,), tensors=(whole,))
    with pytest.raises(LayoutError, match=r"source replicas disagree on tensor 'w': the box at offsets \[0, 0\] lengths \[2, 4\] "
                                          r"\(ranks \[0\]\) and the box at offsets \[0, 0\] lengths \[4, 2\] \(ranks \[2\]\)"):
        plan_transfers([rows, cols], [target])
