"""Transition graphs: every transfer once, within message slots and memory budgets, replayed."""

import time
from collections import Counter, defaultdict

import numpy as np
import pytest

from nereus.reshard.arrays import LINK_CLASSES, TransferArrays, arrays_from_plan
from nereus.reshard.derive import DecoderSpec, derive_emus
from nereus.reshard.errors import MemoryBudgetError
from nereus.reshard.estimate import estimate_transfers
from nereus.reshard.graph import FREED_BEFORE, KEPT, STAGED_PIECE_BYTES, plan_graph
from nereus.reshard.links import LinkCost, calibrate
from nereus.reshard.layout import ParallelConfig, Shard, TensorLayout
from nereus.reshard.plan import STAGED, plan_transfers

from .strategies import emu_of, tiny_spec


def emus(cfg, first_rank=0, **kwargs):
    dp, tp, pp = cfg
    spec = tiny_spec(qkv_bias=True, dtype=kwargs.pop("dtype", "float32"))
    config = ParallelConfig.on(dp=dp, tp=tp, pp=pp, first_rank=first_rank)
    return derive_emus(spec, config, model="a", stage="s", **kwargs)


def replay(graph, budget=None) -> dict[int, int]:
    """Re-run the schedule from ``ops_for`` alone, checking everything; the peak per rank.

    Per rank: start with every source buffer; per round allocate, check that writes land in
    allocated buffers and reads come from held ones, add the round's transients (strided
    regions of non-local transfers, and non-local transfers under ``graph.coalesce`` bytes,
    which travel packed, on both sides; a round's staged reads share one allowance of
    ``STAGED_PIECE_BYTES``, a verified read's piece), then free. Across ranks: every transfer exactly once,
    a send and its receive in the same round, at most ``max_messages`` messages per rank
    and round.
    """
    a: TransferArrays = graph.arrays
    ranks = sorted(set(a.src_buffers.rank.tolist()) | set(a.dst_buffers.rank.tolist()) | set(a.dst.tolist()))
    seen = defaultdict(list)  # transfer -> [(role, round)]
    peaks = {}
    for rank in ranks:
        src = {n: b for r, n, b in zip(a.src_buffers.rank, a.src_buffers.name, a.src_buffers.nbytes) if r == rank}
        dst = {n: b for r, n, b in zip(a.dst_buffers.rank, a.dst_buffers.name, a.dst_buffers.nbytes) if r == rank}
        held, holding, allocated = set(src), sum(src.values()), set()
        peak = holding
        last = -2
        for ops in graph.ops_for(rank):
            assert ops.round > last
            last = ops.round
            assert len(ops.sends) + len(ops.recvs) <= graph.max_messages
            assert list(ops.sends) == sorted(ops.sends) and list(ops.recvs) == sorted(ops.recvs)
            for name in ops.allocs:
                assert name not in allocated
                allocated.add(name)
                holding += dst[name]
            transient = reads = 0
            for role, ids in (("copy", ops.copies), ("send", ops.sends), ("recv", ops.recvs)):
                for i in ids:
                    seen[i].append((role, ops.round))
                    small = a.src[i] != STAGED and a.nbytes[i] < graph.coalesce
                    if role == "recv" and a.src[i] == STAGED:
                        assert a.dst_buffers.name[a.dst_buf[i]] in allocated
                        reads = STAGED_PIECE_BYTES
                    elif role in ("copy", "recv"):
                        assert a.dst_buffers.name[a.dst_buf[i]] in allocated
                        transient += 0 if role == "copy" or (a.dst_contig[i] and not small) else int(a.nbytes[i])
                    if role in ("copy", "send"):
                        assert a.src_buffers.name[a.src_buf[i]] in held
                        transient += 0 if role == "copy" or (a.src_contig[i] and not small) else int(a.nbytes[i])
            peak = max(peak, holding + transient + reads)
            for name in ops.frees:
                held.remove(name)
                holding -= src[name]
        if budget is not None:
            assert peak <= budget, f"rank {rank}: {peak} > {budget}"
        assert allocated == set(dst)
        peaks[rank] = peak
    for i in range(len(a)):
        local, staged = a.src[i] == a.dst[i], a.src[i] == STAGED
        roles = sorted(seen[i])
        want = ["copy"] if local else (["recv"] if staged else ["recv", "send"])
        assert [r for r, _ in roles] == want, (i, roles)
        assert len({k for _, k in roles}) == 1 and roles[0][1] == graph.round_of[i]
    assert peaks == graph.peak_bytes
    return peaks


