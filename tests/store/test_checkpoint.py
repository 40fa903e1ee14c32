"""Checkpoints: save under one layout and world size, load under others, every element compared."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from nereus.reshard.derive import DecoderSpec, derive_emus
from nereus.reshard.layout import ParallelConfig
from nereus.reshard.plan import merge_layouts
from nereus.reshard.reference import mismatches, reference_state
from nereus.store.async_save import AsyncCheckpointer
from nereus.store.checkpoint import CheckpointStore, load_checkpoint, save_checkpoint
from nereus.store.errors import CheckpointExistsError, ConflictError, CorruptCheckpointError, SchemaError
from nereus.store.records import checkpoint_key
from tests.distributed_harness import run_distributed

SPEC = DecoderSpec(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2)


def emus_of(dp=1, tp=1, pp=1, **kwargs):
    return derive_emus(SPEC, ParallelConfig.on(dp=dp, tp=tp, pp=pp), model="actor", stage="train", optimizer=True, **kwargs)


def layouts_of(emus):
    return list(merge_layouts(emus, "test").values())


def saved_single(root, step, emus, seed=0, **kwargs):
    """Save from one process holding every rank's state (a tp=1, pp=1 layout on rank 0)."""
    bufs = reference_state(layouts_of(emus), 0, seed)
    return save_checkpoint(root, step, emus, {"actor": bufs}, rank=0, **kwargs)


def assert_loads_exactly(root, targets, seed=0, step=None):
    layouts = layouts_of(targets)
    for rank in sorted({r for e in targets for r in e.ranks}):
        _, out = load_checkpoint(root, targets, rank, step=step)
        assert mismatches(out.get("actor", {}), layouts, rank, seed) == []


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_single_process_round_trip_into_other_layouts(tmp_path, kind):
    root = str(tmp_path / "ck") if kind == "file" else f"memory://ck-{tmp_path.name}"
    manifest = saved_single(root, 7, emus_of(), state={"data_position": 123})
    store = CheckpointStore(root)
    assert store.steps() == [7] and store.manifest().state == {"data_position": 123}
    assert store.manifest().files == manifest.files
    for target in (emus_of(tp=2, pp=2), emus_of(dp=2, tp=4), emus_of(dp=3, dp_shard=True)):
        assert_loads_exactly(root, target)


def _save_rank(rank, world, root):
    """Step 10 saved synchronously, step 11 asynchronously (state changed right after staging)."""
    emus = emus_of(tp=2, pp=2)
    bufs = reference_state(layouts_of(emus), rank)
    m = save_checkpoint(root, 10, emus, {"actor": bufs}, rank=rank, state={"step": 10})
    saver = AsyncCheckpointer(root)
    try:
        bufs = reference_state(layouts_of(emus), rank, seed=11)
        future = saver.save(11, emus, {"actor": bufs}, rank=rank, state={"step": 11})
        for t in bufs.values():
            t.fill_(float("nan"))
        assert future.result(timeout=60).step == 11
    finally:
        saver.close()
    return m.step, len(m.files), len(m.rng)


def _load_rank(rank, world, root, config, step, seed):
    targets = emus_of(**config)
    _, out = load_checkpoint(root, targets, rank, step=step)
    return mismatches(out.get("actor", {}), layouts_of(targets), rank, seed)


@pytest.mark.timeout(180)
def test_saved_on_4_processes_loads_on_2_and_3(tmp_path):
    """tp=2,pp=2 with AdamW state on 4 gloo processes (sync and async saves) -> tp=2 on 2, pp=3 on 3."""
    root = str(tmp_path / "ck")
    results = run_distributed(_save_rank, 4, root, timeout=90)
    assert {r[0] for r in results} == {10} and results[0][2] == 4
    for d in os.listdir(tmp_path / "ck" / "data"):
        assert not any("rank" in f for f in os.listdir(tmp_path / "ck" / "data" / d))
    assert CheckpointStore(root).steps() == [10, 11]
    assert run_distributed(_load_rank, 2, root, {"tp": 2}, 10, 0, timeout=60) == [[], []]
    assert run_distributed(_load_rank, 3, root, {"pp": 3}, 11, 11, timeout=60) == [[], [], []]


