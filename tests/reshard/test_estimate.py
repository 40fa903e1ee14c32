"""The vectorized estimator equals the exact plan, row for row, on every layout pair."""

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.reshard.arrays import (
    LINK_CLASSES,
    arrays_from_plan,
    bytes_between,
    link_classes,
    region_is_contiguous,
)
from nereus.reshard.derive import derive_emus
from nereus.reshard.errors import CoverageError, LayoutError, MismatchError, ReshardError
from nereus.reshard.estimate import estimate_transfers
from nereus.reshard.layout import ParallelConfig, Shard, TensorLayout
from nereus.reshard.plan import STAGED, plan_transfers

from .strategies import emu_of, grid_layouts, tiny_spec

COLUMNS = ("src", "dst", "nbytes", "src_buf", "dst_buf", "src_contig", "dst_contig")


def emus(cfg, first_rank=0, dtype="float32", tied=False, **kwargs):
    dp, tp, pp = cfg
    spec = tiny_spec(qkv_bias=True, tie_embeddings=tied, dtype=dtype)
    config = ParallelConfig.on(dp=dp, tp=tp, pp=pp, first_rank=first_rank)
    return derive_emus(spec, config, model="actor", stage="s", **kwargs)


def assert_same(estimated, exact):
    """Every column and both buffer tables equal, in the same order."""
    for column in COLUMNS:
        np.testing.assert_array_equal(getattr(estimated, column), getattr(exact, column), err_msg=column)
    for table in ("src_buffers", "dst_buffers"):
        got, want = getattr(estimated, table), getattr(exact, table)
        assert got.name == want.name, table
        np.testing.assert_array_equal(got.rank, want.rank, err_msg=table)
        np.testing.assert_array_equal(got.nbytes, want.nbytes, err_msg=table)


def check(sources, targets, **kwargs):
    """Estimator and exact plan agree, including on the error they raise."""
    try:
        plan = plan_transfers(sources, targets, **kwargs)
    except (CoverageError, LayoutError, MismatchError) as error:
        with pytest.raises(type(error)) as raised:
            estimate_transfers(sources, targets, **kwargs)
        assert str(raised.value) == str(error)
        return None
    estimated = estimate_transfers(sources, targets, **kwargs)
    exact = arrays_from_plan(plan)
    assert_same(estimated, exact)
    assert bytes_between(estimated) == plan.bytes_between()
    return estimated


CONFIGS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2), (1, 1, 4), (4, 1, 1)]
PAIRS = [(CONFIGS[i], CONFIGS[(3 * i + 2) % len(CONFIGS)]) for i in range(len(CONFIGS))] + [((2, 2, 2), (2, 2, 2))]
KINDS = [dict(), dict(dp_shard=True), dict(fused=True), dict(optimizer=True), dict(optimizer=True, dp_shard=True)]
KIND_PAIRS = [(a, b) for a, b in itertools.product(KINDS, KINDS) if a.get("optimizer") or not b.get("optimizer")]


@pytest.mark.parametrize("a, b", list(itertools.product(CONFIGS, CONFIGS)))
def test_every_config_pair_matches_the_exact_plan(a, b):
    check(emus(a), emus(b, first_rank=1))


@pytest.mark.parametrize("ka, kb", KIND_PAIRS)
@pytest.mark.parametrize("tied", [False, True])
def test_layout_kinds_match_the_exact_plan(ka, kb, tied):
    for a, b in PAIRS:
        check(emus(a, tied=tied, **ka), emus(b, first_rank=1, tied=tied, **kb))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(CONFIGS),
    st.sampled_from(CONFIGS),
    st.sampled_from(KINDS[:3]),
    st.sampled_from(KINDS[:3]),
    st.booleans(),
    st.integers(0, 3),
    st.randoms(use_true_random=False),
)
def test_live_subsets_with_and_without_staged_match(a, b, ka, kb, staged, first, rnd):
    sources = emus(a, **ka)
    targets = emus(b, first_rank=first, **kb)
    ranks = sorted({r for e in sources for r in e.ranks})
    live = set(rnd.sample(ranks, rnd.randint(0, len(ranks))))
    check(sources, targets, live=live, staged=staged)


@settings(max_examples=80, deadline=None)
@given(grid_layouts(name="x", world=4, dtype="int64"), grid_layouts(name="y", world=4, dtype="bfloat16"), st.data())
def test_random_grid_layouts_match(x, y, data):
    x2 = data.draw(grid_layouts(name="x", world=4, dtype="int64", shape=x.shape))
    y2 = data.draw(grid_layouts(name="y", world=4, dtype="bfloat16", shape=y.shape))
    live = data.draw(st.sets(st.integers(0, 3)))
    sources, targets = [emu_of([x, y], 4)], [emu_of([x2, y2], 4, stage="t")]
    check(sources, targets)
    check(sources, targets, live=live, staged=True)
    check(sources, targets, live=live)


def test_empty_and_zero_volume_tensors():
    def layout(name, shape, cut):
        a = Shard(rank=0, offsets=(0,) * len(shape), lengths=(cut, *shape[1:]))
        b = Shard(rank=1, offsets=(cut, *(0,) * (len(shape) - 1)), lengths=(shape[0] - cut, *shape[1:]))
        return TensorLayout(name=name, shape=shape, dtype="float32", shards=(a, b))

    sources = [emu_of([layout("w", (3, 0), 1), layout("v", (4,), 4), layout("s", (2, 2), 0)], 2)]
    targets = [emu_of([layout("w", (3, 0), 2), layout("v", (4,), 1), layout("s", (2, 2), 2)], 2, stage="t")]
    estimated = check(sources, targets)
    assert estimated.nbytes.min() > 0


