"""The gloo test harness: results per rank, child errors, hangs, and bad fns."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed_harness import run_distributed


def _all_reduce_sum(rank: int, world_size: int, scale: int) -> tuple[int, float]:
    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    return rank, t.item()


def _raise_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"boom from rank {rank}")
    return rank


def _hang_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        time.sleep(3600)
    return rank


@pytest.mark.timeout(120)
def test_results_indexed_by_rank() -> None:
    out = run_distributed(_all_reduce_sum, 4, 2, timeout=90.0)
    assert out == [(r, 2.0 * (1 + 2 + 3 + 4)) for r in range(4)]


@pytest.mark.timeout(120)
def test_child_exception_reports_rank_and_traceback() -> None:
    with pytest.raises(RuntimeError) as info:
        run_distributed(_raise_on_rank, 3, bad_rank=2, timeout=90.0)
    msg = str(info.value)
    assert "rank(s) [2]" in msg
    assert "ValueError: boom from rank 2" in msg
    assert "_raise_on_rank" in msg  # the child's traceback, not just the message


@pytest.mark.timeout(60)
def test_hanging_child_times_out_and_is_killed() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2"):
        run_distributed(_hang_on_rank, 2, bad_rank=1, timeout=10.0)
    assert time.monotonic() - start < 10.0 + 10.0  # deadline plus terminate/kill grace


def test_unpicklable_fn_is_rejected_up_front() -> None:
    with pytest.raises(TypeError, match="module-level"):
        run_distributed(lambda rank, world_size: rank, 2)