def _slow_writer(root, started):
    """Save step 1, then a step-2 save that writes slowly (so the test can kill it mid-way)."""
    import nereus.store.dcp_io as dcp_io

    torch.set_num_threads(1)
    saved_single(root, 1, emus_of(), seed=1)
    original = dcp_io.write_file

    def slow(*args, **kwargs):
        flush = original(*args, **kwargs)
        time.sleep(0.05)
        return flush

    dcp_io.write_file = slow
    started.set()
    saved_single(root, 2, emus_of(), seed=2)


@pytest.mark.timeout(120)
def test_writer_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ck")
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    proc = ctx.Process(target=_slow_writer, args=(root, started))
    proc.start()
    try:
        assert started.wait(60)
        deadline = time.monotonic() + 30
        partial = []
        while time.monotonic() < deadline and not partial:
            dirs = [d for d in os.listdir(tmp_path / "ck" / "data") if d.startswith("000000000002")]
            partial = [f for d in dirs for f in os.listdir(tmp_path / "ck" / "data" / d) if f.endswith(".bin")]
            time.sleep(0.01)
        assert partial, "the writer never started step 2"
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
    store = CheckpointStore(root)
    assert store.steps() == [1]
    assert_loads_exactly(root, emus_of(tp=2), seed=1)
    saved_single(root, 2, emus_of(), seed=2)  # a retry is not blocked by the partial save
    assert store.steps() == [1, 2]
    assert_loads_exactly(root, emus_of(pp=2), seed=2)


def _racing_writer(root, barrier, queue):
    """Both writers pass the existence check, then meet at the barrier before committing:
    only the compare-and-swap of the commit can tell them apart."""
    torch.set_num_threads(1)
    store_cls = CheckpointStore
    commit = store_cls.commit

    def commit_after_both_wrote(self, manifest, **kwargs):
        barrier.wait(60)
        return commit(self, manifest, **kwargs)

    store_cls.commit = commit_after_both_wrote
    try:
        saved_single(root, 5, emus_of(), seed=5)
        queue.put("committed")
    except (ConflictError, CheckpointExistsError) as e:
        queue.put(type(e).__name__)


