"""A live resharding demo: one actor's state moves through the layouts an RL job uses.

Runs on 4 local gloo processes (``nereus demo``). The actor's training state (weights
and AdamW moments of a Llama-shaped decoder with GQA) starts in TP2·DP2 and goes through:

1. weight sync to a vLLM-style fused rollout layout, TP4 (training state kept);
2. TP2·DP2 → TP2·PP2 (sources released as they are sent);
3. TP2·PP2 → DP4 with FSDP-style sharded state;
4. rank 3 is lost: its shards come from the staged checkpoint taken before, and the state
   lands in TP1·DP3 on the three survivors (a subgroup; rank 3 takes no part).

After every transition each rank compares every element it holds with the reference
values (:mod:`nereus.reshard.reference`); rank 0 prints bytes moved, rounds, the
predicted and measured seconds, and whether the result is exact.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .arrays import arrays_from_plan
from .derive import DecoderSpec, derive_emus
from .execute import execute
from .graph import plan_graph
from .layout import ParallelConfig
from .plan import STAGED, merge_layouts, plan_transfers
from .reference import mismatches, reference_state
from .staged import save_staged


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    label: str
    src: tuple[int, int, int, bool, bool]  # dp, tp, pp, dp_shard, fused
    dst: tuple[int, int, int, bool, bool]
    optimizer: bool = True
    keep_source: bool = False
    lost: int | None = None


STEPS = (
    Step(label="weight sync  TP2·DP2 → fused TP4", src=(2, 2, 1, False, False), dst=(1, 4, 1, False, True), optimizer=False, keep_source=True),
    Step(label="TP2·DP2 → TP2·PP2", src=(2, 2, 1, False, False), dst=(1, 2, 2, False, False)),
    Step(label="TP2·PP2 → DP4 (sharded state)", src=(1, 2, 2, False, False), dst=(4, 1, 1, True, False)),
    Step(label="rank 3 lost: DP4 → DP3 (staged)", src=(4, 1, 1, True, False), dst=(3, 1, 1, False, False), lost=3),
)

DEMO_SPEC = DecoderSpec(
    vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=2
)


def _emus(spec: DecoderSpec, layout: tuple, stage: str, optimizer: bool):
    dp, tp, pp, dp_shard, fused = layout
    config = ParallelConfig.on(dp=dp, tp=tp, pp=pp)
    return derive_emus(spec, config, model="actor", stage=stage, optimizer=optimizer, dp_shard=dp_shard, fused=fused)


def run_worker(spec: DecoderSpec = DEMO_SPEC, checksums: bool = True) -> list[dict]:
    """The demo on this process (SPMD; RANK/WORLD_SIZE from the launcher). Rows on rank 0."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise ValueError(f"the demo runs on 4 processes, got {world}")
    staged_dir = _shared_tmpdir(rank)
    survivors = dist.new_group([0, 1, 2])  # every rank creates every group, in order
    rows = []
    try:
        for step in STEPS:
            src = _emus(spec, step.src, "train", step.optimizer)
            dst = _emus(spec, step.dst, "gen" if step.keep_source else "train", step.optimizer)
            layouts = list(merge_layouts(src, "source").values())
            buffers = reference_state(layouts, rank)
            if step.lost is not None:
                # The staged checkpoint, taken while all ranks were alive.
                save_staged(staged_dir, {t.name: t for t in layouts}, buffers, rank=rank, checksums=checksums)
                dist.barrier()
                if rank == step.lost:
                    continue
                rows.append(_transition(step, src, dst, buffers, rank, staged_dir, survivors, checksums))
            else:
                rows.append(_transition(step, src, dst, buffers, rank, staged_dir, None, checksums))
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(staged_dir, ignore_errors=True)
        dist.destroy_process_group()
    return rows


def _transition(step, src, dst, buffers, rank, staged_dir, group, checksums) -> dict:
    live = None if step.lost is None else {r for e in src for r in e.ranks} - {step.lost}
    plan = plan_transfers(src, dst, live=live, staged=step.lost is not None)
    graph = plan_graph(arrays_from_plan(plan), release_sources=not step.keep_source)
    dist.barrier(group=group)
    start = time.perf_counter()
    out = execute(
        plan, graph, buffers, rank=rank, group=group, staged_path=staged_dir,
        checksums=checksums, release_sources=not step.keep_source,
    )
    seconds = time.perf_counter() - start
    bad = len(mismatches(out, plan.layouts.values(), rank))
    totals = torch.tensor([bad, seconds * 1e6], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX, group=group)
    crossing = sum(t.nbytes for t in plan.transfers if t.src_rank not in (t.dst_rank, STAGED))
    return {
        "transition": step.label,
        "tensors": len(plan.layouts),
        "bytes_crossing": crossing,
        "bytes_staged": sum(t.nbytes for t in plan.transfers if t.src_rank == STAGED),
        "rounds": graph.num_rounds,
        "predicted_s": graph.seconds,
        "measured_s": float(totals[1]) / 1e6,
        "exact": int(totals[0]) == 0,
    }


def _shared_tmpdir(rank: int) -> str:
    """One staging directory for all local ranks (node shared memory when present)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    name = os.path.join(base, f"nereus-demo-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
    os.makedirs(name, exist_ok=True)
    return name


def format_rows(rows: list[dict]) -> str:
    head = f"{'transition':<36} {'tensors':>7} {'MB crossing':>11} {'MB staged':>9} {'rounds':>6} {'pred s':>7} {'meas s':>7}  exact"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['transition']:<36} {r['tensors']:>7} {r['bytes_crossing'] / 1e6:>11.2f} {r['bytes_staged'] / 1e6:>9.2f} "
            f"{r['rounds']:>6} {r['predicted_s']:>7.3f} {r['measured_s']:>7.3f}  {'yes' if r['exact'] else 'NO'}"
        )
    return "\n".join(lines)
