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

from nereus.reshard.errors import CoverageError, LayoutError, TransferError
from nereus.reshard.layout import Shard, TensorLayout
from nereus.reshard.plan import STAGED, merge_layouts, plan_transfers
from nereus.reshard.reference import mismatches, reference_box, reference_state
from nereus.reshard.staged import StagedLoadPlanner, StagedReader, box_file, load_staged, save_staged
from tests.distributed_harness import run_distributed

from .strategies import emu_of
from .test_stream import derived, exact, graph_for


def _plan(src_cfg, dst_cfg, **kw):
    return plan_transfers(derived(src_cfg, stage="s", optimizer=True), derived(dst_cfg, stage="t", **kw), live=set(), staged=True)


def _stage_all(path, plan, ranks, *, checksums=True, live=None):
    for r in ranks:
        save_staged(path, plan.src_layouts, reference_state(plan.src_layouts.values(), r), rank=r, live=live, checksums=checksums)


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
    assert box_file("optim/exp_avg/model.norm.weight", (0,)) in files
    assert box_file("model.embed_tokens.weight", (32, 0)) in files  # vocab rows 32.. of 64
    assert box_file("optim/step/model.norm.weight", ()) == "optim%2Fstep%2Fmodel.norm.weight@scalar.bin"
    assert not any("rank" in f or f.endswith(".tmp") or ".tmp-" in f for f in files)


def test_later_saves_keep_earlier_tensors_and_refuse_other_boxes(shm):
    full = _plan(dict(tp=2), dict(tp=1), optimizer=True)
    _stage_all(shm, full, [1], live={1})  # rank 1 stages its shards (with optimizer state), then leaves
    params = _plan(dict(tp=2), dict(tp=1))  # later: rank 0 stages what a rollout layout needs
    _stage_all(shm, params, [0], live={0})
    names = StagedReader(shm).read_metadata().state_dict_metadata
    assert "optim/exp_avg/model.embed_tokens.weight" in names and "model.embed_tokens.weight" in names
    theirs = [t for t in full.transfers if t.tensor.startswith("optim/") and any(t.item.storage_index.offset)]
    out: dict = {}
    load_staged(shm, full, 0, out, transfers=theirs)  # rank 1's optimizer shards, still readable
    for t in theirs:
        offsets = tuple(a + b for a, b in zip(t.item.dest_index.offset, t.item.dest_offsets))
        layout = full.layouts[t.tensor]
        assert torch.equal(t.dst_view(out), reference_box(t.tensor, layout.shape, layout.dtype, offsets, t.lengths))
    other = _plan(dict(tp=4), dict(tp=1))  # the same tensors cut differently: another version
    with pytest.raises(LayoutError, match="already holds tensor .* with other boxes"):
        _stage_all(shm, other, [0], live={0})


def test_loads_go_through_dcp_and_read_only_the_needed_bytes(monkeypatch):
    """A column slice of a staged box: one ranged read of the covering span per item."""
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
    # rank 3 holds rows 16..32, columns 192..256: span from (16, 192) to (31, 255) inclusive
    assert reads == [((16 * 256 + 192) * 4, (31 * 256 + 255 + 1) * 4)]


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
    victim = f"{shm}/{box_file('model.layers.1.mlp.down_proj.weight', (0, 32))}"
    data = open(victim, "rb").read()
    with open(victim, "wb") as f:  # one flipped bit
        f.write(bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(TransferError, match=r"down_proj.*corrupted"):
        load_staged(shm, plan, 0, {}, checksums=True)
    with open(victim, "wb") as f:
        f.write(data[:-4])
    with pytest.raises(CoverageError, match=rf"{victim}.*truncated"):
        load_staged(shm, plan, 0, {})
    os.remove(victim)
    with pytest.raises(CoverageError, match=rf"{victim}.*missing"):
        load_staged(shm, plan, 0, {})


# ------------------------------------------------------------- a source rank leaves


def _gone_rank(rank: int, world: int, root: str) -> dict:
    """Rank 3 stages its shards, then leaves; the transition completes without it."""
    from nereus.reshard.execute import execute

    sources = derived(dict(tp=4), stage="s", optimizer=True)
    layouts = merge_layouts(sources, "source")
    src = reference_state(layouts.values(), rank)
    if rank == 3:  # before it goes: its boxes, whoever else holds them
        save_staged(root, layouts, src, rank=3, live={3}, checksums=True)
    dist.barrier()
    live = [0, 1, 2]
    group = dist.new_group(live)
    out: dict = {}
    # A: rank 3 is gone for good; the new layout (tp=2 on ranks 0, 1) excludes it.
    plan = plan_transfers(sources, derived(dict(tp=2), stage="t", optimizer=True), live=set(live), staged=True)
    if rank in live:
        res = execute(plan, graph_for(plan), src, rank=rank, group=group, staged_path=root, checksums=True)
        out["A"] = exact(plan, rank, res, src), res.stats.bytes_staged
    dist.barrier()
    # B: a fresh process replaced rank 3 and is a target again (tp=2 x dp=2 on ranks 0..3).
    plan = plan_transfers(sources, derived(dict(tp=2, dp=2), stage="t", optimizer=True), live=set(live), staged=True)
    fresh = rank == 3  # holds no source state at all
    res = execute(plan, graph_for(plan), {} if fresh else src, rank=rank, staged_path=root, checksums=True)
    bad = mismatches(res, plan.layouts.values(), rank) if fresh else exact(plan, rank, res, src)
    out["B"] = bad, res.stats.bytes_staged, res.stats.bytes_received
    return out


@pytest.mark.timeout(120)
def test_transition_completes_when_a_source_rank_is_gone(shm):
    results = run_distributed(_gone_rank, 4, shm, timeout=100)
    for rank, out in enumerate(results):
        assert out["B"][0] == [], (rank, out["B"])
        if rank < 3:
            assert out["A"][0] == [], (rank, out["A"])
    assert results[1]["A"][1] > 0  # tp=2 rank 1 needs TP4 shard 3: only in the staged checkpoint
    assert results[3]["B"][1] > 0 and results[3]["B"][2] > 0  # the new rank 3 mixes staged and streamed
    assert "A" not in results[3]