@pytest.mark.timeout(120)
def test_concurrent_writers_of_one_step_exactly_one_commits(tmp_path):
    root = str(tmp_path / "ck")
    CheckpointStore(root)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racing_writer, args=(root, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    outcomes = [queue.get(timeout=5) for _ in procs]
    assert sorted(outcomes) == ["ConflictError", "committed"], outcomes  # the CAS, not the pre-check, decided
    assert CheckpointStore(root).steps() == [5]
    assert len(os.listdir(tmp_path / "ck" / "data")) == 1  # the loser removed its data
    assert_loads_exactly(root, emus_of(tp=2), seed=5)


def test_async_save_stages_then_commits_and_retains(tmp_path):
    root = str(tmp_path / "ck")
    emus = emus_of()
    layouts = layouts_of(emus)
    saver = AsyncCheckpointer(root, keep=2)
    try:
        for step in (1, 2, 3):
            bufs = reference_state(layouts, 0, seed=step)
            saver.save(step, emus, {"actor": bufs}, state={"step": step})
            for t in bufs.values():  # training goes on and changes the state at once
                t.zero_()
        assert saver.wait().step == 3
    finally:
        saver.close()
    store = CheckpointStore(root)
    assert store.steps() == [2, 3] and len(os.listdir(tmp_path / "ck" / "data")) == 2
    assert_loads_exactly(root, emus_of(tp=2), seed=3)
    assert_loads_exactly(root, emus_of(pp=2), seed=2, step=2)


def test_existing_step_is_refused_unless_overwrite(tmp_path):
    root = str(tmp_path / "ck")
    saved_single(root, 1, emus_of(), seed=1)
    with pytest.raises(CheckpointExistsError, match="step 1"):
        saved_single(root, 1, emus_of(), seed=2)
    saved_single(root, 1, emus_of(), seed=2, overwrite=True)
    assert len(os.listdir(tmp_path / "ck" / "data")) == 1
    assert_loads_exactly(root, emus_of(tp=2), seed=2)


def _first_file(root, store):
    m = store.manifest()
    return m, os.path.join(root, m.data, m.files[3].path), m.files[3]


@pytest.mark.parametrize("damage", ["truncate", "flip", "two signs", "swap", "zero", "delete"])
def test_damaged_data_file_is_named_and_nothing_loads(tmp_path, damage):
    root = str(tmp_path / "ck")
    saved_single(root, 1, emus_of())
    store = CheckpointStore(root)
    _, path, entry = _first_file(root, store)
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(entry.nbytes - 4)
        match = "truncated"
    elif damage in ("flip", "two signs", "swap", "zero"):
        data = bytearray(open(path, "rb").read())
        if damage == "flip":
            data[0] ^= 0xFF
        elif damage == "two signs":  # the sign bits of two float32 words: a weighted sum misses it
            data[3] ^= 0x80
            data[11] ^= 0x80
        elif damage == "swap":
            data[0:4], data[4:8] = data[4:8], data[0:4]
        else:
            data[16:48] = bytes(32)
        assert bytes(data) != open(path, "rb").read()
        open(path, "wb").write(bytes(data))
        match = "corrupted"
    else:
        os.unlink(path)
        match = "is missing"
    with pytest.raises(CorruptCheckpointError, match=f"{os.path.basename(path)}.*{entry.tensor}.*{match}"):
        load_checkpoint(root, emus_of(), 0)


def test_unknown_schema_version_is_refused(tmp_path):
    root = str(tmp_path / "ck")
    saved_single(root, 1, emus_of())
    store = CheckpointStore(root)
    record = store.meta.get(checkpoint_key(1)).value
    store.meta.put(checkpoint_key(1), {**record, "schema": 99})
    with pytest.raises(SchemaError, match=r"'checkpoints/000000000001' has schema version 99"):
        store.manifest()


def _one_tensor_emu(shards, ranks):
    from nereus.reshard.layout import EMU, Shard, TensorLayout

    layout = TensorLayout(name="w", shape=(2048, 1024), dtype="float32",
                          shards=tuple(Shard(rank=r, offsets=o, lengths=n) for r, o, n in shards))
    config = ParallelConfig.on(tp=len(ranks))
    return [EMU(model="m", stage="s", replica=0, config=config, ranks=tuple(ranks), tensors=(layout,))]


def test_a_rank_verifies_and_reads_only_the_blocks_it_needs(tmp_path):
    """An 8 MiB box has two 4 MiB checksum blocks; damage in the second half stops only the rank that reads it."""
    root = str(tmp_path / "ck")
    src = _one_tensor_emu([(0, (0, 0), (2048, 1024))], [0])
    save_checkpoint(root, 1, src, {"m": reference_state(layouts_of(src), 0)}, rank=0)
    manifest = CheckpointStore(root).manifest()
    (entry,) = manifest.files
    assert len(entry.checksums) == 2
    path = os.path.join(root, manifest.data, entry.path)
    with open(path, "r+b") as f:
        f.seek(6 << 20)
        byte = f.read(1)
        f.seek(6 << 20)
        f.write(bytes([byte[0] ^ 0x10]))
    dst = _one_tensor_emu([(0, (0, 0), (1024, 1024)), (1, (1024, 0), (1024, 1024))], [0, 1])
    import numpy as np

    from nereus.reshard import staged_load as staged

    read: list[tuple[int, int]] = []
    real_map = staged.StagedReader._map

    def counting_map(self, box):  # the bytes the reader verifies come through this map: note which
        whole = real_map(self, box)
        base = whole.__array_interface__["data"][0]

        class Counted(np.ndarray):
            def __getitem__(self, key):
                part = np.ndarray.__getitem__(self, key)
                start = part.__array_interface__["data"][0] - base
                read.append((start, start + part.nbytes))
                return part

        return whole.view(Counted)

    staged.StagedReader._map = counting_map
    try:
        _, out = load_checkpoint(root, dst, 0)
    finally:
        staged.StagedReader._map = real_map
    assert mismatches(out["m"], layouts_of(dst), 0) == []
    touched = sorted(read)
    assert touched[0][0] == 0 and max(e for _, e in touched) == 4 << 20  # rank 0's rows: the first 4 MiB block only
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'm/w'.*bytes \[4194304, 8388608\).*corrupted"):
        load_checkpoint(root, dst, 1)


def test_an_object_store_load_reads_each_needed_byte_once(tmp_path, monkeypatch):
    """On memory:// (an object store's code path: ranged reads, no memory map), a rank reads
    the checksum blocks covering its regions once — verified on those bytes, then copied."""
    import fsspec

    root = f"memory://once-{tmp_path.name}"
    src = _one_tensor_emu([(0, (0, 0), (2048, 1024))], [0])
    save_checkpoint(root, 1, src, {"m": reference_state(layouts_of(src), 0)}, rank=0)
    fs = fsspec.filesystem("memory")
    reads: list[tuple[str, int, int]] = []
    original = type(fs).cat_file

    def spy(self, path, start=None, end=None, **kw):
        data = original(self, path, start=start, end=end, **kw)
        reads.append((path, start or 0, (start or 0) + len(data)))
        return data

    monkeypatch.setattr(type(fs), "cat_file", spy)
    dst = _one_tensor_emu([(0, (0, 0), (2048, 512)), (1, (0, 512), (2048, 512))], [0, 1])  # column halves: every block
    _, out = load_checkpoint(root, dst, 1)
    assert mismatches(out["m"], layouts_of(dst), 1) == []
    data_reads = [(s, e) for p, s, e in reads if p.endswith(".bin")]
    assert sum(e - s for s, e in data_reads) == 8 << 20  # the 8 MiB box once (the span of a column half is all of it)
    assert len(set(data_reads)) == len(data_reads)  # no range read twice


def test_a_killed_save_is_cleaned_at_the_next_save(tmp_path):
    root = str(tmp_path / "ck")
    saved_single(root, 1, emus_of(), seed=1)
    store = CheckpointStore(root)
    orphan = store.new_data_dir(2)  # a save that wrote data and died before its manifest
    os.makedirs(os.path.join(root, orphan))
    open(os.path.join(root, orphan, "x.bin"), "wb").write(b"partial")
    saved_single(root, 2, emus_of(), seed=2)  # a fresh orphan might be a writer still at work: kept
    assert os.path.isdir(os.path.join(root, orphan))
    saved_single(root, 3, emus_of(), seed=3, orphan_age=0)
    assert not os.path.exists(os.path.join(root, orphan))
    committed = {store.manifest(s).data.split("/")[1] for s in store.steps()}
    assert set(os.listdir(tmp_path / "ck" / "data")) == committed == {d for d in committed}
    assert store.clean_orphans(older_than=0) == []  # nothing committed is ever taken
    assert_loads_exactly(root, emus_of(tp=2), seed=3)


def test_async_saves_reuse_their_host_buffers(tmp_path):
    root = str(tmp_path / "ck")
    emus = emus_of()
    layouts = layouts_of(emus)
    saver = AsyncCheckpointer(root)
    try:
        saver.save(1, emus, {"actor": reference_state(layouts, 0, seed=1)})
        saver.wait()
        first = {k: t.data_ptr() for k, t in saver.host.items()}
        saver.save(2, emus, {"actor": reference_state(layouts, 0, seed=2)})
        saver.wait()
        assert first and {k: t.data_ptr() for k, t in saver.host.items()} == first  # the same buffers, refilled
    finally:
        saver.close()
    assert_loads_exactly(root, emus_of(tp=2), seed=1, step=1)
    assert_loads_exactly(root, emus_of(tp=2), seed=2, step=2)


def test_metadata_and_side_files_are_covered_by_the_manifest(tmp_path):
    root = str(tmp_path / "ck")
    saved_single(root, 1, emus_of(), files={"hf/actor/tokenizer.json": b'{"a": 1}'})
    store = CheckpointStore(root)
    manifest = store.manifest()
    assert {a.path for a in manifest.aux} == {"metadata.json", "hf/actor/tokenizer.json"}
    store.verify(manifest)
    for rel in ("metadata.json", "hf/actor/tokenizer.json"):
        path = os.path.join(root, manifest.data, rel)
        good = open(path, "rb").read()
        bad = bytearray(good)
        bad[2] ^= 0x20
        open(path, "wb").write(bytes(bad))
        with pytest.raises(CorruptCheckpointError, match=rf"file .*{rel}.*corrupted"):
            store.verify(manifest)
        open(path, "wb").write(good)


def test_a_side_file_is_read_once_and_verified_on_those_bytes(tmp_path, monkeypatch):
    """On memory:// an export's side file used to be read twice: verified, then read again."""
    import fsspec

    root = f"memory://side-{tmp_path.name}"
    saved_single(root, 1, emus_of(), files={"hf/actor/tokenizer.json": b'{"a": 1}' * 100})
    store = CheckpointStore(root)
    manifest = store.manifest()
    (entry,) = [a for a in manifest.aux if a.path == "hf/actor/tokenizer.json"]
    fs = fsspec.filesystem("memory")
    reads: list[tuple[str, int]] = []
    original = type(fs).cat_file

    def spy(self, path, start=None, end=None, **kw):
        data = original(self, path, start=start, end=end, **kw)
        reads.append((path, len(data)))
        return data

    monkeypatch.setattr(type(fs), "cat_file", spy)
    assert store.read_file(manifest, entry) == b'{"a": 1}' * 100
    assert [n for p, n in reads if p.endswith("tokenizer.json")] == [800]
    path = f"{root}/{manifest.data}/{entry.path}"
    fs.pipe_file(path, b'{"a": 2}' + b'{"a": 1}' * 99)
    with pytest.raises(CorruptCheckpointError, match=r"file .*hf/actor/tokenizer.json has crc32c \w+ in bytes \[0, 800\).*corrupted"):
        store.read_file(manifest, entry)


def test_a_private_root_gets_0600_files_and_a_durable_one_keeps_its_modes(tmp_path):
    """A root whose directory is 0700 (a staged copy) gets files 0600 and directories 0700,
    the metadata store's included (tensorstore writes under the umask); any other root keeps
    the modes it had (durable checkpoints are shared as the run dir is)."""
    def modes(root):
        return {os.stat(os.path.join(d, x)).st_mode & 0o7777 for d, dirs, files in os.walk(root) for x in dirs + files}

    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    for step in (1, 2, 3):
        saved_single(str(private), step, emus_of(), keep=2)
    assert CheckpointStore(str(private)).private and modes(private) == {0o700, 0o600}
    saved_single(str(shared), 1, emus_of())
    assert not CheckpointStore(str(shared)).private and 0o644 in modes(shared) and 0o600 not in modes(shared)


def test_a_sealed_manifest_matches_only_its_own_key_and_content(tmp_path):
    from dataclasses import replace

    from nereus.store.records import SEAL, manifest_seal

    m = saved_single(str(tmp_path / "ck"), 1, emus_of(), state={"step": 1}, seal="run-a")
    read = CheckpointStore(str(tmp_path / "ck")).manifest(1)
    assert read.state[SEAL] == manifest_seal(read, "run-a") != manifest_seal(read, "run-b")  # the seal survives the store
    f = read.files[0]
    forged = replace(read, files=(replace(f, checksums=("0" * 8,) * len(f.checksums)), *read.files[1:]))
    assert manifest_seal(forged, "run-a") != read.state[SEAL]
    assert manifest_seal(replace(read, state={**read.state, "step": 2}), "run-a") != read.state[SEAL]
    assert m.state[SEAL] == read.state[SEAL]
