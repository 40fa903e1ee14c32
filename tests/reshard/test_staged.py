"""The staged checkpoint: box files keyed by name and offsets, loads through DCP reading
only what they need, clear errors, and a transition that survives a source rank leaving."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import uuid

import fsspec
import numpy as np
import pytest
import torch
import torch.distributed as dist

from nereus.reshard.errors import CoverageError, TransferError
from nereus.reshard.layout import DTYPES, Shard, TensorLayout
from nereus.reshard.plan import STAGED, merge_layouts, plan_transfers
from nereus.reshard.reference import mismatches, reference_box, reference_state
from nereus.reshard.staged import box_file, save_staged
from nereus.reshard.staged_load import StagedLoadPlanner, StagedReader, check_staged, load_staged
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
    # one 4 MiB block covers the 64 KiB box: it is read once, verified on those bytes, in ONE
    # request — a verified read's pieces are a checksum block (STAGED_PIECE_BYTES, what the
    # graph charges a staged read), not the 4 KiB the load delivers (16 requests)
    assert reads == [(0, 64 * 256 * 4)]


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
        mine = [t for t in plan.transfers if t.dst_rank == 0]
        reader = check_staged(shm, mine, checksums=True)  # presence, sizes, checksum lists: reads no data
        assert reader.bytes_read == 0 and reader.verify
        with pytest.raises(TransferError, match=r"down_proj.*corrupted"):  # the load it hands on does
            load_staged(shm, plan, 0, {}, transfers=mine, verified=True, reader=reader)
        # the old pattern — check_staged(checksums=True), then load_staged(verified=True) with
        # no reader — would load the damage unverified: it is refused instead
        with pytest.raises(ValueError, match=r"verified=True.*needs reader="):
            load_staged(shm, plan, 0, {}, transfers=mine, verified=True)
        with pytest.raises(ValueError, match="does not verify"):
            load_staged(shm, plan, 0, {}, transfers=mine, checksums=True, reader=StagedReader(shm, verify=False))
    with open(victim, "wb") as f:
        f.write(data[:-4])
    with pytest.raises(CoverageError, match=rf"{victim}.*truncated"):
        load_staged(shm, plan, 0, {})
    os.remove(victim)
    with pytest.raises(CoverageError, match=rf"{victim}.*missing"):
        load_staged(shm, plan, 0, {})
    with open(victim, "wb") as f:
        f.write(data)
    sidecar = open(victim + ".crc32c", "rb").read()
    os.remove(victim + ".crc32c")
    with pytest.raises(CoverageError, match=r"no \.crc32c sidecar"):
        load_staged(shm, plan, 0, {}, checksums=True)
    with open(victim + ".crc32c", "wb") as f:  # one checksum too many: found before any byte is read
        f.write(sidecar.replace(b'"crc32c": [', b'"crc32c": ["00000000", ', 1))
    with pytest.raises(TransferError, match=r"down_proj.*has 2 checksums of 4194304-byte blocks for 4096 bytes"):
        check_staged(shm, [t for t in plan.transfers if t.dst_rank == 0], checksums=True)
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


def test_a_load_in_the_staged_layout_reads_each_box_into_its_target_and_checks_it_there(shm, monkeypatch):
    """Restoring in the layout that was staged, every box is one target's whole region: it is
    read straight into the target, never mapped, and every block is still checked on the
    bytes read (the same damage as above is refused, naming the tensor)."""
    plan = _plan(dict(tp=2), dict(tp=2))
    _stage_all(shm, plan, range(2))
    monkeypatch.setattr(StagedReader, "_map", lambda self, box: pytest.fail(f"{box.path} was mapped"))
    assert _load_all(shm, plan, range(2), checksums=True) == []
    victim = f"{shm}/{box_file('model.layers.1.mlp.down_proj.weight', (0, 32), 0)}"
    data = open(victim, "rb").read()
    damaged = bytearray(data)
    damaged[len(data) - 1] ^= 0x80  # the sign bit of the last float32
    with open(victim, "wb") as f:
        f.write(bytes(damaged))
    with pytest.raises(TransferError, match=r"down_proj.*crc32c .* corrupted"):
        _load_all(shm, plan, range(2), checksums=True)
    assert _load_all(shm, plan, range(2)) != []  # unverified, the damage lands: the check above is what caught it


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


# ------------------------------------------ object stores: each staged byte read once


def _stage_everything(path: str, plan, version: int = 0) -> None:
    """Every source box into ``path`` from this process (memory:// is per process: each rank
    stages its own copy of the shared store), with CRC32C sidecars."""
    for r in sorted(plan.src_buffers):
        save_staged(path, plan.src_layouts, reference_state(plan.src_layouts.values(), r), rank=r, checksums=True,
                    version=version)


def _spy_reads(reads: list) -> None:
    """Record every ``.bin`` byte range the memory filesystem hands out: (path, start, end)."""
    fs = fsspec.filesystem("memory")
    original = type(fs).cat_file

    def spy(self, path, start=None, end=None, **kw):
        data = original(self, path, start=start, end=end, **kw)
        if path.endswith(".bin"):
            reads.append((path, start or 0, (start or 0) + len(data)))
        return data

    type(fs).cat_file = spy


def _box_bytes(plan, transfers) -> int:
    """Bytes of the distinct source boxes the transfers read (each under one 4 MiB block here)."""
    boxes = {(t.tensor, tuple(t.item.storage_index.offset)) for t in transfers}
    out = 0
    for name, offsets in boxes:
        layout = plan.src_layouts[name]
        lengths = next(n for o, n in layout.unique_boxes() if tuple(o) == offsets)
        out += math.prod(lengths) * torch.empty(0, dtype=DTYPES[layout.dtype]).element_size()
    return out


def _overlaps(reads) -> list:
    """Byte ranges of one file read more than once."""
    seen: dict[str, list[tuple[int, int]]] = {}
    bad = []
    for path, a, z in reads:
        for b, y in seen.get(path, []):
            if a < y and b < z:
                bad.append((path, (a, z), (b, y)))
        seen.setdefault(path, []).append((a, z))
    return bad


def _read_once(rank: int, world: int) -> dict:
    """With checksums, on memory:// (an object store's path: ranged reads, no map): the
    transition's pre-check reads no data and the load reads each needed byte once,
    verified on those bytes — in execute() (every region staged) and in reshard_staged()."""
    from nereus.reshard.execute import execute, reshard_staged

    reads: list = []
    _spy_reads(reads)
    out = {}
    sources, targets = derived(dict(tp=2), stage="s", optimizer=True), derived(dict(dp=2), stage="t", optimizer=True)
    plan = plan_transfers(sources, targets, live=set(), staged=True)
    path = f"memory://once-execute-{rank}"
    _stage_everything(path, plan)
    reads.clear()
    res = execute(plan, graph_for(plan), {}, rank=rank, staged_path=path, checksums=True)
    mine = [t for t in plan.transfers if t.dst_rank == rank]
    out["execute"] = (mismatches(res, plan.layouts.values(), rank), sum(e - a for _, a, e in reads),
                      _box_bytes(plan, mine), _overlaps(reads))
    live = plan_transfers(sources, targets)
    path = f"memory://once-staged-{rank}"
    _stage_everything(path, live)  # what the other rank stages, as a shared store would hold it
    reads.clear()
    src = reference_state(live.src_layouts.values(), rank)
    res = reshard_staged(live, src, rank=rank, path=path, checksums=True)
    loads = [t for t in live.transfers if t.dst_rank == rank and t.src_rank != rank]
    out["reshard_staged"] = (mismatches(res, live.layouts.values(), rank), sum(e - a for _, a, e in reads),
                             _box_bytes(live, loads), _overlaps(reads))
    return out


@pytest.mark.timeout(120)
def test_staged_data_on_an_object_store_is_read_once():
    """It used to be read twice: the pre-check fetched every block to verify it, then the
    load fetched the regions again, unverified."""
    for rank, out in enumerate(run_distributed(_read_once, 2, timeout=100)):
        for path in ("execute", "reshard_staged"):
            bad, read, needed, overlaps = out[path]
            assert bad == [], (rank, path, bad)
            assert needed > 0 and read == needed, (rank, path, read, needed)  # every box it needs, whole, once
            assert overlaps == [], (rank, path, overlaps[:3])


# ----------------------------------------- staged reads within the graph's memory budget

PEAK_SPEC = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_layers=2)  # 1 MiB embedding


def _fetch_into_torch() -> None:
    """Hand every ``.bin`` range the memory filesystem reads out in a torch buffer (as a
    memoryview), so the CPU allocator's events see each fetched byte for as long as the
    reader holds it: a stand-in, byte for byte, for the ``bytes`` an object store returns."""
    import numpy as np

    fs = fsspec.filesystem("memory")
    original = type(fs).cat_file

    def into_torch(self, path, start=None, end=None, **kw):
        data = original(self, path, start=start, end=end, **kw)
        if not path.endswith(".bin"):
            return data
        held = torch.empty(len(data), dtype=torch.uint8)
        held.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        return memoryview(held.numpy())

    type(fs).cat_file = into_torch


def _staged_peak(rank: int, world: int) -> list:
    """Rank 1 of a tp=2 layout is gone (its boxes are staged on memory://, CRC32C on); rank 0
    (its sources handed over) and a fresh rank 1 end with the whole state (dp=2): rank 0
    streams its half, both read rank 1's half from the staged checkpoint in the graph's
    rounds. Under a budget below the unbounded peak, the tensor bytes a rank holds at its
    peak — the fetched ranges included — never exceed it (measured as test_stream's peak
    test measures)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import OpTree

    from nereus.reshard.execute import execute
    from nereus.reshard.graph import RESERVE_BYTES

    from .test_stream import SENTINEL, _window_peak

    _fetch_into_torch()
    sources = derived(dict(tp=2), stage="s", spec_kw=PEAK_SPEC)
    targets = derived(dict(dp=2), stage="t", spec_kw=PEAK_SPEC)
    plan = plan_transfers(sources, targets, live={0}, staged=True)
    path = f"memory://peak-{rank}"
    _stage_everything(path, plan)
    out = []
    for fraction in (0.9, 0.95):
        free = graph_for(plan, release_sources=True)
        budget = int(fraction * max(free.peak_bytes.values()))
        graph = graph_for(plan, budget=budget, release_sources=True, reserve=RESERVE_BYTES)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            src = reference_state(plan.src_layouts.values(), rank) if rank == 0 else {}
            entry = sum(t.nbytes for t in src.values())
            opens = torch.empty(SENTINEL, dtype=torch.uint8)
            del opens
            res = execute(plan, graph, src, rank=rank, staged_path=path, checksums=True, release_sources=True)
            closes = torch.empty(SENTINEL, dtype=torch.uint8)
            del closes
            bad = mismatches(res, plan.layouts.values(), rank)
            staged_bytes = res.stats.bytes_staged
            del res, src
        events = [(e.start_time_ns, e.typed[1].alloc_size) for e in OpTree(prof.profiler.kineto_results).sorted_nodes
                  if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu"]
        base, top = _window_peak(events)
        out.append((fraction, rank, top - base + entry, budget, graph.num_rounds, free.num_rounds, staged_bytes, bad))
    return out


@pytest.mark.timeout(150)
def test_staged_reads_keep_a_rank_within_the_graphs_budget():
    """Staged reads used to hold each box's fetched blocks and an assembled copy of every
    region, none of it counted by the graph (a contiguous target counted nothing)."""
    results = run_distributed(_staged_peak, 2, timeout=130)
    for fraction, rank, measured, budget, rounds, free_rounds, staged_bytes, bad in (r for per in results for r in per):
        assert bad == [], (fraction, rank, bad)
        assert staged_bytes > 0, (fraction, rank, "nothing was read from the staged checkpoint")
        assert measured <= budget, (fraction, rank, measured, budget, measured - budget)
    assert any(r[4] > r[5] for per in results for r in per), "the budget never bound: an overrun would not show"


# ------------------------------------------------------ pieces: any cut, every element


def test_rowmajor_boxes_tile_a_range_in_order():
    import numpy as np

    from nereus.reshard.checksum import rowmajor_boxes

    rng = np.random.default_rng(0)
    for shape in [(), (7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)]:
        n = math.prod(shape)
        grid = np.arange(n).reshape(shape)
        for _ in range(40):
            start, stop = sorted(rng.integers(0, n + 1, size=2).tolist()) if shape else (0, 1)
            boxes = rowmajor_boxes(shape, start, stop)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            got = [int(v) for o, l in boxes for v in grid[tuple(slice(a, a + b) for a, b in zip(o, l))].reshape(-1)]
            assert got == list(range(start, stop)), (shape, start, stop, boxes)


def _item(offsets, lengths):
    """A ReadItem of tensor "x" from its one box at the origin, into a target of its own."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    index = MetadataIndex("x", (0,) * len(offsets))
    return ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=torch.Size(offsets), storage_index=index,
                    storage_offsets=torch.Size(offsets), lengths=torch.Size(lengths))


@pytest.mark.parametrize("verify", [False, True])
def test_pieces_of_any_size_fill_every_region_exactly(verify):
    """A box on an object store read in pieces cut anywhere (through runs, mid-row, across
    40-byte checksum blocks) lands every element of every region where it belongs, into
    strided targets, each block verified on the bytes fetched."""
    import numpy as np

    from nereus.reshard.checksum import block_checksums
    from nereus.reshard.staged import StagedBox

    rng = np.random.default_rng(1)
    shape, root = (5, 6, 7), f"memory://pieces-{uuid.uuid4().hex}"
    whole = torch.arange(math.prod(shape), dtype=torch.float16).view(shape)  # 210 values: exact in fp16
    raw = whole.numpy().tobytes()
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{root}/x.bin", raw)
    box = StagedBox(tensor="x", offsets=(0, 0, 0), lengths=shape, dtype="float16", path=f"{root.removeprefix('memory://')}/x.bin",
                    checksums=block_checksums(raw, 40), block=40)
    reader = StagedReader(root, record={"schema": 2, "version": None, "tensors": {}}, verify=verify)
    for _ in range(30):
        items, targets, want = [], [], []
        for _ in range(int(rng.integers(1, 4))):
            o = [int(rng.integers(0, n)) for n in shape]
            n = [int(rng.integers(1, s - a + 1)) for a, s in zip(o, shape)]
            items.append(_item(o, n))
            targets.append(torch.full((n[0] + 1, n[1], n[2] + 2), -1, dtype=torch.float16)[: n[0], :, 1 : n[2] + 1])
            want.append(whole[o[0] : o[0] + n[0], o[1] : o[1] + n[1], o[2] : o[2] + n[2]])
        limit = int(rng.integers(1, 200))  # odd ones too: pieces are whole elements
        reader._read_pieces(box, items, targets, limit)
        for t, w in zip(targets, want):
            assert torch.equal(t, w), (limit, [(list(i.storage_offsets), list(i.lengths)) for i in items])
    if verify:
        damaged = bytearray(raw)
        damaged[123] ^= 0x04
        fs.pipe_file(f"{root}/x.bin", bytes(damaged))
        with pytest.raises(TransferError, match=r"crc32c \w+ in bytes \[120, 160\), staged as \w+: corrupted"):
            reader._read_pieces(box, [_item((0, 0, 0), shape)], [torch.empty(shape, dtype=torch.float16)], 16)


def test_object_store_reads_refuse_damage_foreign_blocks_and_short_reads(monkeypatch):
    """Through the public load on memory:// (the piece path): a flipped bit fails its block's
    CRC32C naming the file; a sidecar whose block size is not a multiple of the element size
    (which used to corrupt the copies) is refused naming the box; a range that comes back
    short (the object shrank after the check) is refused naming the file, not a setStorage error."""
    import json

    from nereus.reshard.checksum import block_checksums

    path = f"memory://damage-{uuid.uuid4().hex}"
    plan = _plan(dict(tp=2), dict(tp=1))
    _stage_all(path, plan, range(2))
    fs = fsspec.filesystem("memory")
    victim = next(p for p in fs.find(path) if p.endswith(".bin") and "down_proj" in p)
    data = fs.cat_file(victim)
    assert _load_all(path, plan, [0], checksums=True) == []
    damaged = bytearray(data)
    damaged[5] ^= 0x01
    fs.pipe_file(victim, bytes(damaged))
    with pytest.raises(TransferError, match=r"down_proj.*crc32c .* corrupted"):
        load_staged(path, plan, 0, {}, checksums=True)
    fs.pipe_file(victim, data)
    sidecar = fs.cat_file(victim + ".crc32c")
    sums = block_checksums(np.frombuffer(data, np.uint8), 6)
    fs.pipe_file(victim + ".crc32c", json.dumps({"block": 6, "crc32c": list(sums)}).encode())
    with pytest.raises(TransferError, match=r"down_proj.*6-byte checksum blocks, not a multiple of its 4-byte"):
        load_staged(path, plan, 0, {}, checksums=True)
    fs.pipe_file(victim + ".crc32c", sidecar)
    original = type(fs).cat_file

    def shrunk(self, p, start=None, end=None, **kw):
        out = original(self, p, start=start, end=end, **kw)
        return out[:-4] if p.endswith(".bin") and "down_proj" in p else out

    monkeypatch.setattr(type(fs), "cat_file", shrunk)
    for checksums in (False, True):
        with pytest.raises(TransferError, match=r"down_proj.*returned \d+ bytes for bytes .*shrank"):
            load_staged(path, plan, 0, {}, checksums=checksums)