def arrays_of(src_cfg, dst_cfg, **kwargs):
    shift = kwargs.pop("shift", 0)
    return estimate_transfers(emus(src_cfg, optimizer=True), emus(dst_cfg, first_rank=shift, optimizer=True), **kwargs)


@pytest.mark.parametrize("src, dst", [((2, 2, 1), (1, 2, 2)), ((1, 4, 1), (2, 1, 2)), ((2, 1, 2), (1, 4, 1))])
@pytest.mark.parametrize("max_messages", [1, 3, 16])
@pytest.mark.parametrize("release", [False, True])
def test_unbounded_schedule_is_complete_and_within_slots(src, dst, max_messages, release):
    graph = plan_graph(arrays_of(src, dst, shift=1), max_messages=max_messages, release_sources=release)
    replay(graph)
    assert graph.num_rounds == int(graph.round_of.max()) + 1
    a = graph.arrays
    remote = a.src != a.dst
    msgs = np.bincount(a.src[remote & (a.src >= 0)], minlength=16) + np.bincount(a.dst[remote], minlength=16)
    assert graph.num_rounds >= -(-msgs.max() // max_messages)
    if not release:
        assert (graph.free_round == KEPT).all()


@pytest.mark.parametrize("fraction", [1.0, 0.9, 0.8])
@pytest.mark.parametrize("src, dst", [((2, 2, 1), (1, 4, 1)), ((1, 4, 1), (2, 1, 2))])
def test_a_budget_that_fits_is_respected(src, dst, fraction):
    arrays = arrays_of(src, dst, shift=2)  # coalesce=0: only strided regions are transient here
    free = plan_graph(arrays, release_sources=True, max_messages=2, coalesce=0)
    budget = int(fraction * max(free.peak_bytes.values()))
    graph = plan_graph(arrays, budget=budget, release_sources=True, max_messages=2, coalesce=0)
    replay(graph, budget)
    assert max(graph.peak_bytes.values()) <= budget


def test_without_release_the_budget_must_hold_sources_and_targets():
    arrays = arrays_of((2, 2, 1), (1, 4, 1), shift=2)
    free = plan_graph(arrays, max_messages=2)
    need = max(free.peak_bytes.values())
    replay(plan_graph(arrays, budget=need, max_messages=2), need)
    with pytest.raises(MemoryBudgetError):
        plan_graph(arrays, budget=int(0.95 * need), max_messages=2)


def test_per_rank_budgets_bind_only_their_rank():
    arrays = arrays_of((2, 2, 1), (1, 4, 1), shift=2)
    free = plan_graph(arrays, release_sources=True)
    budget = {r: p for r, p in free.peak_bytes.items() if r % 2 == 0}
    graph = plan_graph(arrays, budget=budget, release_sources=True)
    replay(graph)
    assert all(graph.peak_bytes[r] <= b for r, b in budget.items())


def test_too_small_a_budget_names_the_rank_and_the_shortfall():
    arrays = arrays_of((2, 2, 1), (1, 4, 1), shift=2)
    holding = arrays.src_buffers.bytes_per_rank()
    budget = max(holding.values()) + 1  # the sources fit, sources and targets together do not
    with pytest.raises(MemoryBudgetError, match=r"rank (\d+) would need (\d+) bytes .* over its budget of") as raised:
        plan_graph(arrays, budget=budget)
    rank = int(raised.value.args[0].split("rank ")[1].split()[0])
    assert rank in arrays.dst_buffers.rank.tolist()
    with pytest.raises(MemoryBudgetError, match=r"rank \d+ holds \d+ bytes of source buffers .* over its budget"):
        plan_graph(arrays, budget=min(holding.values()) - 1)


def whole(name, rank, size):
    shard = Shard(rank=rank, offsets=(0,), lengths=(size,))
    return TensorLayout(name=name, shape=(size,), dtype="float32", shards=(shard,))


def moves(size, before, after):
    """Whole 1-d tensors of ``size`` float32 moving between ranks: {name: rank} before and after."""
    world = 1 + max([*before.values(), *after.values()])
    src = [emu_of([whole(n, r, size) for n, r in before.items()], world)]
    dst = [emu_of([whole(n, r, size) for n, r in after.items()], world, stage="t")]
    return arrays_from_plan(plan_transfers(src, dst))


def swap_arrays(size=1000):
    """Rank 0 holds x, rank 1 holds y; afterwards rank 0 holds y and rank 1 holds x."""
    return moves(size, {"x": 0, "y": 1}, {"x": 1, "y": 0})


def test_release_sources_lowers_the_peak():
    # Rank 0 hands x to rank 1, then takes y from rank 2: one message per round.
    arrays = moves(1000, {"x": 0, "y": 2}, {"x": 1, "y": 0})  # coalesce=0: no packing transients
    kept = plan_graph(arrays, max_messages=1, coalesce=0)
    freed = plan_graph(arrays, max_messages=1, release_sources=True, coalesce=0)
    assert kept.num_rounds == freed.num_rounds == 2
    replay(kept), replay(freed)
    assert freed.peak_bytes[0] == 4000 < kept.peak_bytes[0] == 8000
    # ... and makes a budget feasible that is not without it.
    replay(plan_graph(arrays, max_messages=1, release_sources=True, budget=4000, coalesce=0), 4000)
    with pytest.raises(MemoryBudgetError, match="rank 0 would need 8000 bytes .* 4000 over its budget of 4000"):
        plan_graph(arrays, max_messages=1, budget=4000, coalesce=0)
    # counted as packed (the default), each 4000-byte message also costs its staging
    assert plan_graph(arrays, max_messages=1, release_sources=True).peak_bytes[0] == 8000


def test_the_budget_reorders_rounds():
    # By priority rank 0 would first take y (shift 3 -> 0 is 1) and then hand x on (shift 2),
    # holding both for a round; a budget of one tensor forces x out first.
    arrays = moves(1000, {"x": 0, "y": 3}, {"x": 2, "y": 0})
    free = plan_graph(arrays, max_messages=1, release_sources=True, coalesce=0)
    assert free.round_of.tolist() == [1, 0] and free.peak_bytes[0] == 8000
    graph = plan_graph(arrays, max_messages=1, release_sources=True, budget={0: 4000}, coalesce=0)
    replay(graph)
    assert graph.round_of.tolist() == [0, 1] and graph.peak_bytes[0] == 4000


def test_unread_sources_are_freed_before_round_zero():
    sources, targets = emus((1, 2, 1), optimizer=True), emus((1, 2, 1), first_rank=2)
    graph = plan_graph(estimate_transfers(sources, targets), release_sources=True)
    unread = graph.free_round == FREED_BEFORE
    assert unread.any()
    names = {graph.arrays.src_buffers.name[i] for i in np.flatnonzero(unread)}
    assert all(n.startswith("optim/") for n in names)
    first = graph.ops_for(0)[0]
    assert first.round == -1 and set(first.frees) <= names and not (first.sends or first.recvs or first.allocs)
    replay(graph)


def test_staged_reads_count_on_the_receiver_only():
    arrays = estimate_transfers(emus((1, 2, 2)), emus((1, 4, 1), first_rank=4), live={0, 1, 2}, staged=True)
    graph = plan_graph(arrays, max_messages=2)
    replay(graph)  # a staged read is a receive with no send
    staged = np.flatnonzero(arrays.src == STAGED)
    assert len(staged) and STAGED not in graph.peak_bytes
    for i in staged.tolist():
        ops = {o.round: o for o in graph.ops_for(int(arrays.dst[i]))}
        assert i in ops[int(graph.round_of[i])].recvs


def _staged_reads(sizes: list[int]):
    """Rank 0 reads one float32 tensor of each size (elements) from the staged checkpoint."""
    def layouts(rank):
        return [TensorLayout(name=f"t{i}", shape=(n,), dtype="float32", shards=(Shard(rank=rank, offsets=(0,), lengths=(n,)),))
                for i, n in enumerate(sizes)]

    return arrays_from_plan(plan_transfers([emu_of(layouts(1), 2)], [emu_of(layouts(0), 2, stage="t")], live={0}, staged=True))


def test_a_rounds_staged_reads_share_the_largest_ones_allowance():
    """The reader holds at most one piece at a time, of STAGED_PIECE_BYTES (a verified read
    fetches whole checksum blocks, however small its region): a round's staged reads share
    that one allowance, not their sum."""
    arrays = _staged_reads([250, 750, 500])  # 1000, 3000 and 2000 bytes
    assert (arrays.src == STAGED).all()
    graph = plan_graph(arrays, max_messages=3)
    assert graph.num_rounds == 1 and graph.peak_bytes[0] == 6000 + STAGED_PIECE_BYTES
    replay(graph)
    assert plan_graph(_staged_reads([2 << 20]), max_messages=1).peak_bytes[0] == (8 << 20) + STAGED_PIECE_BYTES
    tight = plan_graph(arrays, max_messages=3, budget=6000 + STAGED_PIECE_BYTES)  # summed: 6000 + 3 pieces
    replay(tight, 6000 + STAGED_PIECE_BYTES)
    assert tight.num_rounds == 1, tight.round_of
    with pytest.raises(MemoryBudgetError):
        plan_graph(arrays, max_messages=3, budget=6000 + STAGED_PIECE_BYTES - 1)


def test_seconds_grow_with_bytes_and_follow_the_link_classes():
    small = plan_graph(arrays_of((2, 2, 1), (1, 4, 1)))
    big_src = emus((2, 2, 1), optimizer=True, dtype="float64")
    big = plan_graph(estimate_transfers(big_src, emus((1, 4, 1), optimizer=True, dtype="float64")))
    assert big.seconds > small.seconds > 0
    assert np.isclose(small.round_seconds.sum(), small.seconds)
    slow_cross = LinkCost(beta={"cross": 1e6}, ranks_per_node=1)
    assert plan_graph(small.arrays, cost=slow_cross).seconds > 10 * small.seconds


def test_round_seconds_is_the_slowest_rank():
    arrays = swap_arrays(size=250_000)  # 1 MB each way
    cost = LinkCost(alpha=(0.0, 1e-3, 1e-3, 0.0), beta=(1e9, 1e9, 1e9, 1e9), ranks_per_node=2)
    graph = plan_graph(arrays, max_messages=2, cost=cost)
    assert graph.num_rounds == 1  # each rank sends one and receives one: max(send, recv)
    assert graph.seconds == pytest.approx(1e-3 + 1e6 / 1e9)


def test_link_classes():
    cost = LinkCost(ranks_per_node=4)
    assert [cost.link(s, d) for s, d in [(1, 1), (1, 3), (1, 4), (STAGED, 2)]] == ["local", "node", "cross", "staged"]
    assert cost.seconds("node", 0) == cost.alpha[1]
    with pytest.raises(ValueError, match="unknown link classes"):
        LinkCost(beta={"nvlink": 1e11})


def test_calibrate_recovers_alpha_and_beta():
    truth = {"local": (2e-6, 9e9), "node": (40e-6, 1.1e9), "cross": (15e-6, 20e9)}
    rng = np.random.default_rng(0)
    samples = []
    for link, (alpha, beta) in truth.items():
        for nbytes in np.exp(rng.uniform(np.log(1 << 8), np.log(1 << 28), 60)).astype(int).tolist():
            samples.append((link, nbytes, (alpha + nbytes / beta) * (1 + rng.normal(0, 1e-3))))
    prior = LinkCost()
    fitted = calibrate(samples, prior)
    for link, (alpha, beta) in truth.items():
        i = LINK_CLASSES.index(link)
        assert fitted.beta[i] == pytest.approx(beta, rel=0.01)
        assert fitted.alpha[i] == pytest.approx(alpha, rel=0.01)
    assert fitted.alpha[3] == prior.alpha[3] and fitted.beta[3] == prior.beta[3]  # no staged samples


def test_calibrate_clamps_what_it_cannot_fit():
    prior = LinkCost()
    # A negative intercept: alpha clamps to 0, the slope goes through the origin.
    neg = calibrate([("node", n, n / 2e9 - 1e-3) for n in (1 << 20, 1 << 24, 1 << 26)], prior)
    assert neg.alpha[1] == 0 and neg.beta[1] > 0
    # Time that does not grow with size keeps the prior beta.
    flat = calibrate([("cross", n, 5e-5) for n in (1, 1 << 10, 1 << 20)] + [("cross", 1 << 21, 4e-5)], prior)
    assert flat.beta[2] == prior.beta[2] and flat.alpha[2] >= 0
    # One size only: alpha stays, beta from the mean time.
    one = calibrate([("local", 1 << 20, prior.alpha[0] + (1 << 20) / 5e9)] * 3, prior)
    assert one.alpha[0] == prior.alpha[0] and one.beta[0] == pytest.approx(5e9)


def test_schedule_is_deterministic():
    arrays = arrays_of((2, 2, 2), (1, 4, 2))
    a, b = plan_graph(arrays, budget=10**9, max_messages=3), plan_graph(arrays, budget=10**9, max_messages=3)
    np.testing.assert_array_equal(a.round_of, b.round_of)
    assert [a.ops_for(r) for r in range(8)] == [b.ops_for(r) for r in range(8)]


def test_identical_layouts_copy_locally_in_one_round():
    graph = plan_graph(estimate_transfers(emus((2, 2, 1)), emus((2, 2, 1))))
    assert (graph.arrays.src == graph.arrays.dst).all()
    assert graph.num_rounds == 1 and [len(graph.ops_for(r)) for r in range(4)] == [1, 1, 1, 1]
    replay(graph)


def test_no_transfers_is_one_empty_round():
    graph = plan_graph(swap_arrays(size=0))
    assert len(graph.arrays) == 0 and graph.num_rounds == 1 and graph.seconds == 0


LLAMA_70B = DecoderSpec(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    dtype="bfloat16",
)


@pytest.mark.slow
def test_llama_70b_on_1024_ranks():
    """TP8·PP8·DP16 -> TP4·PP16·DP16 with AdamW state: estimate + graph in about a second."""
    start = time.perf_counter()
    src = derive_emus(LLAMA_70B, ParallelConfig.on(tp=8, pp=8, dp=16), model="actor", stage="train", optimizer=True)
    dst = derive_emus(LLAMA_70B, ParallelConfig.on(tp=4, pp=16, dp=16), model="actor", stage="train", optimizer=True)
    derived = time.perf_counter()
    arrays = estimate_transfers(src, dst)
    estimated = time.perf_counter()
    graph = plan_graph(arrays)
    done = time.perf_counter()
    print(
        f"\n70B, 1024 ranks: derive {derived - start:.2f} s, estimate {estimated - derived:.2f} s, "
        f"graph {done - estimated:.2f} s ({len(arrays)} transfers, {graph.num_rounds} rounds, "
        f"predicted {graph.seconds:.2f} s)"
    )
    remote = arrays.src != arrays.dst
    msgs = np.bincount(arrays.src[remote], minlength=1024) + np.bincount(arrays.dst[remote], minlength=1024)
    assert (graph.round_of >= 0).all() and len(graph.peak_bytes) == 1024
    bound = -(-msgs.max() // graph.max_messages)
    assert bound <= graph.num_rounds <= 1.25 * bound
    assert 27 <= plan_graph(arrays, max_messages=16).num_rounds <= 1.25 * 27
    # The exact plan of two ranks has the same transfers as the estimate's rows for them.
    for rank in (0, 517):
        exact = plan_transfers(src, dst, ranks={rank}).transfers
        mine = np.flatnonzero((arrays.src == rank) | (arrays.dst == rank)).tolist()
        assert Counter((t.src_rank, t.dst_rank, t.nbytes, t.src_buffer, t.dst_buffer) for t in exact) == Counter(
            (int(arrays.src[i]), int(arrays.dst[i]), int(arrays.nbytes[i]),
             arrays.src_buffers.name[arrays.src_buf[i]], arrays.dst_buffers.name[arrays.dst_buf[i]])
            for i in mine
        )
    # Releasing sources, the same transition fits in 9 GiB per rank (14.3 GiB unbounded).
    budget = 9 * 2**30
    bounded = plan_graph(arrays, budget=budget, release_sources=True)
    assert max(bounded.peak_bytes.values()) <= budget < max(graph.peak_bytes.values())
