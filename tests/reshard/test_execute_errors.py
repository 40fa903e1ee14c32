"""Bad input is rejected on EVERY rank before any byte moves, naming the culprit (staged
bytes that fail their checksum are found as they are read, and every rank raises after the
last round); the source state is intact afterwards; a memory budget no stream schedule
meets goes staged.

All scenarios run in one 2-rank spawn (module fixture), one after the other on the same
process group — which also shows that a rejected transition leaves the group usable.
The last scenario (a peer that never sends) breaks the group, so it runs last.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from nereus.reshard.derive import derive_emus
from nereus.reshard.errors import CoverageError
from nereus.reshard.layout import ParallelConfig
from nereus.reshard.plan import plan_transfers
from nereus.reshard.reference import mismatches, reference_state
from nereus.reshard.staged import box_file, save_staged
from tests.distributed_harness import run_distributed

from .strategies import tiny_spec
from .test_stream import derived, graph_for

DOWN = "model.layers.0.mlp.down_proj.weight"  # (32, 64), tp=2 splits dim 1: rank 1 holds columns 32..64


def _on(ranks, stage, **kw):
    return derive_emus(tiny_spec(), ParallelConfig(tp=len(ranks), ranks=tuple(ranks)), model="actor", stage=stage, **kw)


def _attempt(out: dict, key: str, rank: int, plan, src, fn) -> None:
    try:
        fn()
        out[key] = ("ok", "")
    except Exception as e:  # noqa: BLE001 - the parent asserts on class and message
        out[key] = (type(e).__name__, str(e))
    out[key + "/source"] = mismatches(src, plan.src_layouts.values(), rank)


def _scenarios(rank: int, world: int, root: str) -> dict:
    from nereus.reshard import staged_load as staged_mod, stream
    from nereus.reshard.execute import execute, plan_or_stage, reshard

    out: dict = {}
    spare = dist.new_group([0, 1])  # a second group for the silent peer under NCCL's semantics
    tp2, tp1 = derived(dict(tp=2), stage="s"), derived(dict(tp=1), stage="t")
    plan = plan_transfers(tp2, tp1)
    src = reference_state(plan.src_layouts.values(), rank)

    big = plan_transfers(derived(dict(tp=4), stage="s"), tp1)  # names ranks 2 and 3
    _attempt(out, "outside", rank, plan, src, lambda: execute(big, graph_for(big), src, rank=rank))

    broken = dict(src)
    if rank == 1:
        del broken["model.embed_tokens.weight"]
    else:
        broken["lm_head.weight"] = torch.zeros(3, 5)
    _attempt(out, "buffers", rank, plan, src, lambda: execute(plan, graph_for(plan), broken, rank=rank))

    staged = plan_transfers(tp2, tp1, live={0}, staged=True)  # rank 1's shards: staged only
    _attempt(out, "no path", rank, plan, src, lambda: execute(staged, graph_for(staged), src, rank=rank))

    if rank == 0:  # rank 0 stages its boxes; rank 1's are never written
        save_staged(f"{root}/partial", plan.src_layouts, src, rank=0)
    dist.barrier()
    run = lambda path, **kw: execute(staged, graph_for(staged), src, rank=rank, staged_path=path, **kw)  # noqa: E731
    _attempt(out, "missing box", rank, plan, src, lambda: run(f"{root}/partial"))

    save_staged(f"{root}/full", plan.src_layouts, src, rank=rank, checksums=True)
    dist.barrier()
    if rank == 0:
        victim = f"{root}/full/{box_file(DOWN, (0, 32), 0)}"
        data = bytearray(open(victim, "rb").read())
        data[100] ^= 0x10
        open(victim, "wb").write(bytes(data))
    dist.barrier()
    _attempt(out, "corrupt box", rank, plan, src, lambda: run(f"{root}/full", checksums=True))

    real_crc = stream.crc32
    if rank == 0:
        stream.crc32 = lambda t: real_crc(t) ^ 1
    _attempt(out, "stream checksum", rank, plan, src, lambda: execute(plan, graph_for(plan), src, rank=rank, checksums=True))
    stream.crc32 = real_crc

    # ranks that planned differently (rank 1 schedules one message a round): an error, not a hang
    other = graph_for(plan, max_messages=1) if rank == 1 else graph_for(plan)
    _attempt(out, "planned differently", rank, plan, src, lambda: execute(plan, other, src, rank=rank))

    # a damaged metadata.json on one rank's view, and an exception of any class on another
    save_staged(f"{root}/meta", plan.src_layouts, src, rank=rank, live={rank}, checksums=True)
    dist.barrier()
    if rank == 0:
        with open(f"{root}/meta/metadata.json", "r+b") as f:
            f.truncate(40)
    dist.barrier()
    _attempt(out, "truncated metadata", rank, plan, src, lambda: run(f"{root}/meta"))
    real_check = staged_mod.StagedReader.check
    if rank == 0:  # the rank that reads staged regions here (the target is tp=1 on rank 0)
        staged_mod.StagedReader.check = lambda self, items, **kw: {}["no such key"]
    _attempt(out, "any exception", rank, plan, src, lambda: run(f"{root}/full"))
    staged_mod.StagedReader.check = real_check

    swap = plan_transfers(_on([0, 1], "s"), _on([1, 0], "t"))  # every byte changes rank
    mine = reference_state(swap.src_layouts.values(), rank)
    budget = sum(t.nbytes for t in mine.values())  # the sources fit, sources + any target do not
    out["graph under budget"] = plan_or_stage(swap, budget=budget, release_sources=True)
    res = reshard(swap, mine, rank=rank, budget=budget, staged_path=f"{root}/budget", release_sources=True)
    out["budget"] = mismatches(res, swap.layouts.values(), rank), res.stats.rounds, res.stats.bytes_staged, sorted(mine)
    mine = reference_state(swap.src_layouts.values(), rank)
    res = reshard(swap, mine, rank=rank, budget=4 * budget, staged_path=f"{root}/unused")
    out["no budget"] = mismatches(res, swap.layouts.values(), rank), res.stats.rounds, res.stats.bytes_staged

    # the staged fallback: a box damaged after it was staged is found by the rank that loads it
    from nereus.reshard import execute as execute_mod

    real_save = execute_mod.save_staged

    def save_then_damage(path, layouts, buffers, *, rank, **kw):
        written = real_save(path, layouts, buffers, rank=rank, **kw)
        if rank == 0:
            victim = next(p for p in written if DOWN in p)
            data = bytearray(open(victim, "rb").read())
            data[7] ^= 0x80
            open(victim, "wb").write(bytes(data))
        return written

    execute_mod.save_staged = save_then_damage
    mine = reference_state(swap.src_layouts.values(), rank)
    _attempt(out, "staged fallback corrupt", rank, swap, mine,
             lambda: execute_mod.reshard_staged(swap, mine, rank=rank, path=f"{root}/fallback", checksums=True))
    execute_mod.save_staged = real_save
    # a wrong target buffer on one rank: refused in the agreement, on every rank at once
    # (tp=2 -> dp=2: each rank copies some regions locally, where the bad target used to fail outside any agreement)
    dp2 = plan_transfers(tp2, derived(dict(dp=2), stage="t"))
    bad_dst = {}
    if rank == 0:
        name = sorted(dp2.dst_buffers[0])[0]
        bad_dst[name] = torch.empty(3, dtype=torch.float32)
    mine = reference_state(dp2.src_layouts.values(), rank)
    start = time.monotonic()
    _attempt(out, "staged fallback bad target", rank, dp2, mine,
             lambda: execute_mod.reshard_staged(dp2, mine, rank=rank, path=f"{root}/bad-dst", dst_buffers=bad_dst,
                                                timeout=20))
    out["staged fallback bad target/seconds"] = time.monotonic() - start

    from .fake_nccl import fake_nccl

    real_round = stream.run_round
    if rank == 1:  # a peer that agrees, then never sends
        stream.run_round = lambda ctx, ops: None
    import os

    for n, (key, group, transport) in enumerate((("silent peer", None, None), ("silent peer, NCCL", spare, fake_nccl()))):
        marker = f"{root}/silent-{n}"
        if rank == 1:  # start together: rank 0 is past its previous timeout (the broken group cannot tell)
            deadline = time.monotonic() + 20
            while n and not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)
        start = time.monotonic()
        _attempt(out, key, rank, plan, src, lambda: execute(plan, graph_for(plan), src, rank=rank, timeout=1.5,
                                                            group=group, transport=transport))
        out[key + "/seconds"] = time.monotonic() - start
        if rank == 0:
            open(f"{root}/silent-{n + 1}", "w").close()
    if rank == 1:
        time.sleep(4)  # alive while rank 0 waits out its deadline
    stream.run_round = real_round
    return out


@pytest.fixture(scope="module")
def results():
    root = tempfile.mkdtemp(prefix="nereus-test-", dir="/dev/shm")
    try:
        yield run_distributed(_scenarios, 2, root, timeout=120)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _same_error_everywhere(results, key: str, cls: str, *needles: str) -> str:
    errors = {r[key] for r in results}
    assert len(errors) == 1, errors  # every rank raised, and the same thing
    (got_cls, msg), = errors
    assert got_cls == cls, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    for r in results:
        assert r[key + "/source"] == []  # nothing moved
    return msg


@pytest.mark.timeout(130)
def test_plan_naming_a_rank_outside_the_group(results):
    _same_error_everywhere(results, "outside", "ProcessGroupError", "rank(s) [2, 3]", "not in the process group")


@pytest.mark.timeout(130)
def test_missing_or_wrong_source_buffer_on_one_rank(results):
    _same_error_everywhere(
        results, "buffers", "ProcessGroupError",
        "rank 1: source buffer 'model.embed_tokens.weight'", "missing",
        "rank 0: source buffer 'lm_head.weight' is [3, 5] float32, the plan needs [32, 32] float32",
    )


@pytest.mark.timeout(130)
def test_staged_transfers_without_a_staged_path(results):
    _same_error_everywhere(results, "no path", "CoverageError", "no staged_path was given")


@pytest.mark.timeout(130)
def test_missing_staged_box_file(results):
    _same_error_everywhere(results, "missing box", "CoverageError", "rank 0: staged box file", ".bin", "is missing")


@pytest.mark.timeout(130)
def test_corrupted_staged_box_with_checksums(results):
    _same_error_everywhere(results, "corrupt box", "TransferError", box_file(DOWN, (0, 32), 0), "corrupted")


@pytest.mark.timeout(130)
def test_corrupted_message_with_checksums(results):
    msg = _same_error_everywhere(results, "stream checksum", "TransferError", "checksum mismatch", "from rank 1 to rank 0")
    assert "model." in msg  # names the tensors of the bad message


@pytest.mark.timeout(130)
def test_memory_budget_no_stream_schedule_meets_goes_staged(results):
    for r in results:
        assert r["graph under budget"] is None
        bad, rounds, staged_bytes, left = r["budget"]
        assert bad == [] and rounds == 0 and staged_bytes > 0 and left == []  # staged, exact, sources released
        bad, rounds, staged_bytes = r["no budget"]
        assert bad == [] and rounds > 0 and staged_bytes == 0  # a budget that fits streams


@pytest.mark.timeout(130)
def test_a_staged_fallback_load_that_fails_on_one_rank_fails_every_rank(results):
    """Rank 1 reads the box rank 0 staged, damaged since: verified on the bytes its load
    reads, the failure reaches the last agreement, and rank 0 raises it too."""
    _same_error_everywhere(results, "staged fallback corrupt", "TransferError", "the staged load failed", "rank 1:",
                           DOWN, "corrupted")


@pytest.mark.timeout(130)
def test_a_wrong_target_buffer_in_the_staged_fallback_fails_every_rank_at_once(results):
    """Rank 0 hands reshard_staged a target of the wrong shape: the check runs in an
    agreement, so both ranks raise the same error naming it, without waiting out the timeout."""
    _same_error_everywhere(results, "staged fallback bad target", "ProcessGroupError", "rank 0:", "target buffer",
                           "the plan needs")
    assert all(r["staged fallback bad target/seconds"] < 10 for r in results)


@pytest.mark.timeout(130)
def test_ranks_that_planned_differently_all_raise(results):
    _same_error_everywhere(results, "planned differently", "ProcessGroupError", "planned different transitions",
                           "rank 0:", "rank 1:")


@pytest.mark.timeout(130)
def test_a_truncated_staged_metadata_file_fails_every_rank_naming_it(results):
    _same_error_everywhere(results, "truncated metadata", "CoverageError", "rank 0:", "meta/metadata.json",
                           "not valid JSON")


@pytest.mark.timeout(130)
def test_an_exception_of_any_class_on_one_rank_reaches_the_agreement(results):
    _same_error_everywhere(results, "any exception", "ReshardError", "rank 0: KeyError", "no such key")


@pytest.mark.timeout(130)
@pytest.mark.parametrize("key", ["silent peer", "silent peer, NCCL"])
def test_a_peer_that_never_sends_times_out_naming_it(results, key):
    """Also under NCCL's semantics, whose ``wait(timeout)`` blocks past its timeout (the
    fake's blocks until the peer sends, i.e. forever): the deadline is polled, not delegated."""
    assert results[1][key] == ("ok", "")
    cls, msg = results[0][key]
    assert cls == "TransitionTimeout", msg
    assert "rank 1" in msg and "destroy it and create a new one" in msg, msg
    assert 1.5 <= results[0][key + "/seconds"] < 4.0  # one deadline for the whole call
    assert results[0][key + "/source"] == []


