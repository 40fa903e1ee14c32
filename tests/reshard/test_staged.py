"""The staged checkpoint: box files keyed by name and offsets, loads through DCP reading
only what they need, clear errors, and a transition that survives a source rank leaving."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import fsspec
import pytest
import torch
import torch.distributed as dist

from nereus.reshard.errors import CoverageError, TransferError
from nereus.reshard.layout import Shard, TensorLayout
from nereus.reshard.plan import STAGED, merge_layouts, plan_transfers
from nereus.reshard.reference import mismatches, reference_box, reference_state
from nereus.reshard.staged import StagedLoadPlanner, StagedReader, box_file, check_staged, load_staged, save_staged
from tests.distributed_harness import run_distributed

from .strategies import emu_of
from .test_stream import derived, exact, graph_for


def _plan(src_cfg, dst_cfg, **kw):
    return plan_transfers(derived(src_cfg, stage="s", optimizer=True), derived(dst_cfg, stage="t", **kw), live=set(), staged=True)


def _stage_all(path, plan, ranks, *, checksums=True, live=None, version=0):
    for r in ranks:
        save_staged(path, plan.src_layouts, reference_state(plan.src_layouts.values(), r), rank=r, live=live,
                    checksums=checksums, version=version)


def _load_all(path, plan, ranks, **kw) -> list[str]:
    bad = []
    for r in ranks:
        out: dict = {}
        load_staged(path, plan, r, out, **kw)
        bad += mismatches(out, plan.layouts.values(), r)
    return bad


@pytest.fixture
def shm():
    path = tempfile.mkdtemp(prefix="nereus-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("kind", ["local", "file", "memory"])
def test_staged_round_trip_on_any_fsspec_path(kind, shm, tmp_path):
    path = {"local": shm, "file": f"file://{tmp_path}/staged", "memory": f"memory://staged-{uuid.uuid4().hex}"}[kind]
    plan = _plan(dict(tp=2, dp=2), dict(tp=4), fused=True)
    assert all(t.src_rank == STAGED for t in plan.transfers)
    _stage_all(path, plan, range(4))
    assert _load_all(path, plan, range(4), checksums=True) == []


def test_box_files_are_keyed_by_name_and_offsets_never_by_rank(shm, tmp_path):
    plan = _plan(dict(tp=2, dp=2), dict(tp=1), optimizer=True)
    _stage_all(shm, plan, range(4))  # lowest holders write: ranks 0 and 1
    other = str(tmp_path / "other")
    _stage_all(other, plan, [2, 3], live={2, 3})  # the other replica writes the same boxes
    files = sorted(os.listdir(shm))
    assert files == sorted(os.listdir(other))
    for name in files:
        with open(f"{shm}/{name}", "rb") as a, open(f"{other}/{name}", "rb") as b:
            assert a.read() == b.read(), name
    assert box_file("optim/exp_avg/model.norm.weight", (0,), 0) in files
    assert box_file("model.embed_tokens.weight", (32, 0), 0) + ".crc32c" in files  # vocab rows 32.. of 64
    assert box_file("optim/step/model.norm.weight", (), 0) == "optim%2Fstep%2Fmodel.norm.weight@scalar@v0.bin"
    assert not any("rank" in f or f.endswith(".tmp") or ".tmp-" in f for f in files)


def test_versions_never_mix_old_and_fresh_boxes(shm):
    """Rank 1 stages version 0 and leaves; rank 0 stages version 1: rank 1's boxes are
    still named, at version 0, and a version-1 read of them is refused, naming the box."""
    full = _plan(dict(tp=2), dict(tp=1), optimizer=True)
    _stage_all(shm, full, [1], live={1})  # rank 1 stages its shards (with optimizer state), then leaves
    _stage_all(shm, full, [0], live={0})  # same version: rank 0's boxes join them
    assert _load_all(shm, full, [0], checksums=True) == []  # one version, whole
    for r in (0,):  # later, version 1: only rank 0 is alive to stage
        save_staged(shm, full.src_layouts, reference_state(full.src_layouts.values(), r, seed=1), rank=r, live={0},
                    checksums=True, version=1)
    files = os.listdir(shm)
    assert {f.rsplit("@v", 1)[1] for f in files if f.endswith(".bin")} == {"0.bin", "1.bin"}
    stale = [t for t in full.transfers if any(t.item.storage_index.offset)]  # rank 1's half: still version 0
    fresh = [t for t in full.transfers if not any(t.item.storage_index.offset)]
    with pytest.raises(CoverageError, match=r"missing at version 1: it was staged at version\(s\) \[0\] only"):
        load_staged(shm, full, 0, {}, transfers=stale)
    out: dict = {}
    load_staged(shm, full, 0, out, transfers=fresh, checksums=True)
    for t in fresh:
        layout = full.layouts[t.tensor]
        assert torch.equal(t.dst_view(out), reference_box(t.tensor, layout.shape, layout.dtype, t.item.dest_index.offset, t.lengths, 1))
    load_staged(shm, full, 0, {}, transfers=stale, version=0)  # asked for explicitly, the old version reads
    assert not any(f.endswith("@v0.bin") and f.startswith("model.embed_tokens.weight@0_0") for f in os.listdir(shm))
    other = _plan(dict(tp=4), dict(tp=1))  # the same tensors cut differently: the old boxes are dropped
    _stage_all(shm, other, range(4), version=2)
    assert _load_all(shm, other, [0], checksums=True) == []


def test_loads_go_through_dcp_and_read_only_the_needed_bytes(monkeypatch):
    """A column slice of a staged box on an object store: ranged reads of its own runs
    (no covering span); with checksums, the checksum blocks it touches, each read once."""
    whole = TensorLayout(name="w", shape=(64, 256), dtype="float32", shards=(Shard(rank=0, offsets=(0, 0), lengths=(64, 256)),))
    middle = [Shard(rank=r, offsets=(16, 64 * r), lengths=(16, 64)) for r in range(4)]  # rows 16..32, column blocks
    rest = [Shard(rank=0, offsets=(0, 0), lengths=(16, 256)), Shard(rank=1, offsets=(32, 0), lengths=(32, 256))]
    target = _one_box_per_rank(TensorLayout(name="w", shape=(64, 256), dtype="float32", shards=tuple(middle + rest)))
    path = f"memory://ranged-{uuid.uuid4().hex}"
    plan = plan_transfers([emu_of([whole], 4)], [emu_of([target], 4, stage="t")], live=set(), staged=True)
    _stage_all(path, plan, [0])
    fs = fsspec.filesystem("memory")
    reads: list[tuple[int, int]] = []
    original = type(fs).cat_file

    def spy(self, p, start=None, end=None, **kw):
        if p.endswith(".bin"):
            reads.append((start, end))
        return original(self, p, start=start, end=end, **kw)

    monkeypatch.setattr(type(fs), "cat_file", spy)
    seen: list = []
    monkeypatch.setattr(StagedReader, "read_data", _recording(StagedReader.read_data, seen))
    assert _load_all(path, plan, [3]) == []
    (items,) = seen
    assert sorted(map(repr, items)) == sorted(repr(t.item) for t in plan.transfers if t.dst_rank == 3)
    # rank 3 holds rows 16..32, columns 192..256: 16 runs of 64 floats, 768 bytes apart
    assert reads == [((row * 256 + 192) * 4, (row * 256 + 256) * 4) for row in range(16, 32)]
    assert sum(b - a for a, b in reads) == 16 * 64 * 4
    reads.clear()
    assert _load_all(path, plan, [3], checksums=True) == []
    assert reads == [(0, 64 * 256 * 4)]  # one 4 MiB block covers the 64 KiB box: read once, verified on those bytes


def _one_box_per_rank(layout: TensorLayout) -> TensorLayout:
    """Give a rank holding several boxes one buffer per box (named after the box)."""
    counts: dict[int, int] = {}
    for s in layout.shards:
        counts[s.rank] = counts.get(s.rank, 0) + 1
    shards = tuple(
        Shard(rank=s.rank, offsets=s.offsets, lengths=s.lengths, buffer=f"w{list(s.offsets)}" if counts[s.rank] > 1 else "")
        for s in layout.shards
    )
    return TensorLayout(name=layout.name, shape=layout.shape, dtype=layout.dtype, shards=shards)


def _recording(read_data, seen):
    def wrapper(self, plan, planner):
        assert isinstance(planner, StagedLoadPlanner)
        seen.append(list(plan.items))
        return read_data(self, plan, planner)

    return wrapper


def test_staged_errors_name_the_tensor_and_file(shm):
    plan = _plan(dict(tp=2), dict(tp=1))
    with pytest.raises(CoverageError, match="no metadata.json"):
        load_staged(shm, plan, 0, {})
    _stage_all(shm, plan, range(2))
    victim = f"{shm}/{box_file('model.layers.1.mlp.down_proj.weight', (0, 32), 0)}"
    data = open(victim, "rb").read()
    # damage a weighted sum cannot see: the sign bits of two float32 words of one block
    two_signs = bytearray(data)
    two_signs[3] ^= 0x80
    two_signs[7] ^= 0x80
    swapped = bytearray(data)
    swapped[0:4], swapped[4:8] = data[4:8], data[0:4]
    for damaged in (bytes(two_signs), bytes(swapped), bytes(len(data))):
        assert damaged != data
        with open(victim, "wb") as f:
            f.write(damaged)
        with pytest.raises(TransferError, match=r"down_proj.*crc32c .* corrupted"):
            load_staged(shm, plan, 0, {}, checksums=True)
        with pytest.raises(TransferError, match=r"down_proj.*corrupted"):
            check_staged(shm, [t for t in plan.transfers if t.dst_rank == 0], checksums=True)
    with open(victim, "wb") as f:
        f.write(data[:-4])
    with pytest.raises(CoverageError, match=rf"{victim}.*truncated"):
        load_staged(shm, plan, 0, {})
    os.remove(victim)
    with pytest.raises(CoverageError, match=rf"{victim}.*missing"):
        load_staged(shm, plan, 0, {})
    with open(victim, "wb") as f:
        f.write(data)
    os.remove(victim + ".crc32c")
    with pytest.raises(CoverageError, match=r"no \.crc32c sidecar"):
        load_staged(shm, plan, 0, {}, checksums=True)
    meta = f"{shm}/metadata.json"
    raw = open(meta, "rb").read()
    with open(meta, "wb") as f:  # valid JSON, one digit changed: caught by its own checksum
        f.write(raw.replace(b'"shape": [64, 32]', b'"shape": [64, 33]', 1))
    with pytest.raises(CoverageError, match=r"metadata.json.*fails its own crc32c"):
        load_staged(shm, plan, 0, {})
    with open(meta, "wb") as f:
        f.write(raw[: len(raw) // 2])
    with pytest.raises(CoverageError, match=r"metadata.json.*not valid JSON.*truncated"):
        load_staged(shm, plan, 0, {})


# ------------------------------------------------------------- a source rank leaves


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _gone_rank(rank: int, world: int, root: str) -> dict:
    """Rank 3 stages its shards and exits; the transitions complete without it."""
    import os
    import time

    from nereus.reshard.execute import execute

    from .fake_nccl import fake_nccl

    sources = derived(dict(tp=4), stage="s", optimizer=True)
    layouts = merge_layouts(sources, "source")
    src = reference_state(layouts.values(), rank)
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank in (2, 3):  # before they drop their state: their boxes, whoever else holds them
        save_staged(root, layouts, src, rank=rank, live={rank}, checksums=True)
    live = [0, 1, 2]
    group = dist.new_group(live)  # collective over the world: rank 3 takes part, after staging
    if rank == 3:
        return {"pid": os.getpid()}  # the harness then destroys its group and the process exits
    deadline = time.monotonic() + 30
    while not _exited(pids[3]) and time.monotonic() < deadline:
        time.sleep(0.05)
    out: dict = {"rank 3 exited": _exited(pids[3])}
    # A: rank 3 is gone for good; the new layout (tp=2 on ranks 0, 1) excludes it.
    plan = plan_transfers(sources, derived(dict(tp=2), stage="t", optimizer=True), live=set(live), staged=True)
    res = execute(plan, graph_for(plan), src, rank=rank, group=group, staged_path=root, checksums=True)
    out["A"] = exact(plan, rank, res, src), res.stats.bytes_staged
    # B: rank 2 dropped its state and is a fresh target holding no buffer at all (dp=3 on
    # ranks 0..2), streamed from 0 and 1 and read from the staged checkpoint; under gloo and
    # under NCCL's semantics (a fresh rank must post what its peers post).
    plan = plan_transfers(sources, derived(dict(dp=3), stage="t", optimizer=True), live={0, 1}, staged=True)
    fresh = rank == 2
    for name, transport in (("B gloo", None), ("B nccl", fake_nccl())):
        res = execute(plan, graph_for(plan), {} if fresh else src, rank=rank, group=group, staged_path=root,
                      checksums=True, transport=transport)
        bad = mismatches(res, plan.layouts.values(), rank) if fresh else exact(plan, rank, res, src)
        samples = res.stats.samples
        out[name] = (bad, res.stats.bytes_staged, res.stats.bytes_received, len(samples),
                     sum(x.nbytes for x in samples), {x.coalesced for x in samples}, len({(x.round, x.src) for x in samples}))
    return out


@pytest.mark.timeout(120)
def test_transition_completes_when_a_source_rank_is_gone(shm):
    results = run_distributed(_gone_rank, 4, shm, timeout=100)
    assert results[3] == {"pid": results[3]["pid"]}
    for rank, out in enumerate(results[:3]):
        assert out["rank 3 exited"], rank
        assert out["A"][0] == [], (rank, out["A"])
        for name in ("B gloo", "B nccl"):
            assert out[name][0] == [], (rank, name, out[name])
    assert results[1]["A"][1] > 0  # tp=2 rank 1 needs TP4 shard 3: only in the staged checkpoint
    for name in ("B gloo", "B nccl"):  # the fresh rank 2 mixes staged and streamed bytes
        assert results[2][name][1] > 0 and results[2][name][2] > 0, name
    for rank in (0, 1, 2):
        gloo, nccl = results[rank]["B gloo"], results[rank]["B nccl"]
        assert gloo[4] == gloo[2] and nccl[4] == nccl[2], rank  # samples account for every byte received
        if nccl[3]:  # one coalesced sample per (round, peer): a batch is one work, its time shared
            assert nccl[5] == {True} and nccl[3] == nccl[6] and gloo[5] == {False}, (rank, gloo, nccl)
    assert results[2]["B nccl"][3] <= results[2]["B gloo"][3]


# ------------------------------------------- reshard()'s staged fallback and versions


def _fallback_versions(rank: int, world: int, root: str) -> dict:
    """One live rank (rank 1 of the old tp=2 layout is gone, its boxes staged at version
    3); reshard() under a budget no stream schedule meets, so the staged fallback runs."""
    from nereus.reshard.execute import reshard

    tp2, tp1 = derived(dict(tp=2), stage="s"), derived(dict(tp=1), stage="t")
    full = plan_transfers(tp2, tp1)
    plan = plan_transfers(tp2, tp1, live={0}, staged=True)
    out = {}
    for name, seed, version in (("no version", 2, None), ("a newer state", 2, 4), ("the same state", 1, 3)):
        path = f"{root}/{name.replace(' ', '-')}"
        for r in (0, 1):  # the old state (seed 1) at version 3, staged by both ranks of the old layout
            save_staged(path, full.src_layouts, reference_state(full.src_layouts.values(), r, seed=1), rank=r, version=3)
        src = reference_state(plan.src_layouts.values(), 0, seed=seed)  # what rank 0 holds now
        budget = sum(t.nbytes for t in src.values())  # the sources fit, sources + the whole target do not
        try:
            res = reshard(plan, src, rank=0, budget=budget, staged_path=path, staged_version=version)
            out[name] = ("ok", mismatches(res, plan.layouts.values(), 0, seed=seed), res.stats.rounds)
        except Exception as e:  # noqa: BLE001 - the parent asserts on class and message
            out[name] = (type(e).__name__, str(e))
    # the fallback's targets go where the group's transport puts tensors (NCCL: the GPU),
    # not to the CPU: a transport on the meta device stands for a device here
    from nereus.reshard.execute import reshard_staged
    from nereus.reshard.transport import Transport

    elsewhere = Transport(device=torch.device("meta"), coalesced=False, enforces_timeout=True, name="gloo")
    src = reference_state(full.src_layouts.values(), 0, seed=1)
    res = reshard_staged(plan, src, rank=0, path=f"{root}/the-same-state", version=3, transport=elsewhere)
    out["devices"] = sorted({str(t.device) for t in res.values()})
    return out


@pytest.mark.timeout(120)
def test_the_staged_fallback_never_mixes_a_gone_ranks_old_boxes_with_fresh_ones(shm):
    """It used to stage at version 0 whatever the state, so rank 1's old boxes were read
    beside rank 0's new ones: a target half of one state, half of another, no error."""
    (out,) = run_distributed(_fallback_versions, 1, shm, timeout=100)
    cls, msg = out["no version"]
    assert cls == "CoverageError" and "no live holder" in msg and "staged_version" in msg, out["no version"]
    cls, msg = out["a newer state"]
    assert cls == "CoverageError" and "missing at version 4" in msg and "version(s) [3]" in msg, out["a newer state"]
    assert out["the same state"] == ("ok", [], 0), out["the same state"]  # rounds == 0: the staged path ran
    assert out["devices"] == ["meta"], out["devices"]
