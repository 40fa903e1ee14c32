"""The stream executor on gloo: random layout pairs and the trainer's transitions, exact.

Spawning a process and importing torch costs seconds, so each test draws or lists many
layout pairs in the parent and runs them all inside ONE ``run_distributed`` call; the
children return what differs and the parent asserts it is nothing.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from nereus.reshard.derive import derive_emus
from nereus.reshard.layout import ParallelConfig
from nereus.reshard.plan import plan_transfers
from nereus.reshard.reference import mismatches, reference_state
from tests.distributed_harness import run_distributed

from .strategies import emu_of, grid_layouts, tiny_spec

WORLD = 4


# ------------------------------------------------------------------- shared helpers


def graph_for(plan, **kwargs):
    """The transition graph of a plan (arrays -> plan_graph)."""
    from nereus.reshard.arrays import arrays_from_plan
    from nereus.reshard.graph import plan_graph

    return plan_graph(arrays_from_plan(plan), **kwargs)


def derived(cfg: dict, *, stage: str, spec_kw: dict | None = None, **kwargs):
    """EMUs of the tiny Llama-shaped decoder (GQA: 2 KV heads) under ``cfg``."""
    spec = tiny_spec(**(spec_kw or {}))
    return derive_emus(spec, ParallelConfig.on(**cfg), model="actor", stage=stage, **kwargs)


def build(case: dict):
    """(source EMUs, target EMUs) of a case: derived configs or explicit grid layouts."""
    if "layouts" in case:
        src, dst = case["layouts"]
        return [emu_of(list(src), WORLD)], [emu_of(list(dst), WORLD, stage="t")]
    spec_kw = case.get("spec", {})
    return (
        derived(case["src"], stage="s", spec_kw=spec_kw, **case.get("src_kw", {})),
        derived(case["dst"], stage="t", spec_kw=spec_kw, **case.get("dst_kw", {})),
    )


def exact(plan, rank: int, out, src) -> list[str]:
    """What differs: targets against the reference, and sources that changed."""
    return mismatches(out, plan.layouts.values(), rank) + [
        f"source changed: {m}" for m in mismatches(src, plan.src_layouts.values(), rank)
    ]


# ------------------------------------------------------------------- workers (children)


def _round_trips(rank: int, world: int, cases: list[dict], root: str) -> list:
    """Every case seven times: streamed between live ranks with and without checksums
    (small transfers packed together; each in its own message; strided ones in many
    chunks, so the send ring's slots are reused), under NCCL's semantics (one coalesced
    work per round, a wait that does not enforce its timeout) with and without checksums,
    and read back from a staged checkpoint of all sources (plan with no live rank).
    Returns (case, executor, diffs)."""
    from nereus.reshard.execute import execute
    from nereus.reshard.staged import save_staged
    from nereus.reshard.stream import execute_stream

    from .fake_nccl import fake_nccl

    failures = []
    for k, case in enumerate(cases):
        sources, targets = build(case)
        plan = plan_transfers(sources, targets)
        src = reference_state(plan.src_layouts.values(), rank)
        out = execute(plan, graph_for(plan), src, rank=rank, checksums=True, timeout=60)
        if bad := exact(plan, rank, out, src):
            failures.append((k, "stream", bad[:4]))
        out = execute(plan, graph_for(plan), src, rank=rank, timeout=60)
        if bad := exact(plan, rank, out, src):
            failures.append((k, "stream without checksums", bad[:4]))
        for sums in (True, False):
            out = execute_stream(plan, graph_for(plan), src, rank=rank, checksums=sums, timeout=60, transport=fake_nccl())
            if bad := exact(plan, rank, out, src):
                failures.append((k, f"NCCL semantics, checksums={sums}", bad[:4]))
        out = execute_stream(plan, graph_for(plan, max_messages=3), src, rank=rank, checksums=True, coalesce_bytes=0)
        if bad := exact(plan, rank, out, src):
            failures.append((k, "stream, one message per transfer", bad[:4]))
        out = execute_stream(plan, graph_for(plan), src, rank=rank, checksums=True, coalesce_bytes=0, chunk_bytes=256)
        if bad := exact(plan, rank, out, src):
            failures.append((k, "stream, strided transfers in 256-byte chunks through the send ring", bad[:4]))
        path = f"{root}/case{k}"
        save_staged(path, plan.src_layouts, src, rank=rank, checksums=True)
        dist.barrier()
        staged_plan = plan_transfers(sources, targets, live=set(), staged=True)
        out = execute(staged_plan, graph_for(staged_plan), src, rank=rank, staged_path=path, checksums=k % 2 == 0)
        if bad := exact(staged_plan, rank, out, src):
            failures.append((k, f"staged, checksums={k % 2 == 0}", bad[:4]))
    return failures


def _transitions(rank: int, world: int, cases: list[tuple[str, dict]]) -> list:
    """Named trainer transitions, streamed with checksums; odd ones hand sources over."""
    from nereus.reshard.execute import execute

    failures = []
    for k, (name, case) in enumerate(cases):
        sources, targets = build(case)
        plan = plan_transfers(sources, targets)
        release = k % 2 == 1
        src = reference_state(plan.src_layouts.values(), rank)
        keep = {n: t.clone() for n, t in src.items()}
        graph = graph_for(plan, release_sources=release)
        out = execute(plan, graph, src, rank=rank, checksums=True, release_sources=release)
        bad = mismatches(out, plan.layouts.values(), rank)
        if release:
            bad += [f"source {n} not released" for n in src if n in plan.src_buffers.get(rank, {})]
        else:
            bad += [f"source {n} changed" for n, t in src.items() if not torch.equal(t, keep[n])]
        remote = sum(t.nbytes for t in plan.transfers if t.dst_rank == rank and t.src_rank != rank)
        samples = out.stats.samples
        if remote and not (samples and {s.dst for s in samples} == {rank} and out.stats.bytes_received >= remote):
            bad.append(f"stats: {remote} bytes planned in, received {out.stats.bytes_received} in {len(samples)} samples")
        if bad:
            failures.append((name, bad[:4]))
    return failures


# ----------------------------------------------------------------------------- tests

SMALL_CONFIGS = [dict(dp=d, tp=t, pp=p) for d in (1, 2) for t in (1, 2, 4) for p in (1, 2) if d * t * p <= WORLD]
KINDS = [dict(), dict(dp_shard=True), dict(fused=True)]


derived_cases = st.builds(
    lambda a, b, ka, kb, opt, tied, dtype, bias, kv: dict(
        src=a,
        dst=b,
        src_kw=ka | dict(optimizer=opt > 0),
        dst_kw=kb | dict(optimizer=opt > 1),  # a target holds optimizer state only if the source does
        spec=dict(tie_embeddings=tied, dtype=dtype, qkv_bias=bias, num_kv_heads=kv),
    ),
    st.sampled_from(SMALL_CONFIGS),
    st.sampled_from(SMALL_CONFIGS),
    st.sampled_from(KINDS),
    st.sampled_from(KINDS),
    st.integers(0, 2),
    st.booleans(),
    st.sampled_from(["float32", "bfloat16"]),
    st.booleans(),
    st.sampled_from([1, 2, 4]),
)


@st.composite
def grid_cases(draw) -> dict:
    """Two tensors (int64, float16, int8 or bool; bfloat16 or float32), dimensions possibly
    empty, cut into random grids on random replica sets."""
    dx = draw(st.sampled_from(["int64", "float16", "int8", "bool"]))
    dy = draw(st.sampled_from(["bfloat16", "float32"]))
    x = draw(grid_layouts(name="x", world=WORLD, dtype=dx, min_size=0))
    y = draw(grid_layouts(name="opt/y.z", world=WORLD, dtype=dy, min_size=0))
    x2 = draw(grid_layouts(name="x", world=WORLD, dtype=dx, shape=x.shape))
    y2 = draw(grid_layouts(name="opt/y.z", world=WORLD, dtype=dy, shape=y.shape))
    return dict(layouts=((x, y), (x2, y2)))


def draw(strategy, n: int) -> list:
    """``n`` examples of a strategy, drawn by Hypothesis in this (parent) process.

    A ``@given`` test body runs once per example, and each would spawn processes; so
    Hypothesis only collects here (its first example is the simplest one, the rest are
    varied) and one ``run_distributed`` call runs them all.
    """
    out: list = []

    @seed(20261201)  # a fixed seed: the same cases every run, so a failure reproduces
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example):
        out.append(example)

    collect()
    assert len(out) == n, f"Hypothesis drew {len(out)} of {n} cases"
    return out


@pytest.mark.timeout(260)
def test_random_layout_pairs_round_trip_exactly():
    cases = draw(derived_cases, 14) + draw(grid_cases(), 14)
    kinds = {l.dtype for c in cases if "layouts" in c for side in c["layouts"] for l in side}
    assert {"float16", "int8", "bool"} <= kinds and any(
        0 in l.shape for c in cases if "layouts" in c for l in c["layouts"][0]
    ), "the drawn cases must include fp16, int8, bool and an empty tensor"
    root = tempfile.mkdtemp(prefix="nereus-test-", dir="/dev/shm")
    try:
        results = run_distributed(_round_trips, WORLD, cases, root, timeout=220)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    failures = sorted({(k, kind, tuple(bad)) for per_rank in results for k, kind, bad in per_rank})
    assert failures == [], [(cases[k], kind, bad) for k, kind, bad in failures]


OPT = dict(optimizer=True)
LLAMA = dict(qkv_bias=True, hidden_size=64, intermediate_size=128)  # GQA: 2 KV heads, so kv < tp at tp=4


def _t(src: dict, dst: dict, src_kw: dict = OPT, dst_kw: dict = OPT) -> dict:
    return dict(src=src, dst=dst, src_kw=src_kw, dst_kw=dst_kw, spec=LLAMA)


TRAINER_TRANSITIONS = [
    ("tp2->tp4", _t(dict(tp=2), dict(tp=4))),
    ("tp4->tp2", _t(dict(tp=4), dict(tp=2))),
    ("pp2->pp1", _t(dict(pp=2), dict(pp=1))),
    ("dp2xtp2->tp4", _t(dict(dp=2, tp=2), dict(tp=4))),
    ("tp2xpp2->dp4", _t(dict(tp=2, pp=2), dict(dp=4))),
    ("train tp2xdp2 -> rollout tp4 fused", _t(dict(tp=2, dp=2), dict(tp=4), dst_kw=dict(fused=True))),
    ("fsdp dp4 -> tp2xpp2", _t(dict(dp=4), dict(tp=2, pp=2), src_kw=dict(dp_shard=True, optimizer=True))),
]


@pytest.mark.timeout(180)
def test_trainer_transitions_are_exact():
    results = run_distributed(_transitions, WORLD, TRAINER_TRANSITIONS, timeout=150)
    assert [f for per_rank in results for f in per_rank] == []


# Vocabularies no TP degree divides, between tp = 1, 2 and 3 (6 heads and 6 KV heads, so all
# three fit): 21 rows are 11 + 10 at tp=2 and 7 + 7 + 7 at tp=3; 50 rows 25 + 25 and
# 17 + 17 + 16; 4 rows at tp=3 are 2 + 2 + an EMPTY shard (rank 2 holds none of it).
ODD_VOCAB = dict(hidden_size=48, intermediate_size=48, num_heads=6, num_kv_heads=6)


def _v(vocab: int, src: dict, dst: dict, src_kw: dict = OPT, dst_kw: dict = OPT, **spec) -> dict:
    return dict(src=src, dst=dst, src_kw=src_kw, dst_kw=dst_kw, spec=ODD_VOCAB | dict(vocab_size=vocab) | spec)


VOCAB_TRANSITIONS = [
    ("V=21 tp1 -> tp3", _v(21, dict(tp=1), dict(tp=3))),
    ("V=21 tp3 -> tp2", _v(21, dict(tp=3), dict(tp=2))),
    ("V=21 tp2 -> tp1", _v(21, dict(tp=2), dict(tp=1))),
    ("V=21 tp2 -> tp3", _v(21, dict(tp=2), dict(tp=3))),
    ("V=50 tied bf16 tp3 -> fsdp dp2 x tp2", _v(50, dict(tp=3), dict(dp=2, tp=2), dst_kw=dict(dp_shard=True, optimizer=True),
                                              tie_embeddings=True, dtype="bfloat16")),
    ("V=50 fsdp dp2 x tp2 -> tp3 x pp1", _v(50, dict(dp=2, tp=2), dict(tp=3), src_kw=dict(dp_shard=True, optimizer=True))),
    ("V=4 tp2 -> tp3 (an empty shard)", _v(4, dict(tp=2), dict(tp=3))),
    ("V=4 tp3 (an empty shard) -> tp1", _v(4, dict(tp=3), dict(tp=1))),
]


@pytest.mark.timeout(180)
def test_vocab_sharded_tensors_round_trip_between_tp1_tp2_tp3_exactly():
    """Uneven vocabulary shards (torch.chunk: the last shorter, or empty) move between layouts
    like any other box: every element of every target compared with the reference."""
    for _, case in VOCAB_TRANSITIONS:  # the layouts really are uneven, with no padded row
        for side, kw in (("src", "src_kw"), ("dst", "dst_kw")):
            (emu, *_) = derived(case[side], stage="s", spec_kw=case["spec"], **case[kw])
            assert emu.tensor("lm_head.weight" if not case["spec"].get("tie_embeddings") else "model.embed_tokens.weight").shape[0] == case["spec"]["vocab_size"]
    results = run_distributed(_transitions, WORLD, VOCAB_TRANSITIONS, timeout=150)
    assert [f for per_rank in results for f in per_rank] == []


# ----------------------------------------------------------------------------- dtype casts


def _cast_expected(plan, rank: int, out) -> list[str]:
    """Target shards against the SOURCE dtype's reference values cast to the target dtype."""
    from nereus.reshard.layout import DTYPES, buffer_name, shard_view
    from nereus.reshard.reference import reference_box

    bad = []
    for layout in plan.layouts.values():
        src_dtype = plan.src_layouts[layout.name].dtype
        for shard in (s for s in layout.shards if s.rank == rank):
            want = reference_box(layout.name, layout.shape, src_dtype, shard.offsets, shard.lengths).to(DTYPES[layout.dtype])
            got = shard_view(out, layout, shard)
            if buffer_name(layout, shard) not in out or got.dtype != want.dtype or not torch.equal(got, want):
                bad.append(f"{layout.name} at {shard.offsets} on rank {rank}")
    return bad


def _casts(rank: int, world: int, cases: list[tuple[str, dict]], root: str) -> list:
    """float32 training layouts into bfloat16 ones (the weight sync's cast): streamed three
    ways and read from a staged checkpoint, every element equal to the cast source."""
    from nereus.reshard.execute import execute
    from nereus.reshard.staged import save_staged
    from nereus.reshard.stream import execute_stream

    failures = []
    for k, (name, case) in enumerate(cases):
        spec = tiny_spec(**LLAMA)
        sources = derive_emus(spec, ParallelConfig.on(**case["src"]), model="actor", stage="train", **case.get("src_kw", {}))
        bf16 = tiny_spec(**LLAMA, dtype="bfloat16")
        targets = derive_emus(bf16, ParallelConfig.on(**case["dst"]), model="actor", stage="gen", **case.get("dst_kw", {}))
        plan = plan_transfers(sources, targets, cast=True)
        src = reference_state(plan.src_layouts.values(), rank)
        for how, run in (
            ("stream", lambda: execute(plan, graph_for(plan), src, rank=rank, checksums=True)),
            ("one message per transfer", lambda: execute_stream(plan, graph_for(plan), src, rank=rank, coalesce_bytes=0)),
            ("256-byte chunks", lambda: execute_stream(plan, graph_for(plan), src, rank=rank, chunk_bytes=256)),
        ):
            if bad := _cast_expected(plan, rank, run()):
                failures.append((name, how, bad[:4]))
        path = f"{root}/case{k}"
        save_staged(path, plan.src_layouts, src, rank=rank)
        dist.barrier()
        staged = plan_transfers(sources, targets, live=set(), staged=True, cast=True)
        if bad := _cast_expected(staged, rank, execute(staged, graph_for(staged), src, rank=rank, staged_path=path)):
            failures.append((name, "staged", bad[:4]))
    return failures


CASTS = [
    ("dp2xtp2 fp32 -> tp4 fused bf16", dict(src=dict(dp=2, tp=2), dst=dict(tp=4), dst_kw=dict(fused=True))),
    ("fsdp dp4 fp32 -> dp2xtp2 bf16", dict(src=dict(dp=4), src_kw=dict(dp_shard=True), dst=dict(dp=2, tp=2))),
    ("tp2xpp2 fp32 -> dp4 bf16", dict(src=dict(tp=2, pp=2), dst=dict(dp=4))),
]


@pytest.mark.timeout(180)
def test_float32_masters_cast_into_bfloat16_layouts_exactly():
    root = tempfile.mkdtemp(prefix="nereus-test-", dir="/dev/shm")
    try:
        results = run_distributed(_casts, WORLD, CASTS, root, timeout=150)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert [f for per_rank in results for f in per_rank] == []


def test_a_dtype_change_needs_cast_and_only_floats_cast():
    from nereus.reshard.errors import MismatchError
    from nereus.reshard.layout import Shard, TensorLayout

    spec = tiny_spec(**LLAMA)
    src = derive_emus(spec, ParallelConfig.on(tp=2), model="actor", stage="train")
    dst = derive_emus(tiny_spec(**LLAMA, dtype="bfloat16"), ParallelConfig.on(tp=2), model="actor", stage="gen")
    with pytest.raises(MismatchError, match=r"source dtype float32 != target dtype bfloat16 \(plan with cast=True to convert\)"):
        plan_transfers(src, dst)
    plan = plan_transfers(src, dst, cast=True)
    assert all(plan.casts(t) for t in plan.transfers)
    held = sum(b.nbytes for bufs in plan.dst_buffers.values() for b in bufs.values())  # every rank's bf16 buffers
    assert sum(t.nbytes for t in plan.transfers) == held  # a transfer counts the target's bytes
    ints = [emu_of([TensorLayout(name="x", shape=(4,), dtype=d, shards=(Shard(rank=0, offsets=(0,), lengths=(4,)),))], 1)
            for d in ("int64", "float32")]
    with pytest.raises(MismatchError, match="source dtype int64 != target dtype float32"):
        plan_transfers([ints[0]], [ints[1]], cast=True)


# ------------------------------------------------------------------- the memory budget


SENTINEL = 123_457  # bytes of a marker allocation that brackets the measured window


def _window_peak(events: list[tuple[int, int]]) -> tuple[int, int]:
    """(live bytes at the first marker, most live bytes between the markers) from the
    allocator's signed events in time order."""
    live, at_start, top, inside = 0, None, 0, False
    for size in (e for _, e in events):
        live += size
        if size == SENTINEL:  # the first marker opens the window (and is freed at once), the second closes it
            if at_start is None:
                at_start, top, inside = live - size, live - size, True
            else:
                inside = False
        elif inside and size != -SENTINEL:
            top = max(top, live)
    return at_start, top


def _budgeted(rank: int, world: int, cases: list[tuple[str, dict]]) -> list:
    """Each transition under a budget below its unbounded peak, sources handed over, its
    staging arena first grown by an unbounded run: the tensor bytes this rank holds at its
    peak never exceed the budget the graph was given. Measured by the CPU allocator's own
    events (torch.profiler, as ``trainer.memtrace``): the running sum of every allocation
    and free, from before the arena and the sources exist, so the arena kept from the
    first run and the sources allocated for the second count, and their frees too."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import OpTree

    from nereus.reshard.execute import execute
    from nereus.reshard.graph import RESERVE_BYTES
    from nereus.reshard.stream import StagingArena

    out = []
    for name, case in cases:
        sources, targets = build(case)
        plan = plan_transfers(sources, targets)
        free = graph_for(plan, release_sources=True)
        budget = int(case["fraction"] * max(free.peak_bytes.values()))
        graph = graph_for(plan, budget=budget, release_sources=True, reserve=RESERVE_BYTES)  # what reshard() plans with
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            arena = StagingArena()
            src = reference_state(plan.src_layouts.values(), rank)
            res = execute(plan, graph_for(plan), src, rank=rank, staging=arena)  # unbounded: the arena grows
            grown = arena.nbytes
            del res, src
            src = reference_state(plan.src_layouts.values(), rank)
            entry = sum(t.nbytes for t in src.values()) + arena.nbytes  # what the rank holds going in
            opens = torch.empty(SENTINEL, dtype=torch.uint8)  # the window opens
            del opens
            res = execute(plan, graph, src, rank=rank, release_sources=True, staging=arena)
            end = torch.empty(SENTINEL, dtype=torch.uint8)  # the window closes
            del end
            bad = mismatches(res, plan.layouts.values(), rank)
            del res, src
        events = [(e.start_time_ns, e.typed[1].alloc_size) for e in OpTree(prof.profiler.kineto_results).sorted_nodes
                  if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu"]
        base, top = _window_peak(events)
        measured = top - base + entry  # what the window added to what the rank held at its start
        out.append((name, rank, measured, budget, graph.num_rounds, free.num_rounds, grown, bad))
    return out


BUDGETED = [
    ("tp2 -> tp1, 0.85 of the unbounded peak", dict(src=dict(tp=2), dst=dict(tp=1), spec=LLAMA, fraction=0.85)),
    ("tp2 -> dp2 with AdamW state, 0.9", dict(src=dict(tp=2), dst=dict(dp=2), spec=LLAMA, fraction=0.9,
                                           src_kw=OPT, dst_kw=OPT)),
]


@pytest.mark.timeout(180)
def test_a_rank_never_holds_more_than_the_graphs_budget():
    results = run_distributed(_budgeted, 2, BUDGETED, timeout=150)
    for name, rank, measured, budget, rounds, free_rounds, grown, bad in (r for per in results for r in per):
        assert bad == [], (name, rank, bad)
        assert grown > 0, (name, "the unbounded run staged nothing: the kept arena was not exercised")
        assert measured <= budget, (name, rank, measured, budget)
        assert rounds > free_rounds, (name, "the budget did not bind: the test would not see an overrun")