# ------------------------------------------------ one deadline, the pre-check included

STALLS = {0: 2.0, 1: 4.5}  # seconds each rank's staged pre-check takes (a slow store)
DEADLINE = 3.0


def _stalled_precheck(rank: int, world: int, root: str) -> dict:
    """Both ranks' pre-checks stall (rank 1's past the deadline), then execute() runs under
    ``timeout=DEADLINE``. The deadline starts when the call does, so rank 0 times out at
    DEADLINE in the agreement and rank 1, done stalling after it, raises at once."""
    from nereus.reshard import execute as execute_mod

    tp2, tp1 = derived(dict(tp=2), stage="s"), derived(dict(tp=1), stage="t")
    plan = plan_transfers(tp2, tp1, live={0}, staged=True)  # rank 1's shards come from the staged checkpoint
    src = reference_state(plan.src_layouts.values(), rank)
    save_staged(root, plan.src_layouts, src, rank=rank)
    dist.barrier()
    real = execute_mod.check_staged

    def slow(*args, **kwargs):
        time.sleep(STALLS[rank])
        if rank == 1:  # late AND failed: its own verdict must not be dropped
            raise CoverageError("rank 1's own pre-check failed")
        return real(*args, **kwargs)

    execute_mod.check_staged = slow
    out: dict = {}
    start = time.monotonic()
    _attempt(out, "stalled", rank, plan, src, lambda: execute_mod.execute(plan, graph_for(plan), src, rank=rank,
                                                                          staged_path=root, timeout=DEADLINE))
    out["stalled/seconds"] = time.monotonic() - start
    execute_mod.check_staged = real
    time.sleep(max(0.0, max(STALLS.values()) + 1.5 - (time.monotonic() - start)))  # both alive till both are done
    return out


@pytest.mark.timeout(120)
def test_a_stall_before_the_agreement_counts_against_the_one_deadline():
    """The deadline used to start after the pre-check: rank 0 then waited DEADLINE beyond its
    own stall, long enough for rank 1 to arrive, and the transition ran on well past it."""
    root = tempfile.mkdtemp(prefix="nereus-test-", dir="/dev/shm")
    try:
        results = run_distributed(_stalled_precheck, 2, root, timeout=100)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for rank, out in enumerate(results):
        cls, msg = out["stalled"]
        assert cls == "TransitionTimeout", (rank, cls, msg)
        assert "destroy it and create a new one" in msg, msg
        assert out["stalled/source"] == []
    assert results[0]["stalled/seconds"] < DEADLINE + 1.0, results[0]  # at the deadline, not DEADLINE after the stall
    late = results[1]["stalled"][1]
    assert "rank 1" in late and "after the transition's deadline" in late
    # it names the agreement it was late for, not a failure description, and keeps its own verdict
    assert "reached the agreement before streaming" in late and "rejected on every rank" not in late, late
    assert "CoverageError: rank 1's own pre-check failed" in late, late
    assert results[1]["stalled/seconds"] < STALLS[1] + 1.0, results[1]  # at once once its stall ends
