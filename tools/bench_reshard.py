"""Benchmark: Nereus stream resharding against what PyTorch offers, and planning at scale.

    python tools/bench_reshard.py [--quick] [--out bench_results/reshard.json]

Part 1 (2 spawned gloo processes on loopback, one thread each). A Llama-shaped float32
state (default: hidden 1024, 16 heads / 4 KV heads, intermediate 3328, vocab 32000, 20
layers, tied embeddings = 182 tensors, 1.079 GiB) starts in its TP=2 layout and moves to

- "flip": every sharded weight changes its shard dimension (dim 0 <-> dim 1), 1-d norms
  stay replicated; half of every 2-d tensor crosses (each rank keeps one quarter);
- "tp2_to_replicated": every rank ends with the whole state (a TP=1 rollout engine).

For each case, each method is timed as the median of 3 runs after one warm-up; a run is
``barrier; t0; op; t1`` on every rank and counts ``max over ranks (t1 - t0)``:

- stream: ``execute_stream`` with CRC32C checksums on every message, into target buffers
  that already exist (plan_transfers and plan_graph done beforehand, timed separately as
  "planning"); ``stream-nocrc`` the same without checksums; ``stream+alloc`` also creates
  the target buffers inside the timed region (first-touch page faults included);
  ``stream+arena`` reuses one StagingArena across calls (a weight sync every step would);
  one extra stream run per case goes under cProfile (rank 0's top functions are printed);
- budget: one stream run under a memory budget (0.9 of the unbounded graph's peak with the
  sources handed over, or the least fraction of 0.9, 0.95, 1.0 that schedules), its peak
  MEASURED on each rank: the CPU allocator's own events (torch.profiler, every allocation
  and free) summed from before the sources exist; ``peak_over_budget`` = the highest
  rank's measured peak / the budget given to the graph (bar <= 1.0);
- dcp: ``dcp.save`` of the source as DTensors to /dev/shm, then ``dcp.load`` into DTensors
  over the target buffers (directory removed between runs, outside the timing);
- redistribute: ``DTensor.redistribute`` of every tensor from source to target placements
  on a 2-rank DeviceMesh (the outputs are new tensors);
- allgather: ``all_gather`` every tensor's shards, ``cat``, copy the target box into the
  target buffer;
- handwritten: the minimal hand-written P2P executor: per rank pair, pack every outgoing
  region into one preallocated contiguous buffer, one ``batch_isend_irecv``, local copies
  meanwhile, unpack (the floor plus the memory copies any executor has to make);
- floor: one ``batch_isend_irecv`` per rank pair carrying exactly the bytes that must
  cross (``TransferPlan.bytes_between`` without local copies), between contiguous
  preallocated buffers: the least any executor could do with gloo;
- copies: the memory copies no executor can skip, with no network: pack every strided
  source region that must cross, copy every region that stays on its rank, unpack every
  strided target region that arrives (staging preallocated and touched). Both ranks copy
  at once, sharing memory bandwidth as they would mid-transfer. On this 2-core machine the
  floor's transfer already keeps both cores busy (its CPU time, printed, is ~0.9 of its wall time),
  so nothing can hide these copies behind it: floor + copies is the lower bound here, and
  ``stream_over_bound`` is the stream's distance from it.

The stream result is checked bit for bit against ``reshard.reference`` once per case
(``--check-all`` checks every method).

Part 2 (one process, skipped by --quick): Llama-3-70B with AdamW state on 1,024 ranks,
TP8·PP8·DP16 -> TP4·PP16·DP16: time to derive the EMUs, ``plan_global_s`` =
estimate_transfers + plan_graph, ``plan_rank_s`` = plan_transfers for one middle rank,
and the growth of the process's peak RSS while planning.

The last printed line is one JSON object (keys: stream_over_dcp, stream_over_redistribute,
stream_over_floor, plan_global_s, plan_rank_s, peak_over_budget, then extras). Absolute seconds depend on
the machine and on what else runs; compare ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nereus.reshard.derive import DecoderSpec, derive_emus, state_nbytes  # noqa: E402
from nereus.reshard.layout import EMU, ParallelConfig, Shard, TensorLayout, local_buffers, box_view  # noqa: E402
from nereus.reshard.plan import plan_transfers  # noqa: E402
from nereus.reshard.reference import fill_reference, make_buffers, mismatches  # noqa: E402

FULL_SPEC = DecoderSpec(
    vocab_size=32000, hidden_size=1024, intermediate_size=3328, num_layers=20,
    num_heads=16, num_kv_heads=4, tie_embeddings=True, dtype="float32",
)
QUICK_SPEC = DecoderSpec(
    vocab_size=8000, hidden_size=256, intermediate_size=768, num_layers=20,
    num_heads=8, num_kv_heads=4, tie_embeddings=True, dtype="float32",
)
LLAMA3_70B = DecoderSpec(
    vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
    num_heads=64, num_kv_heads=8, dtype="bfloat16",
)
CASES = ("flip", "tp2_to_replicated")
METHODS = ("stream", "stream-nocrc", "stream+alloc", "stream+arena", "dcp", "redistribute", "allgather", "handwritten", "floor",
           "copies", "floor+copies")
BARS = {"stream_over_dcp": 3.0, "stream_over_redistribute": 3.0, "stream_over_floor": 1.5, "plan_global_s": 1.0, "plan_rank_s": 1.0,
        "peak_over_budget": 1.0}
AT_MOST = ("stream_over_floor", "plan_global_s", "plan_rank_s", "peak_over_budget")


# ----------------------------------------------------------------------------- layouts


def source_emus(spec: DecoderSpec) -> list[EMU]:
    """The TP=2 training layout on ranks 0, 1."""
    return derive_emus(spec, ParallelConfig.on(tp=2), model="actor", stage="train")


def flipped(layout: TensorLayout) -> TensorLayout:
    """The same tensor with its shard dimension swapped (0 <-> 1); replicated stays so."""
    dim = shard_dim(layout)
    if dim is None:
        return layout
    new = 1 - dim
    part = layout.shape[new] // 2
    shards = []
    for rank in (0, 1):
        offsets = [0, 0]
        lengths = list(layout.shape)
        offsets[new], lengths[new] = rank * part, part
        shards.append(Shard(rank=rank, offsets=tuple(offsets), lengths=tuple(lengths)))
    return TensorLayout(name=layout.name, shape=layout.shape, dtype=layout.dtype, shards=tuple(shards))


def target_emus(spec: DecoderSpec, case: str) -> list[EMU]:
    if case == "tp2_to_replicated":
        return derive_emus(spec, ParallelConfig.on(dp=2), model="actor", stage="rollout")
    (src,) = source_emus(spec)
    return [EMU(model="actor", stage="flip", replica=0, config=src.config, ranks=src.ranks,
                tensors=tuple(flipped(t) for t in src.tensors))]


def shard_dim(layout: TensorLayout) -> int | None:
    """The dimension a 2-rank layout splits in two halves (rank r holds half r), or None."""
    full = [s for s in layout.shards if s.lengths == layout.shape]
    if len(full) == len(layout.shards):
        return None
    shards = sorted(layout.shards, key=lambda s: s.rank)
    dims = [d for d, (n, s) in enumerate(zip(shards[0].lengths, layout.shape)) if n != s]
    if len(shards) != 2 or len(dims) != 1:
        raise ValueError(f"{layout.name}: not an even 2-way split: {layout.shards}")
    d = dims[0]
    for r, s in enumerate(shards):
        if s.rank != r or s.offsets[d] != r * layout.shape[d] // 2 or s.lengths[d] * 2 != layout.shape[d]:
            raise ValueError(f"{layout.name}: shard of rank {s.rank} is not half {r} of dim {d}")
    return d


def placement(layout: TensorLayout):
    from torch.distributed.tensor import Replicate, Shard as DShard

    d = shard_dim(layout)
    return Replicate() if d is None else DShard(d)


# ----------------------------------------------------------------------------- timing


def _sync_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(op, *, runs: int, before=None, after_first=None) -> list[float]:
    """[max over ranks of one run's seconds] for 1 warm-up + ``runs`` runs; warm-up first."""
    out = []
    for i in range(runs + 1):
        if before is not None:
            before(i)
        dist.barrier()
        t0 = time.perf_counter()
        op()
        dt = time.perf_counter() - t0
        out.append(_sync_max(dt))
        if i == 0 and after_first is not None:
            after_first()
    return out


def _summary(times: list[float]) -> dict:
    runs = times[1:]
    return {"median_s": statistics.median(runs), "runs_s": runs, "warmup_s": times[0]}


# ----------------------------------------------------------------------------- methods (one rank)


def _check(name: str, buffers, layouts, rank: int, errors: dict) -> None:
    bad = mismatches(buffers, layouts, rank)
    dist.barrier()
    errors[name] = bad[:5] + ([f"... {len(bad) - 5} more"] if len(bad) > 5 else [])


def _poison(buffers) -> None:
    for b in buffers.values():
        b.fill_(float("nan")) if b.dtype.is_floating_point else b.fill_(0)


def bench_stream(ctx, dst, *, runs, check) -> dict:
    import inspect

    from nereus.reshard.stream import execute_stream

    plan, graph, src, rank = ctx["plan"], ctx["graph"], ctx["src"], ctx["rank"]
    last: dict = {}
    _poison(dst)

    def run():
        last["result"] = execute_stream(plan, graph, src, rank=rank, dst_buffers=dst, checksums=True)

    def run_nocrc():
        execute_stream(plan, graph, src, rank=rank, dst_buffers=dst)

    def run_alloc():
        out = execute_stream(plan, graph, src, rank=rank, dst_buffers=make_buffers(plan.dst_buffers[rank]), checksums=True)
        del out

    res = {"stream": _summary(timed(run, runs=runs, after_first=lambda: _check("stream", dst, plan.layouts.values(), rank, check)))}
    res["stream"]["stats_rank"] = _stats(last.get("result"))
    res["stream"]["profile_rank"] = _profile(run)
    res["stream-nocrc"] = _summary(timed(run_nocrc, runs=runs))
    res["stream+alloc"] = _summary(timed(run_alloc, runs=runs))
    if "staging" in inspect.signature(execute_stream).parameters:  # a caller that keeps its staging arena
        from nereus.reshard.stream import StagingArena

        arena = StagingArena()

        def run_arena():
            last["result"] = execute_stream(plan, graph, src, rank=rank, dst_buffers=dst, staging=arena, checksums=True)

        res["stream+arena"] = _summary(timed(run_arena, runs=runs))
        res["stream+arena"]["stats_rank"] = _stats(last.get("result"))
    return res


def _profile(op, top: int = 12) -> list[str]:
    """One more run under cProfile: this rank's top functions by own time (where time goes)."""
    import cProfile
    import io
    import pstats

    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    op()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    total = next((line.strip() for line in lines if "function calls" in line), "")
    return [total] + [line.rstrip() for line in lines[start:] if line.strip()]


def _stats(result) -> dict | None:
    """The executor's own account of one run on this rank (phases, bytes, messages)."""
    stats = getattr(result, "stats", None)
    if stats is None:
        return None
    out = {k: getattr(stats, k) for k in ("rounds", "bytes_sent", "bytes_received", "bytes_copied",
                                          "staging_bytes", "seconds", "phases") if hasattr(stats, k)}
    samples = getattr(stats, "samples", None)
    if samples is not None:
        out["messages_received"] = len(samples)
        out["recv_link_seconds"] = sum(s.seconds for s in samples)
        out["recv_bytes_per_link_second"] = (sum(s.nbytes for s in samples) / out["recv_link_seconds"]
                                             if out["recv_link_seconds"] else None)
    return out


def bench_dcp(ctx, dst, *, runs, check, do_check, root: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    plan, src, rank, mesh = ctx["plan"], ctx["src"], ctx["rank"], ctx["mesh"]

    def dtensors(buffers, layouts):
        return {
            name: DTensor.from_local(buffers[name], mesh, [placement(t)], run_check=False,
                                     shape=torch.Size(t.shape), stride=_strides(t.shape))
            for name, t in layouts.items()
        }

    save_sd = dtensors(src, plan.src_layouts)
    load_sd = dtensors(dst, plan.layouts)
    phases: dict[str, list[float]] = {"save": [], "load": []}

    def clean(i):
        if rank == 0 and root.exists():
            shutil.rmtree(root)

    def run():
        t0 = time.perf_counter()
        dcp.save(save_sd, checkpoint_id=str(root))
        t1 = time.perf_counter()
        dcp.load(load_sd, checkpoint_id=str(root))
        phases["save"].append(t1 - t0)
        phases["load"].append(time.perf_counter() - t1)

    if do_check:
        _poison(dst)
    times = timed(run, runs=runs, before=clean,
                  after_first=(lambda: _check("dcp", dst, plan.layouts.values(), rank, check)) if do_check else None)
    clean(0)
    res = _summary(times)
    res["save_s_rank"] = statistics.median(phases["save"][1:])
    res["load_s_rank"] = statistics.median(phases["load"][1:])
    return {"dcp": res}


def _strides(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


def bench_redistribute(ctx, *, runs, check, do_check) -> dict:
    from torch.distributed.tensor import DTensor

    plan, src, rank, mesh = ctx["plan"], ctx["src"], ctx["rank"], ctx["mesh"]
    pairs = [
        (DTensor.from_local(src[name], mesh, [placement(plan.src_layouts[name])], run_check=False,
                            shape=torch.Size(t.shape), stride=_strides(t.shape)), [placement(t)], name)
        for name, t in plan.layouts.items()
    ]
    outs: dict[str, torch.Tensor] = {}

    def run():
        outs.clear()
        for dt, target, name in pairs:
            outs[name] = dt.redistribute(mesh, target).to_local()

    after = (lambda: _check("redistribute", outs, plan.layouts.values(), rank, check)) if do_check else None
    res = _summary(timed(run, runs=runs, after_first=after))
    outs.clear()
    return {"redistribute": res}


def bench_allgather(ctx, dst, *, runs, check, do_check) -> dict:
    plan, src, rank = ctx["plan"], ctx["src"], ctx["rank"]
    work = []
    for name, t in plan.layouts.items():
        d = shard_dim(plan.src_layouts[name])
        (mine,) = [s for s in t.shards if s.rank == rank]
        work.append((name, d, mine))

    def run():
        for name, d, mine in work:
            local = src[name]
            if d is None:
                full = local
            else:
                parts = [torch.empty_like(local) for _ in range(2)]
                dist.all_gather(parts, local)
                full = torch.cat(parts, dim=d)
            dst[name].copy_(box_view(full, mine.offsets, mine.lengths))

    if do_check:
        _poison(dst)
    after = (lambda: _check("allgather", dst, plan.layouts.values(), rank, check)) if do_check else None
    return {"allgather": _summary(timed(run, runs=runs, after_first=after))}


def bench_floor(ctx, *, runs) -> dict:
    plan, rank = ctx["plan"], ctx["rank"]
    between = plan.bytes_between()
    peers = sorted({p for pair in between for p in pair if p != rank and p >= 0})
    bufs = []
    for peer in peers:
        send = torch.zeros(between.get((rank, peer), 0), dtype=torch.uint8)
        recv = torch.zeros(between.get((peer, rank), 0), dtype=torch.uint8)
        bufs.append((peer, send, recv))

    cpu: list[float] = []

    def run():
        c0 = _cpu_s()
        for peer, send, recv in bufs:  # one batch per rank pair
            ops = []
            if send.numel():
                ops.append(dist.P2POp(dist.isend, send, peer))
            if recv.numel():
                ops.append(dist.P2POp(dist.irecv, recv, peer))
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait()
        cpu.append(_cpu_s() - c0)

    res = _summary(timed(run, runs=runs))
    res["cpu_s_rank"] = statistics.median(cpu[1:])  # this process's CPU seconds (all threads, user + system)
    return {"floor": res}


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def bench_copies(ctx, dst, *, runs) -> dict:
    """The copies any executor must make here, without the transfer (module docstring):
    pack strided crossing sources, copy the local regions, unpack strided arrivals."""
    plan, src, rank = ctx["plan"], ctx["src"], ctx["rank"]
    packs, unpacks, local = [], [], []
    for t in plan.transfers:
        if t.src_rank == rank == t.dst_rank:
            local.append(t)
        elif t.src_rank == rank and not t.src_view(src).is_contiguous():
            packs.append((t, torch.zeros(t.nbytes, dtype=torch.uint8)))
        elif t.dst_rank == rank and not t.dst_view(dst).is_contiguous():
            unpacks.append((t, torch.zeros(t.nbytes, dtype=torch.uint8)))

    def typed(raw, like):
        return raw.view(like.dtype).view(like.shape)

    def run():
        for t, raw in packs:
            view = t.src_view(src)
            typed(raw, view).copy_(view)
        for t in local:
            t.dst_view(dst).copy_(t.src_view(src))
        for t, raw in unpacks:
            view = t.dst_view(dst)
            view.copy_(typed(raw, view))

    res = _summary(timed(run, runs=runs))
    res["bytes_rank"] = {"pack": sum(r.numel() for _, r in packs), "local": sum(t.nbytes for t in local),
                         "unpack": sum(r.numel() for _, r in unpacks)}
    return {"copies": res}


def bench_handwritten(ctx, dst, *, runs, check, do_check) -> dict:
    """The minimal hand-written executor: per peer, pack every outgoing region into one
    preallocated contiguous buffer, one batch_isend_irecv, local copies while bytes move,
    then unpack. The floor plus the memory copies no executor can avoid here."""
    plan, src, rank = ctx["plan"], ctx["src"], ctx["rank"]
    copies = [t for t in plan.transfers if t.src_rank == rank == t.dst_rank]
    peers: dict[int, tuple[list, list]] = {}
    for t in plan.transfers:
        if t.src_rank == rank and t.dst_rank != rank:
            peers.setdefault(t.dst_rank, ([], []))[0].append(t)
        elif t.dst_rank == rank and t.src_rank != rank:
            peers.setdefault(t.src_rank, ([], []))[1].append(t)
    bufs = {p: (torch.zeros(sum(t.nbytes for t in s), dtype=torch.uint8),
                torch.zeros(sum(t.nbytes for t in r), dtype=torch.uint8)) for p, (s, r) in peers.items()}

    def pieces(raw, transfers):
        off = 0
        for t in transfers:
            yield t, raw.narrow(0, off, t.nbytes)
            off += t.nbytes

    def run():
        works = []
        for peer, (sends, recvs) in sorted(peers.items()):
            send, recv = bufs[peer]
            for t, piece in pieces(send, sends):
                view = t.src_view(src)
                piece.view(view.dtype).view(view.shape).copy_(view)
            ops = [dist.P2POp(dist.isend, send, peer)] if send.numel() else []
            ops += [dist.P2POp(dist.irecv, recv, peer)] if recv.numel() else []
            works += dist.batch_isend_irecv(ops) if ops else []
        for t in copies:
            t.dst_view(dst).copy_(t.src_view(src))
        for w in works:
            w.wait()
        for peer, (_, recvs) in sorted(peers.items()):
            for t, piece in pieces(bufs[peer][1], recvs):
                view = t.dst_view(dst)
                view.copy_(piece.view(view.dtype).view(view.shape))

    if do_check:
        _poison(dst)
    after = (lambda: _check("handwritten", dst, plan.layouts.values(), rank, check)) if do_check else None
    return {"handwritten": _summary(timed(run, runs=runs, after_first=after))}


SENTINEL = 123_457  # bytes of the marker allocation that opens the measured window


def bench_budget(ctx) -> dict:
    """One budgeted stream run, its peak measured (module docstring): sources cloned inside
    the profiled region and handed over, targets allocated by the executor."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import OpTree

    from nereus.reshard.arrays import arrays_from_plan
    from nereus.reshard.errors import MemoryBudgetError
    from nereus.reshard.graph import RESERVE_BYTES, plan_graph
    from nereus.reshard.stream import execute_stream

    plan, src, rank = ctx["plan"], ctx["src"], ctx["rank"]
    arrays = arrays_from_plan(plan)
    free = plan_graph(arrays, release_sources=True)
    unbounded = max(free.peak_bytes.values())
    for fraction in (0.9, 0.95, 1.0):
        budget = int(fraction * unbounded)
        try:
            graph = plan_graph(arrays, budget=budget, release_sources=True, reserve=RESERVE_BYTES)  # as reshard() plans
            break
        except MemoryBudgetError:
            continue
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mine = {n: src[n].clone() for n in plan.src_buffers.get(rank, {})}
        entry = sum(t.nbytes for t in mine.values())
        opens = torch.empty(SENTINEL, dtype=torch.uint8)
        del opens
        t0 = time.perf_counter()
        out = execute_stream(plan, graph, mine, rank=rank, release_sources=True, checksums=True)
        seconds = time.perf_counter() - t0
        closes = torch.empty(SENTINEL, dtype=torch.uint8)  # the window ends with the call
        del closes
        bad = mismatches(out, plan.layouts.values(), rank)
        del out, mine
    live = top = 0
    base, markers = None, 0
    for e in OpTree(prof.profiler.kineto_results).sorted_nodes:
        if e.typed[0] != _EventType.Allocation or e.typed[1].device.type != "cpu":
            continue
        size = e.typed[1].alloc_size
        live += size
        if size == SENTINEL:
            markers += 1
            if markers == 1:
                base = top = live - size
        elif markers == 1 and size != -SENTINEL:
            top = max(top, live)
    measured = top - base + entry
    return {"budget": {"budget_bytes": budget, "fraction": fraction, "rounds": graph.num_rounds,
                       "unbounded_rounds": free.num_rounds, "graph_peak_bytes_rank": graph.peak_bytes.get(rank),
                       "measured_peak_bytes_rank": measured, "peak_over_budget_rank": measured / budget,
                       "median_s": _sync_max(seconds), "exact": not bad}}


# ----------------------------------------------------------------------------- worker


def plan_case(src_emus, dst_emus):
    """(plan, graph, seconds): the exact plan and its transition graph (None if missing)."""
    t0 = time.perf_counter()
    plan = plan_transfers(src_emus, dst_emus)
    t1 = time.perf_counter()
    try:
        from nereus.reshard.arrays import arrays_from_plan
        from nereus.reshard.graph import plan_graph
    except ImportError:
        return plan, None, {"plan_transfers_s": t1 - t0, "graph": "missing: one unbounded round"}
    arrays = arrays_from_plan(plan)
    t2 = time.perf_counter()
    graph = plan_graph(arrays)
    t3 = time.perf_counter()
    return plan, graph, {"plan_transfers_s": t1 - t0, "arrays_s": t2 - t1, "plan_graph_s": t3 - t2}


def worker(rank: int, world: int, spec: DecoderSpec, runs: int, check_all: bool, shm: str) -> dict:
    """One rank of part 1: every case, every method. Returns timings (max over ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    src_emus = source_emus(spec)
    src_layouts = list(src_emus[0].tensors)
    src = make_buffers(local_buffers(src_layouts, rank))
    t0 = time.perf_counter()
    fill_reference(src, src_layouts, rank)
    fill_s = _sync_max(time.perf_counter() - t0)
    out: dict = {"reference_fill_s": fill_s, "cases": {}}
    for case in CASES:
        dst_emus = target_emus(spec, case)
        res: dict = {"errors": {}, "check": {}}
        plan, graph, planning = plan_case(src_emus, dst_emus)
        res["planning"] = {k: (_sync_max(v) if isinstance(v, float) else v) for k, v in planning.items()}
        if graph is not None:
            res["graph"] = {"num_rounds": graph.num_rounds, "estimate_s": graph.seconds,
                            "peak_bytes": {str(k): v for k, v in graph.peak_bytes.items()}}
        between = plan.bytes_between()
        res["bytes_between"] = {f"{s}->{d}": n for (s, d), n in sorted(between.items())}
        res["crossing_bytes"] = sum(n for (s, d), n in between.items() if s != d)
        ctx = {"plan": plan, "graph": graph, "src": src, "rank": rank, "mesh": mesh}
        dst = make_buffers(plan.dst_buffers[rank])
        for b in dst.values():
            b.zero_()  # first touch outside every timed region
        steps = [
            ("stream", lambda: bench_stream(ctx, dst, runs=runs, check=res["check"])),
            ("dcp", lambda: bench_dcp(ctx, dst, runs=runs, check=res["check"], do_check=check_all, root=Path(shm) / case)),
            ("redistribute", lambda: bench_redistribute(ctx, runs=runs, check=res["check"], do_check=check_all)),
            ("allgather", lambda: bench_allgather(ctx, dst, runs=runs, check=res["check"], do_check=check_all)),
            ("handwritten", lambda: bench_handwritten(ctx, dst, runs=runs, check=res["check"], do_check=check_all)),
            ("floor", lambda: bench_floor(ctx, runs=runs)),
            ("copies", lambda: bench_copies(ctx, dst, runs=runs)),
            ("budget", lambda: bench_budget(ctx)),
        ]
        res["methods"] = {}
        for name, step in steps:
            try:
                res["methods"].update(step())
            except ImportError:  # a module not written yet fails on every rank alike: go on
                res["errors"][name] = traceback.format_exc(limit=2)
            except Exception:
                res["errors"][name] = traceback.format_exc(limit=6)
                raise  # the ranks may be out of step after a failure: stop
        methods = res["methods"]
        if "floor" in methods and "copies" in methods:
            methods["floor+copies"] = {"median_s": methods["floor"]["median_s"] + methods["copies"]["median_s"],
                                       "sum_of": ["floor", "copies"]}
        out["cases"][case] = res
        steps = ctx = dst = None  # the buffers go before the next case (the lambdas above hold them)
    return out


# ----------------------------------------------------------------------------- part 2


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_scale() -> dict:
    """Planning Llama-3-70B + AdamW, 1,024 ranks, TP8·PP8·DP16 -> TP4·PP16·DP16, one process."""
    import gc

    from nereus.reshard.estimate import estimate_transfers
    from nereus.reshard.graph import plan_graph

    out: dict = {"transition": "dp=16,tp=8,pp=8 -> dp=16,tp=4,pp=16 (1,024 ranks), Llama-3-70B bf16 + AdamW"}
    rss0 = _maxrss_bytes()
    t0 = time.perf_counter()
    src = derive_emus(LLAMA3_70B, ParallelConfig.on(dp=16, tp=8, pp=8), model="actor", stage="train", optimizer=True)
    dst = derive_emus(LLAMA3_70B, ParallelConfig.on(dp=16, tp=4, pp=16), model="actor", stage="train", optimizer=True)
    out["derive_s"] = time.perf_counter() - t0
    out["tensors_per_emu"] = len(src[0].tensors)
    out["shards"] = sum(len(t.shards) for e in src + dst for t in e.tensors)
    out["state_bytes_all_replicas"] = state_nbytes(src)
    gc.collect()
    rss1 = _maxrss_bytes()
    t0 = time.perf_counter()
    arrays = estimate_transfers(src, dst)
    t1 = time.perf_counter()
    graph = plan_graph(arrays)
    t2 = time.perf_counter()
    out["estimate_s"], out["graph_s"] = t1 - t0, t2 - t1
    out["plan_global_s"] = t2 - t0
    out["graph"] = {"num_rounds": graph.num_rounds, "estimate_s": graph.seconds,
                    "max_peak_bytes": max(graph.peak_bytes.values()) if graph.peak_bytes else 0}
    rss2 = _maxrss_bytes()
    del arrays, graph
    gc.collect()
    t0 = time.perf_counter()  # again, warm: what a controller that re-plans pays each time
    plan_graph(estimate_transfers(src, dst))
    out["plan_global_warm_s"] = time.perf_counter() - t0
    rank = 512
    t0 = time.perf_counter()
    plan = plan_transfers(src, dst, ranks={rank})
    out["plan_rank_s"] = time.perf_counter() - t0
    out["plan_rank"] = rank
    out["plan_rank_transfers"] = len(plan.transfers)
    rss3 = _maxrss_bytes()
    out["peak_rss_bytes"] = rss3
    out["rss_growth_derive_bytes"] = rss1 - rss0
    out["rss_growth_plan_global_bytes"] = rss2 - rss1
    out["rss_growth_plan_rank_bytes"] = rss3 - rss2
    return out


# ----------------------------------------------------------------------------- report


def _load() -> float:
    return os.getloadavg()[0]


def report(result: dict, verbose: bool = True) -> dict:
    """Print the table and the bars; return the summary dict (the last line)."""
    print(f"\nstate: {result['state']['tensors']} tensors, {result['state']['bytes']:,} bytes "
          f"({result['state']['bytes'] / 2**30:.3f} GiB) float32, TP=2 on 2 ranks")
    header = f"{'case':<18} {'method':<13} {'seconds':>9} {'GB/s':>7} {'x stream':>9}"
    print(header + "\n" + "-" * len(header))
    for case, res in result["cases"].items():
        gb = res["crossing_bytes"] / 1e9
        stream = res["methods"].get("stream", {}).get("median_s")
        planning = res["planning"]
        planned = "planned in " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in planning.items())
        print(f"{case:<18} crossing {gb:.3f} GB; {planned}")
        for m in METHODS:
            if m not in res["methods"] or "median_s" not in res["methods"][m]:
                continue
            s = res["methods"][m]["median_s"]
            ratio = f"{s / stream:9.2f}" if stream else f"{'-':>9}"
            print(f"{'':<18} {m:<13} {s:9.3f} {gb / s:7.2f} {ratio}")
        for name, bad in res["check"].items():
            print(f"{'':<18} check {name}: {'exact' if not bad else bad}")
        budget = res["methods"].get("budget")
        if budget:
            print(f"{'':<18} budget {budget['budget_bytes'] / 1e9:.3f} GB ({budget['fraction']:.2f} of the unbounded peak): "
                  f"{budget['rounds']} rounds (unbounded {budget['unbounded_rounds']}), rank 0 measured peak "
                  f"{budget['measured_peak_bytes_rank'] / 1e9:.3f} GB = {budget['peak_over_budget_rank']:.4f} of the budget "
                  f"(graph {budget['graph_peak_bytes_rank'] / 1e9:.3f} GB), {budget['median_s']:.3f} s, "
                  f"{'exact' if budget['exact'] else 'WRONG'}")
        for name, err in res["errors"].items():
            print(f"{'':<18} {name} FAILED: {err.strip().splitlines()[-1]}")
        for m in ("stream", "stream+arena"):
            stats = res["methods"].get(m, {}).get("stats_rank")
            if stats:
                phases = ", ".join(f"{k} {v:.3f}" for k, v in stats.get("phases", {}).items())
                rate = stats.get("recv_bytes_per_link_second")
                print(f"{'':<18} {m} rank 0: {stats.get('rounds')} rounds, {stats.get('messages_received')} messages in"
                      f" at {(rate or 0) / 1e9:.2f} GB/s of link time, staging {stats.get('staging_bytes', 0) / 1e6:.0f} MB"
                      + (f", phases(s): {phases}" if phases else ""))
        floor, copies = res["methods"].get("floor", {}), res["methods"].get("copies", {})
        if "cpu_s_rank" in floor:
            print(f"{'':<18} floor rank 0: {floor['cpu_s_rank']:.3f} CPU s in {floor['median_s']:.3f} s "
                  f"({floor['cpu_s_rank'] / floor['median_s']:.2f} of a core, all threads)")
        if "bytes_rank" in copies:
            print(f"{'':<18} copies rank 0 (GB): " + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in copies["bytes_rank"].items()))
        if "graph" in res:
            print(f"{'':<18} graph: {res['graph']['num_rounds']} rounds, estimate {res['graph']['estimate_s']:.3f} s, "
                  f"peak {max(res['graph']['peak_bytes'].values()) / 1e9:.2f} GB/rank")
        if verbose and res["methods"].get("stream", {}).get("profile_rank"):
            print(f"{'':<18} stream profile, rank 0, one run (top by own time):")
            for line in res["methods"]["stream"]["profile_rank"][:10]:
                print(f"{'':<20}{line}")
    flip = result["cases"].get("flip", {}).get("methods", {})

    def ratio(num: str, den: str):
        if num in flip and den in flip:
            return flip[num]["median_s"] / flip[den]["median_s"]
        return None

    scale = result.get("scale") or {}
    peaks = [r["methods"]["budget"]["peak_over_budget"] for r in result["cases"].values() if "budget" in r["methods"]]
    summary = {
        "stream_over_dcp": ratio("dcp", "stream"),
        "stream_over_redistribute": ratio("redistribute", "stream"),
        "stream_over_floor": ratio("stream", "floor"),
        "plan_global_s": scale.get("plan_global_s"),
        "plan_rank_s": scale.get("plan_rank_s"),
        "peak_over_budget": max(peaks) if peaks else None,
        "crc_cost": ratio("stream", "stream-nocrc"),
        "stream_over_bound": ratio("stream", "floor+copies"),
        "arena_over_bound": ratio("stream+arena", "floor+copies"),
        "arena_over_floor": ratio("stream+arena", "floor"),
        "bound_over_floor": ratio("floor+copies", "floor"),
    }
    if scale:
        summary["plan_global_warm_s"] = scale["plan_global_warm_s"]
    rep = result["cases"].get("tp2_to_replicated", {}).get("methods", {})
    if "stream" in rep:
        summary["replicated_stream_over_dcp"] = rep["dcp"]["median_s"] / rep["stream"]["median_s"]
        summary["replicated_stream_over_redistribute"] = rep["redistribute"]["median_s"] / rep["stream"]["median_s"]
        summary["replicated_stream_over_floor"] = rep["stream"]["median_s"] / rep["floor"]["median_s"]
    if "stream" in flip and "handwritten" in flip:
        summary["stream_over_handwritten"] = ratio("stream", "handwritten")
    if "stream" in rep and "handwritten" in rep:
        summary["replicated_stream_over_handwritten"] = rep["stream"]["median_s"] / rep["handwritten"]["median_s"]
    if "stream" in flip:
        summary["flip_stream_s"] = flip["stream"]["median_s"]
        summary["flip_floor_s"] = flip["floor"]["median_s"]
    summary["quick"] = result["quick"]
    if scale:
        print(f"\nplanning at scale ({scale['transition']}): derive {scale['derive_s']:.2f} s, "
              f"estimate {scale['estimate_s']:.3f} s + graph {scale['graph_s']:.3f} s = plan_global "
              f"{scale['plan_global_s']:.3f} s (warm {scale['plan_global_warm_s']:.3f} s), plan_rank (rank {scale['plan_rank']}) {scale['plan_rank_s']:.3f} s, "
              f"peak RSS {scale['peak_rss_bytes'] / 2**30:.2f} GiB (growth: derive "
              f"{scale['rss_growth_derive_bytes'] / 2**20:.0f} MiB, global plan "
              f"{scale['rss_growth_plan_global_bytes'] / 2**20:.0f} MiB, rank plan "
              f"{scale['rss_growth_plan_rank_bytes'] / 2**20:.0f} MiB), graph {scale['graph']}")
    print("\nbars:")
    for key, bar in BARS.items():
        value = summary[key]
        if value is None:
            print(f"  {key:<26} {'n/a':>8}  SKIP")
            continue
        ok = value <= bar if key in AT_MOST else value >= bar
        sign = "<=" if key in AT_MOST else ">="
        print(f"  {key:<26} {value:8.3f}  {sign} {bar}  {'PASS' if ok else 'FAIL'}")
    return summary


def main(argv: list[str] | None = None) -> int:
    from tests.distributed_harness import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~64 MiB state, no 1,024-rank planning")
    parser.add_argument("--out", default="bench_results/reshard.json")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per method (after 1 warm-up)")
    parser.add_argument("--check-all", action="store_true", help="check every method's result, not only the stream's")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)

    spec = QUICK_SPEC if args.quick else FULL_SPEC
    emus = source_emus(spec)
    result: dict = {
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "load_avg_start": _load()},
        "state": {"spec": {f: getattr(spec, f) for f in spec.__dataclass_fields__},
                  "tensors": len(emus[0].tensors), "bytes": emus[0].nbytes},
        "timing": f"median of {args.runs} after 1 warm-up; each run max over ranks of barrier-synchronised wall time",
    }
    shm = Path("/dev/shm") / f"nereus_bench_{os.getpid()}"
    try:
        ranks = run_distributed(worker, 2, spec, args.runs, args.check_all or args.quick, str(shm), timeout=args.timeout)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    result.update(ranks[0])
    result["check_rank1"] = {c: r["check"] for c, r in ranks[1]["cases"].items()}
    for case, res in result["cases"].items():  # the highest rank's measured peak counts
        budget = res["methods"].get("budget")
        if budget:
            other = ranks[1]["cases"][case]["methods"]["budget"]
            budget["peak_over_budget"] = max(budget["peak_over_budget_rank"], other["peak_over_budget_rank"])
            budget["exact"] = budget["exact"] and other["exact"]
            if not budget["exact"]:
                res["check"]["budget"] = ["the budgeted run's result differs"]
    for case, res in result["cases"].items():  # either rank's mismatch counts
        for name, bad in ranks[1]["cases"][case]["check"].items():
            res["check"][name] = res["check"].get(name, []) + bad
    if not args.quick:
        result["scale"] = bench_scale()
    result["machine"]["load_avg_end"] = _load()
    summary = report(result)
    result["summary"] = summary
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {out}")
    print(json.dumps(summary))
    wrong = any(bad for res in result["cases"].values() for bad in res["check"].values())
    return 1 if wrong else 0  # a bar that fails is a finding; a wrong result is an error


if __name__ == "__main__":
    sys.exit(main())