def test_errors_are_those_of_the_exact_plan():
    one = lambda name, shape, dtype="float32": TensorLayout(  # noqa: E731
        name=name, shape=shape, dtype=dtype, shards=(Shard(rank=0, offsets=(0,) * len(shape), lengths=shape),)
    )
    source = emu_of([one("w", (4, 4))], 1)
    for target, error in [
        (one("w", (4, 3)), MismatchError),
        (one("w", (4, 4), "bfloat16"), MismatchError),
        (one("v", (4,)), MismatchError),
    ]:
        with pytest.raises(error):
            estimate_transfers([source], [emu_of([target], 1)])
    with pytest.raises(LayoutError, match="source replicas disagree on tensor 'w'"):
        estimate_transfers([source, emu_of([one("w", (4, 5))], 1)], [source])
    with pytest.raises(CoverageError, match=r"held only by ranks \[3\], none live"):
        estimate_transfers(emus((1, 2, 2)), emus((1, 4, 1)), live={0, 1, 2})


def test_staged_rows_have_no_source_buffer():
    estimated = check(emus((1, 2, 2)), emus((1, 4, 1)), live={0, 1, 2}, staged=True)
    staged = estimated.src == STAGED
    assert staged.any() and (estimated.src_buf[staged] == -1).all() and estimated.src_contig[staged].all()


def test_link_classes_split_the_total():
    """Each row's link class (what ``LinkCost`` prices a message by) splits the bytes as the
    (src, dst) pairs do: local copies, within a node, across nodes."""
    estimated = check(emus((2, 2, 1), optimizer=True), emus((1, 2, 2), first_rank=2, optimizer=True))
    classes = link_classes(estimated.src, estimated.dst, ranks_per_node=2)
    sums = np.bincount(classes, weights=estimated.nbytes, minlength=len(LINK_CLASSES))
    split = {name: int(b) for name, b in zip(LINK_CLASSES, sums.tolist())}
    assert set(split) == set(LINK_CLASSES) and len(sums) == len(LINK_CLASSES)
    assert sum(split.values()) == int(estimated.nbytes.sum())
    pairs = bytes_between(estimated)
    assert split["local"] == sum(b for (s, d), b in pairs.items() if s == d)
    assert split["node"] == sum(b for (s, d), b in pairs.items() if s != d and s // 2 == d // 2)
    assert split["cross"] == sum(b for (s, d), b in pairs.items() if s // 2 != d // 2)


def test_row_parallel_regions_are_strided():
    # o_proj is split on dim 1: TP2 -> TP4 cuts each source shard's columns in two.
    estimated = check(emus((1, 2, 1)), emus((1, 4, 1), first_rank=2))
    assert not estimated.src_contig.all() and estimated.dst_contig.all()


@pytest.mark.parametrize(
    "lengths, extent, contiguous",
    [
        ((), (), True),
        ((1, 1, 5), (4, 4, 8), True),  # part of one row
        ((2, 4, 8), (9, 4, 8), True),  # whole rows
        ((2, 3, 8), (9, 4, 8), False),
        ((1, 3, 8), (9, 4, 8), True),
        ((4, 1), (4, 2), False),
        ((3,), (7,), True),
    ],
)
def test_region_contiguity(lengths, extent, contiguous):
    assert region_is_contiguous(lengths, extent) is contiguous


def test_untouched_buffers_are_in_the_tables():
    # The source has optimizer state the target drops: those buffers still occupy memory.
    sources, targets = emus((1, 2, 1), optimizer=True), emus((1, 2, 1))
    estimated = check(sources, targets)
    names = set(estimated.src_buffers.name)
    assert any(n.startswith("optim/") for n in names)
    read = set(estimated.src_buf.tolist())
    assert len(read) < len(estimated.src_buffers)


def test_rows_follow_random_sender_rotation():
    # Four full replicas feed a TP4 target: the rotation spreads the sending.
    estimated = check(emus((4, 1, 1)), emus((1, 4, 1), first_rank=4))
    sent = np.bincount(estimated.src, weights=estimated.nbytes)
    assert sent.max() < 0.4 * sent.sum()


def test_arrays_need_the_whole_transition():
    partial = plan_transfers(emus((1, 2, 1)), emus((1, 2, 1), first_rank=1), ranks={0})
    with pytest.raises(ReshardError, match="arrays need the whole transition"):
        arrays_from_plan(partial)


def test_estimate_is_deterministic():
    rng = random.Random(7)
    live = set(rng.sample(range(8), 5))
    a = estimate_transfers(emus((2, 2, 2)), emus((1, 4, 2)), live=live, staged=True)
    b = estimate_transfers(emus((2, 2, 2)), emus((1, 4, 2)), live=live, staged=True)
    assert_same(a, b)


@pytest.mark.parametrize("a, b", PAIRS)
@pytest.mark.parametrize("kb", [dict(), dict(fused=True), dict(dp_shard=True)])
def test_float32_into_bfloat16_casts_match_the_exact_plan(a, b, kb):
    """The weight sync's cast: target bytes, and every cast strided on its sender."""
    sources, targets = emus(a, optimizer=True), emus(b, first_rank=1, dtype="bfloat16", **kb)
    check(sources, targets)  # without cast=True: the same MismatchError on both
    estimated = check(sources, targets, cast=True)
    remote = estimated.src != STAGED
    assert not estimated.src_contig[remote].any()
