"""The staged copy and the durable checkpoint under faults: what a node stages, a corrupted copy
refused for the durable one, and a SIGKILL during staging, a durable write or a live transition
leaving the last committed state usable."""

import os
import pickle
import signal
import time
from dataclasses import replace

import pytest

from nereus.trainer.prepare import load_config
from nereus.trainer.elastic.restore import check_staged
from tests.distributed_harness import run_distributed
from tests.trainer.elastic.common import TINY_GRPO, SMALL, TWO, ONE


def _own(base, run_dir) -> str:
    """The run's own staging dir in the staging base ``base``: ``nereus-<staging id>``."""
    from nereus.trainer.elastic.run_token import staging_id

    return os.path.join(str(base), f"nereus-{staging_id(str(run_dir))}")


def _train_and_stage(rank, world, run_dir, shm_dir):
    """One gloo rank: 2 steps, a durable checkpoint at step 1, the staged copy of step 2; a
    fresh trainer restores from the newest valid source, then again once a byte of a staged
    box file is flipped. Per restore: (step, record, its actor state == that step's, source
    kinds, staging dir still there, (its step counter, LR == that step's))."""
    import torch

    from nereus.trainer.runtime.step import Trainer
    from nereus.trainer.elastic.staging import Stager
    from nereus.trainer.elastic.restore import agree_sources, restore_newest

    cfg = load_config(TINY_GRPO, [*SMALL, *ONE, f"run_dir={run_dir}", f"elastic.staging_dir={shm_dir}",
                                  "grpo.lr_schedule.decay=linear"])  # the LR moves every update: its position is state
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg)
    trainer.run_step()
    trainer.save()
    states = {1: {k: v.clone() for k, v in trainer.stages["actor.train"].buffers().items()}}
    lrs = {1: trainer.stages["actor.train"].optimizer.param_groups[0]["lr"]}
    trainer.run_step()
    stager = Stager(cfg, rank)
    trainer.stage(stager)
    stager.close()
    modes = {os.stat(os.path.join(d, x)).st_mode & 0o7777 for d, dirs, files in os.walk(shm_dir) for x in dirs + files}
    modes.add(os.stat(shm_dir).st_mode & 0o7777)
    from nereus.trainer.elastic.staging import RUN_FILE

    named = open(os.path.join(_own(shm_dir, run_dir), RUN_FILE)).read()  # whose copies these are (earlier_staging)
    states[2] = {k: v.clone() for k, v in trainer.stages["actor.train"].buffers().items()}
    lrs[2] = trainer.stages["actor.train"].optimizer.param_groups[0]["lr"]
    out = []
    for corrupt in (False, True):
        if corrupt:
            data = os.path.join(_own(shm_dir, run_dir), "data")
            box = sorted(os.path.join(d, f) for d, _, fs in os.walk(data) for f in fs if not f.endswith(".json"))[0]
            with open(box, "r+b") as f:
                byte = f.read(1)
                f.seek(0)
                f.write(bytes([byte[0] ^ 0xFF]))
        fresh = Trainer(cfg)
        sources, reasons = agree_sources(cfg, trainer.checkpoint_root())
        step, record = restore_newest(fresh, sources, reasons)
        got = fresh.stages["actor.train"].buffers()
        same = all(torch.equal(got[k], want) for k, want in states[step].items())
        lr = fresh.stages["actor.train"].optimizer.param_groups[0]["lr"]
        out.append((step, record, same, [s.kind for s in sources], os.path.isdir(_own(shm_dir, run_dir)), (fresh.step, lr == lrs[step])))
    out.append(_capacity_and_a_failed_write(cfg, rank, fresh, shm_dir))
    out.append((modes, named))
    return out


def _capacity_and_a_failed_write(cfg, rank, trainer, shm_dir):
    """A stager on a node without room for staging_keep + 1 copies is off (its reason); a
    write that fails (ENOSPC after the box files are written) turns staging off and leaves no
    partial data. Returns (enabled, refusal, failed figure, data dirs left, committed steps)."""
    import errno

    from nereus.store import dcp_io
    from nereus.store.checkpoint import CheckpointStore
    from nereus.trainer.elastic import staging

    emus = [e for s in trainer.trained_stages() for e in s.emus]
    real_free, real_finish = staging.free_bytes, dcp_io.BoxWriter.finish
    staging.free_bytes = lambda root: 1 << 10
    try:
        tiny = staging.Stager(cfg, rank, emus)
    finally:
        staging.free_bytes = real_free
    full = staging.Stager(cfg, rank, emus)

    def enospc(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    dcp_io.BoxWriter.finish = enospc
    try:
        trainer.stage(full)  # the boxes are written, then the disk is full
        trainer.stage(full)  # waits for it: the failure
    finally:
        dcp_io.BoxWriter.finish = real_finish
    full.close()
    data = os.path.join(_own(shm_dir, cfg.run_dir), "data")
    left = os.listdir(data) if os.path.isdir(data) else []
    return tiny.enabled, tiny.refused, full.figures().get("failed"), left, CheckpointStore(_own(shm_dir, cfg.run_dir)).steps()


def _two_nodes_stage(rank, world, run_dir, shm_dir, shared):
    """One gloo rank standing for a node of its own (``GROUP_RANK``, ``LOCAL_RANK`` 0, its own
    staging dir unless ``shared``): a durable checkpoint at step 1, staged steps 2 and 3 on
    FSDP-sharded state. Then fresh trainers restore: both nodes hold step 3; node 1 lost its
    step 3 (killed while staging it): step 2, and node 0's step 3 retired; node 1's memory
    gone (a new machine): the durable step 1. Per restore: (step, source, the actor's state
    == that step's, this node's staged steps after). Plus: this node's part of step 2 (its
    box files) and the boxes its rank holds; or, ``shared``, (enabled, refusal)."""
    import shutil

    import torch

    from nereus.store.checkpoint import CheckpointStore, checkpoint_layouts
    from nereus.trainer.runtime.step import Trainer
    from nereus.trainer.elastic.staging import Stager
    from nereus.trainer.elastic.restore import agree_sources, restore_newest

    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    base = shm_dir if shared else f"{shm_dir}/{rank}"
    cfg = load_config(TINY_GRPO, [*SMALL, *TWO, "plan.actor.train.dp_shard=true", f"run_dir={run_dir}",
                                  f"elastic.staging_dir={base}"])
    mine = _own(base, run_dir)
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg)
    emus = [e for s in trainer.trained_stages() for e in s.emus]
    stager = Stager(cfg, rank, emus)
    if shared:
        stager.close()
        return stager.enabled, stager.refused

    def actor():
        return {k: v.clone() for k, v in trainer.stages["actor.train"].buffers().items()}

    trainer.run_step()
    trainer.save()
    states = {1: actor()}
    for _ in (2, 3):
        trainer.run_step()
        trainer.stage(stager)
        stager.saver.wait()
        states[trainer.step] = actor()
    stager.close()
    store = CheckpointStore(mine)
    manifest = store.manifest(2)
    part = sorted((f.tensor, f.offsets) for f in manifest.files)
    held = sorted({(name, s.offsets) for name, layout in checkpoint_layouts(emus).items() for s in layout.shards
                   if s.rank == rank and all(s.lengths)})
    out = []
    for case in ("both", "node 1 lost step 3", "node 1 lost its memory"):
        if case == "node 1 lost step 3" and rank == 1:
            store.delete(3)
        if case == "node 1 lost its memory" and rank == 1:
            shutil.rmtree(mine)
        torch.distributed.barrier()
        fresh = Trainer(cfg)
        sources, reasons = agree_sources(cfg, trainer.checkpoint_root())
        step, record = restore_newest(fresh, sources, reasons)
        got = fresh.stages["actor.train"].buffers()
        same = all(torch.equal(got[k], want) for k, want in states[step].items())
        left = CheckpointStore(mine).steps() if os.path.isdir(mine) else None
        out.append((step, record["source"], same, left, record["refused"]))
        torch.distributed.barrier()
    return out, part, held, manifest.state["node"]


@pytest.mark.timeout(180)
def test_on_two_nodes_each_stages_its_part_and_a_restart_restores_the_newest_step_both_hold(tmp_path, shm_dir):
    ranks = run_distributed(_two_nodes_stage, 2, str(tmp_path / "run"), shm_dir, False, timeout=170)
    for rank, (restores, part, held, node) in enumerate(ranks):
        assert node == {"ranks": [rank], "world": 2}
        assert part == held and part  # exactly the boxes this node's rank holds: its shards of the FSDP state
        both, lost_step, lost_memory = restores
        assert both[:4] == (3, "staged", True, [2, 3]) and both[4] == []
        assert lost_step[:4] == (2, "staged", True, [2]) and lost_step[4] == []  # node 0's step 3 is retired
        assert lost_memory[:3] == (1, "durable", True) and lost_memory[3] is None  # every node's copy discarded
        assert "rank 1 sees none on its node" in lost_memory[4][0]
    both = set(ranks[0][1]) & set(ranks[1][1])  # FSDP: each node holds its own shards; AdamW's step counters are on both
    assert both and all("/optim/step/" in name and offsets == () for name, offsets in both), sorted(both)
    assert len(ranks[0][1]) > len(both)


@pytest.mark.timeout(120)
def test_two_nodes_that_would_stage_into_one_directory_do_not_stage(tmp_path, shm_dir):
    for enabled, refused in run_distributed(_two_nodes_stage, 2, str(tmp_path / "run"), shm_dir, True, timeout=110):
        assert not enabled and "are on different nodes but their staging dirs are one directory" in refused


def test_a_save_by_a_node_writes_every_box_its_ranks_hold_replicas_too():
    from nereus.reshard.layout import Shard, TensorLayout
    from nereus.store.dcp_io import all_boxes, plan_owned_boxes

    shards = [Shard(rank=r, offsets=(0, 0), lengths=(4, 4)) for r in (0, 1, 2, 3)]  # replicated on 4 ranks
    shards += [Shard(rank=r, offsets=(4 * i, 0), lengths=(4, 4)) for i, r in enumerate((0, 2))]  # sharded over 0 and 2
    layouts = {"w": TensorLayout(name="w", shape=(8, 4), dtype="float32", shards=tuple(shards[:4])),
               "v": TensorLayout(name="v", shape=(8, 4), dtype="float32", shards=tuple(shards[4:]))}
    assert plan_owned_boxes(layouts, 0) == [("v", (0, 0), (4, 4)), ("w", (0, 0), (4, 4))] and plan_owned_boxes(layouts, 2) == [
        ("v", (4, 0), (4, 4))]
    node = frozenset({2, 3})  # the replica's lowest holder is on another node: this node writes it too
    assert plan_owned_boxes(layouts, 2, node) == [("v", (4, 0), (4, 4)), ("w", (0, 0), (4, 4))]
    assert plan_owned_boxes(layouts, 3, node) == []
    assert all_boxes(layouts, frozenset({3})) == [("w", (0, 0), (4, 4))]


@pytest.mark.timeout(120)
def test_the_staged_copy_restores_its_step_and_a_corrupted_one_is_refused_for_the_durable(tmp_path, shm_dir):
    staged, durable, capacity, (modes, named) = run_distributed(_train_and_stage, 1, str(tmp_path / "run"), shm_dir, timeout=110)[0]
    assert modes == {0o700, 0o600}  # only its owner reads the staged copy: dirs 0700, files 0600 (the store's too)
    assert named == f"{tmp_path / 'run'}\n"
    step, record, same, kinds, left, counters = staged
    assert step == 2 and record["source"] == "staged" and record["refused"] == [] and kinds == ["staged", "durable"]
    assert same and counters == (2, True) and left  # every element of the actor's state; the step and the LR schedule
    step, record, same, kinds, left, counters = durable
    assert kinds == ["staged", "durable"]  # the corrupted copy passed the metadata checks; its bytes did not
    assert step == 1 and record["source"] == "durable" and same and counters == (1, True)
    assert len(record["refused"]) == 1 and "staged step 2 refused on rank 0" in record["refused"][0]
    assert "corrupted" in record["refused"][0] and shm_dir in record["refused"][0]  # names the file
    assert not left  # discarded: the next attempt does not meet it again
    enabled, refused, failed, data_left, steps = capacity
    assert not enabled and "3 copies of the state" in refused and "MiB are free there" in refused
    assert "No space left on device" in failed and data_left == [] and steps == []  # the partial data went


def _kill_while_staging(rank, world, run_dir, shm_dir):
    """Stage step 1, then die (SIGKILL) inside the staging of step 2, after its box files are
    written and before its manifest commits."""
    from nereus.store import checkpoint
    from nereus.trainer.runtime.step import Trainer
    from nereus.trainer.elastic.staging import Stager

    cfg = load_config(TINY_GRPO, [*SMALL, *ONE, f"run_dir={run_dir}", f"elastic.staging_dir={shm_dir}"])
    trainer = Trainer(cfg)
    stager = Stager(cfg, rank)
    trainer.run_step()
    trainer.stage(stager)
    stager.saver.wait()
    trainer.run_step()
    checkpoint.CheckpointStore.commit = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    trainer.stage(stager)
    stager.saver.wait()
    return "survived"


@pytest.mark.timeout(120)
def test_a_kill_during_staging_leaves_the_previous_staged_step_valid(tmp_path, shm_dir):
    from nereus.store.checkpoint import CheckpointStore
    from nereus.trainer.elastic.restore import local_view

    with pytest.raises(RuntimeError, match="exited with code -9"):
        run_distributed(_kill_while_staging, 1, str(tmp_path / "run"), shm_dir, timeout=110)
    own = _own(shm_dir, tmp_path / "run")
    store = CheckpointStore(own)
    assert store.steps() == [1]
    written = sorted(os.listdir(os.path.join(own, "data")))
    assert len(written) == 2 and written[1].startswith("000000000002-")  # step 2's boxes, named by no manifest
    store.verify(store.manifest(1))  # every block of step 1 against its checksums
    from nereus.trainer.elastic.run_token import staging_id

    view = local_view(own, str(tmp_path / "run" / "checkpoints"), staging_id(str(tmp_path / "run")))
    assert view["staged"]["step"] == 1 and check_staged(view["staged"], durable_step=None, run_dir=str(tmp_path / "run")) is None
    other = local_view(own, str(tmp_path / "run" / "checkpoints"), staging_id(str(tmp_path / "other")))["staged"]
    assert "its seal does not match this run's" in check_staged({**other, "staged": view["staged"]["staged"]}, durable_step=None,
                                                                run_dir=str(tmp_path / "run"))


def _actor_state(trainer, rank):
    """actor.train's every parameter and AdamW tensor, gathered whole on rank 0 (raw bytes)."""
    from nereus.reshard.gather import gather_full
    from tests.trainer.elastic.test_resume import raw_bytes

    stage = trainer.stages["actor.train"]
    full = gather_full(stage.emus, stage.buffers() if stage.member else {}, rank)
    return None if full is None else {n: raw_bytes(t) for n, t in full.items()}


def _kill_while_saving(rank, world, run_dir):
    """Save step 1 durably, then die (SIGKILL) inside the durable save of step 2, as its third
    box file's write starts (two writes began before it)."""

    from nereus.store import dcp_io
    from nereus.trainer.runtime.step import Trainer

    cfg = load_config(TINY_GRPO, [*SMALL, *ONE, f"run_dir={run_dir}"])
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg)
    trainer.run_step()
    trainer.save()
    with open(os.path.join(run_dir, "step1.pkl"), "wb") as f:
        pickle.dump(_actor_state(trainer, rank), f)
    trainer.run_step()
    real, calls = dcp_io.write_file, []

    def dying(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    dcp_io.write_file = dying
    trainer.save()
    return "survived"


def _restore_and_gather(rank, world, run_dir, sets):
    """A fresh trainer restores the newest valid source (staged, else durable), as a
    restarted worker does; rank 0 returns (step, source, actor state, plan it was saved in)."""
    from nereus.trainer.runtime.step import Trainer
    from nereus.trainer.elastic.restore import agree_sources, restore_newest

    cfg = load_config(TINY_GRPO, [*sets, f"run_dir={run_dir}"])
    trainer = Trainer(cfg)
    sources, reasons = agree_sources(cfg, trainer.checkpoint_root())
    step, record = restore_newest(trainer, sources, reasons)
    state = _actor_state(trainer, rank)
    return (step, record, state) if rank == 0 else None


def _same(a: dict, b: dict) -> bool:
    """Two states of raw bytes (``_actor_state``) hold the same tensors, byte for byte."""
    import numpy as np

    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(180)
def test_a_kill_during_a_durable_write_loses_nothing_committed(tmp_path):

    from nereus.store.checkpoint import CheckpointStore

    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="exited with code -9"):
        run_distributed(_kill_while_saving, 1, str(run_dir), timeout=110)
    store = CheckpointStore(str(run_dir / "checkpoints"))
    assert store.steps() == [1]  # step 2's manifest never committed
    data = lambda: sorted(os.listdir(os.path.join(store.root, "data")))  # noqa: E731
    assert len(data()) == 2  # step 1's, and step 2's torn data dir that no manifest names
    store.verify(store.manifest(1))  # every block of step 1 against its checksums
    step, record, state = run_distributed(_restore_and_gather, 1, str(run_dir), [*SMALL, *ONE], timeout=110)[0]
    assert step == 1 and record["source"] == "durable"
    assert _same(state, pickle.loads((run_dir / "step1.pkl").read_bytes()))  # every element of the actor's committed state
    assert len(data()) == 1  # the restore removed the torn save


def _kill_mid_transition(rank, world, run_dir, shm_dir):
    """2 ranks: a step, its state staged; then a live transition of actor.train (dp2 -> tp2),
    in which rank 1 dies (SIGKILL) right after posting its first message."""

    from nereus.reshard import transport
    from nereus.trainer.runtime.step import Trainer
    from nereus.trainer.elastic.staging import Stager

    cfg = load_config(TINY_GRPO, [*SMALL, *TWO, f"run_dir={run_dir}", f"elastic.staging_dir={shm_dir}", "elastic.collective_timeout_s=30"])
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg)
    trainer.run_step()
    stager = Stager(cfg, rank)
    trainer.stage(stager)
    stager.saver.wait()
    before = _actor_state(trainer, rank)
    if rank == 0:
        with open(os.path.join(run_dir, "before.pkl"), "wb") as f:
            pickle.dump(before, f)
    if rank == 1:
        real = transport.Transport.isend

        def dying(self, *args, **kwargs):
            work = real(self, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
            return work

        transport.Transport.isend = dying
    plan = cfg.plan
    new = replace(plan, actor=replace(plan.actor, train=replace(plan.actor.train, dp=1, tp=2)))
    trainer.apply_plan(new)
    return "moved"


@pytest.mark.timeout(240)
def test_a_kill_halfway_through_a_transition_leaves_the_old_committed_state_usable(tmp_path, shm_dir):
    """A live transition moves into fresh buffers and commits nothing: a rank that dies in it
    (its first message posted) kills the attempt, and the restart restores the step staged
    before the move, in the old plan, byte for byte."""

    from nereus.store.checkpoint import CheckpointStore
    from nereus.trainer.elastic.resume import plan_for_start

    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="exited with code -9"):
        run_distributed(_kill_mid_transition, 2, str(run_dir), shm_dir, timeout=150)
    staged = CheckpointStore(_own(shm_dir, run_dir))
    assert staged.steps() == [1]
    staged.verify(staged.manifest(1))
    step, record, state = run_distributed(_restore_and_gather, 2, str(run_dir),
                                          [*SMALL, *TWO, f"elastic.staging_dir={shm_dir}"], timeout=150)[0]
    assert step == 1 and record["source"] == "staged"
    assert _same(state, pickle.loads((run_dir / "before.pkl").read_bytes()))  # every element, as before the transition began
    cfg = load_config(TINY_GRPO, [*SMALL, *TWO, f"run_dir={run_dir}"])
    restarted, how = plan_for_start(cfg, staged.manifest(1).plan, 2)
    assert restarted.plan == cfg.plan and how == "the restored state's plan"  # the old plan: the move never committed


def _st(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 1, 1, 1, uid, 0, 0, 0, 0, 0))


def test_a_staging_dir_is_used_only_when_this_user_owns_it_and_no_one_else_can_write_it():
    import stat

    from nereus.trainer.elastic.staging import dir_refusal, parent_refusal

    d = stat.S_IFDIR
    assert dir_refusal("/dev/shm/s", _st(d | 0o700, 4242), 4242) is None
    assert dir_refusal("/dev/shm/s", _st(d | 0o755, 4242), 4242) is None  # readable only: narrowed to 0700 when opened
    assert "/dev/shm/s is owned by uid 12345, not by this user" in dir_refusal("/dev/shm/s", _st(d | 0o700, 12345), 4242)
    assert "writable by group and other (mode 0777)" in dir_refusal("/dev/shm/s", _st(d | 0o777, 4242), 4242)
    assert "writable by group (mode 0770)" in dir_refusal("/dev/shm/s", _st(d | 0o770, 4242), 4242)
    assert "is a symlink (owned by uid 4242)" in dir_refusal("/dev/shm/s", _st(stat.S_IFLNK | 0o777, 4242), 4242)
    assert "is not a directory" in dir_refusal("/dev/shm/s", _st(stat.S_IFREG | 0o600, 4242), 4242)
    assert parent_refusal("/dev/shm", _st(d | 0o1777, 0), 4242) is None  # root's, sticky: nobody swaps our entry
    assert "without the sticky bit (mode 0777)" in parent_refusal("/x", _st(d | 0o777, 0), 4242)
    assert "/x is owned by uid 12345" in parent_refusal("/x", _st(d | 0o755, 12345), 4242)


def _train(run_dir, *sets: str, env: dict | None = None):
    """`nereus train` with staging on (in this process), its result."""
    from typer.testing import CliRunner

    from nereus.cli.app import app

    return CliRunner().invoke(app, ["train", TINY_GRPO, "--run-dir", str(run_dir), "--max-restarts", "1",
                                    *[a for s in [*SMALL, *sets] for a in ("--set", s)]], env=env)


def test_a_loose_or_a_linked_staging_dir_or_parent_is_refused_and_left_as_it_is(tmp_path, shm_dir):
    """For every user: a 0777 dir and a symlink, as the staging dir or as a parent of it, are
    refused (one line naming the path; nothing created in them, nothing cleared); this user's
    dir readable by others is narrowed to 0700 with meta/ and data/ 0700; `nereus train` with
    staging on refuses a bad one before anything is written (no run dir)."""
    from nereus.trainer.elastic.staging import STAGING_ENV, check_staging_dir, clear_staging, open_staging_dir

    os.mkdir(shm_dir)
    os.chmod(shm_dir, 0o777)
    (open(os.path.join(shm_dir, "theirs"), "w")).close()
    assert "writable by group and other (mode 0777)" in open_staging_dir(shm_dir)
    clear_staging(shm_dir)
    assert os.listdir(shm_dir) == ["theirs"]  # nothing made in it, nothing cleared
    run_dir = tmp_path / "run"
    for sets, env in (([f"elastic.staging_dir={shm_dir}"], None), ([], {STAGING_ENV: shm_dir})):  # the base, 0777
        result = _train(run_dir, *sets, env=env)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"staging dir's parent {shm_dir} is writable by others without the sticky bit (mode 0777)" in result.output
        assert len(result.output.strip().splitlines()) == 1 and not run_dir.exists()  # nothing written
    assert os.listdir(shm_dir) == ["theirs"]
    os.chmod(shm_dir, 0o755)  # this user's, readable by others (an older Nereus's): narrowed
    assert open_staging_dir(shm_dir) is None
    modes = {p: os.stat(os.path.join(shm_dir, p)).st_mode & 0o7777 for p in (".", "meta", "data")}
    assert modes == {".": 0o700, "meta": 0o700, "data": 0o700}

    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = f"{shm_dir}-link"
    os.symlink(target, link)
    try:
        assert f"staging dir {link} is a symlink" in open_staging_dir(link)  # the dir itself a link
        below = os.path.join(link, "nereus-abc")  # a parent a link: stat() would follow it to a fine dir
        why = check_staging_dir(below)
        assert why == open_staging_dir(below) and why.startswith(f"staging dir's parent {link} is a symlink (to {target}): refused")
        assert "\n" not in why
        assert check_staging_dir(os.path.join(link, "a", "b", "nereus-abc")).startswith(f"staging dir's parent {link} is a symlink")
        result = _train(run_dir, env={STAGING_ENV: link})  # the node's base a link
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"staging dir's parent {link} is a symlink (to {target})" in result.output
        assert len(result.output.strip().splitlines()) == 1 and not run_dir.exists()
        clear_staging(below)
        assert os.listdir(target) == []  # nothing made through a link
    finally:
        os.unlink(link)
    assert check_staging_dir("/dev/shm/nereus-abc") is None  # /dev/shm itself: root's, sticky 1777, a real dir
    assert "without '..'" in check_staging_dir(f"{shm_dir}/../x")


@pytest.mark.skipif(os.geteuid() != 0, reason="chowns a dir to another uid: needs root (the pure owner check above runs anywhere)")
def test_another_users_staging_dir_is_refused_and_left_as_it_is(tmp_path, shm_dir, monkeypatch):
    """Run as root here: a dir chowned to uid 12345 is refused (one line naming the path and
    its owner; nothing created in it, nothing cleared), as the staging dir and as its base;
    `nereus train` with staging on refuses it before anything is written (no run dir)."""
    from nereus.trainer.elastic.staging import STAGING_ENV, clear_staging, open_staging_dir

    os.mkdir(shm_dir, 0o700)
    (open(os.path.join(shm_dir, "theirs"), "w")).close()
    os.chown(shm_dir, 12345, 12345)
    assert "owned by uid 12345, not by this user" in open_staging_dir(shm_dir)
    clear_staging(shm_dir)
    assert os.listdir(shm_dir) == ["theirs"]
    run_dir = tmp_path / "run"
    for sets, env in (([f"elastic.staging_dir={shm_dir}"], None), ([], {STAGING_ENV: shm_dir})):
        result = _train(run_dir, *sets, env=env)
        assert result.exit_code == 2 and "owned by uid 12345" in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1 and not run_dir.exists()  # nothing written
    assert os.listdir(shm_dir) == ["theirs"]


def test_runs_sharing_a_staging_base_each_clear_only_their_own(tmp_path, shm_dir, monkeypatch):
    """Two runs on one node's NEREUS_STAGING_DIR: each stages in a dir of its own there
    (``nereus-<run id>``); the first finishing (``finish_staging``) or starting fresh again
    (``clear_staging``) removes its own copies only — the other's files stay byte for byte,
    and so does whatever else is in the base."""
    import hashlib

    import torch.distributed as dist

    from nereus.trainer.elastic.staging import STAGING_ENV, clear_staging, finish_staging, open_staging_dir, staging_root

    def tree(root):
        out = {}
        for d, _, files in os.walk(root):
            for f in files:
                path = os.path.join(d, f)
                out[os.path.relpath(path, root)] = (os.stat(path).st_mode, hashlib.sha256(open(path, "rb").read()).hexdigest())
        return out

    monkeypatch.setenv(STAGING_ENV, shm_dir)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)  # finish_staging's collective, one process here
    cfgs = [load_config(TINY_GRPO, [f"run_dir={tmp_path / name}"]) for name in ("a", "b")]
    roots = [staging_root(c) for c in cfgs]
    assert roots[0] != roots[1] and {os.path.dirname(r) for r in roots} == {shm_dir}
    for i, root in enumerate(roots):
        assert open_staging_dir(root) is None
        for part in ("meta", "data"):
            with open(os.path.join(root, part, f"run{i}.bin"), "wb") as f:
                f.write(os.urandom(4096))
    with open(os.path.join(shm_dir, "someone-elses"), "wb") as f:
        f.write(b"keep")
    other = tree(roots[1])
    assert len(other) == 2
    finish_staging(cfgs[0])
    assert not os.path.exists(roots[0])
    assert tree(roots[1]) == other  # byte for byte, modes too
    assert sorted(os.listdir(shm_dir)) == sorted([os.path.basename(roots[1]), "someone-elses"])
    assert open_staging_dir(roots[0]) is None
    clear_staging(roots[0])  # a fresh start's clean-up
    assert tree(roots[1]) == other and not os.path.exists(roots[0])


def test_every_dir_staging_makes_is_exactly_0700_whatever_the_umask(shm_dir):
    from nereus.store.dcp_io import makedirs_private
    from nereus.trainer.elastic.staging import open_staging_dir

    for i, umask in enumerate((0o000, 0o022, 0o077, 0o277, 0o027)):
        old = os.umask(umask)
        try:
            deep = os.path.join(shm_dir, f"u{i}", "a", "b")
            makedirs_private(deep)
            root = os.path.join(shm_dir, f"s{i}", "nereus-x")
            assert open_staging_dir(root) is None
        finally:
            os.umask(old)
        made = [os.path.join(shm_dir, f"u{i}"), os.path.join(shm_dir, f"u{i}", "a"), deep,
                os.path.dirname(root), root, os.path.join(root, "meta"), os.path.join(root, "data")]
        modes = {p: os.stat(p).st_mode & 0o7777 for p in made}
        assert set(modes.values()) == {0o700}, (oct(umask), {p: oct(m) for p, m in modes.items()})
    assert os.stat(shm_dir).st_mode & 0o7777 == 0o700  # made by the first makedirs_private too
    os.chmod(shm_dir, 0o750)
    makedirs_private(shm_dir)  # one that was there is left as it is
    assert os.stat(shm_dir).st_mode & 0o7777 == 0o750


def test_staged_copies_of_the_older_layout_are_named_in_one_line_and_left_as_they_are(tmp_path):
    """An older Nereus staged directly in the configured dir (``meta/``, ``data/`` there): this
    one never finds them, so it names them (path, size, the command that frees them) and
    deletes nothing — they may be another run's."""
    from nereus.trainer.elastic.staging import legacy_staging

    base = tmp_path / "stage"
    (base / "nereus-abc" / "meta").mkdir(parents=True)  # this layout's: not reported
    assert legacy_staging(str(base)) is None
    (base / "meta").mkdir()
    (base / "data").mkdir()
    (base / "data" / "box.bin").write_bytes(b"x" * (3 << 20))
    line = legacy_staging(str(base))
    assert line.startswith(f"staging dir {base} holds staged copies in an older layout ({base}/meta and {base}/data, 3.0 MiB")
    assert f"rm -r {base}/meta {base}/data" in line and "\n" not in line
    assert (base / "data" / "box.bin").stat().st_size == 3 << 20  # nothing deleted


def test_a_run_dir_at_the_same_path_that_is_not_this_run_stages_under_another_id(tmp_path):
    """Two containers sharing the host's /dev/shm, each with its own volume at one path: the
    staging id hashes the path with the token the run's first start left in the run dir."""
    import shutil
    import threading

    from nereus.trainer.elastic.run_token import RUN_TOKEN, adopt_run_token, run_id, run_token, staging_id

    run = str(tmp_path / "run")
    os.makedirs(run)
    assert staging_id(run) == run_id(run)  # no job started here yet
    tokens = []
    threads = [threading.Thread(target=lambda: tokens.append(run_token(run))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(tokens)) == 1 and os.listdir(run) == [RUN_TOKEN]  # starting together: one token, no file left behind
    mine = staging_id(run)
    assert mine != run_id(run) and staging_id(run) == mine and run_token(run) == tokens[0]  # kept: every attempt the same
    shutil.rmtree(run)
    os.makedirs(run)
    run_token(run)
    assert staging_id(run) != mine  # the other container's run at the same path
    theirs = staging_id(run)
    os.unlink(os.path.join(run, RUN_TOKEN))  # a rank whose node sees no token file takes rank 0's (restore.agree_start)
    assert staging_id(run) == run_id(run)
    adopt_run_token(run, tokens[0])
    assert staging_id(run) == mine != theirs and not os.path.exists(os.path.join(run, RUN_TOKEN))


def test_a_run_token_that_cannot_be_read_or_is_not_one_is_a_line_naming_its_file(tmp_path, monkeypatch):
    """An empty, unreadable or foreign token file: an OSError naming it (the launcher's exit 2,
    agree_start's line); a killed start's .tmp file goes; without hard links, O_EXCL makes it."""
    import errno

    from nereus.trainer.elastic.run_token import RUN_TOKEN, run_token, staging_id

    for name, make in (("empty", lambda p: p.write_text("")), ("foreign", lambda p: p.write_text("not a token\n")),
                       ("a-dir", lambda p: p.mkdir())):
        (tmp_path / name).mkdir()
        make(tmp_path / name / RUN_TOKEN)
        with pytest.raises(OSError, match=f"{tmp_path / name / RUN_TOKEN}"):
            run_token(str(tmp_path / name))
        if name != "empty":
            with pytest.raises(OSError, match=f"{tmp_path / name / RUN_TOKEN}"):
                staging_id(str(tmp_path / name))
    left = tmp_path / "left"
    left.mkdir()
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid: no process now
    host = socket.gethostname()
    gone, live, elsewhere = (f"{RUN_TOKEN}.{host}.{dead.pid}.abcd.tmp", f"{RUN_TOKEN}.{host}.{os.getpid()}.abcd.tmp",
                             f"{RUN_TOKEN}.other-host.{dead.pid}.abcd.tmp")
    for name in (gone, live, elsewhere):  # a SIGKILL between a write and its unlink; a maker still at work; another host's
        (left / name).write_text("ff" * 16)
    run_token(str(left))
    assert sorted(os.listdir(left)) == sorted([RUN_TOKEN, live, elsewhere])

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted", src)

    monkeypatch.setattr(os, "link", no_links)
    plain = tmp_path / "no-links"
    token = run_token(str(plain))
    assert sorted(os.listdir(plain)) == [RUN_TOKEN] and len(token) == 32 and run_token(str(plain)) == token


def test_staging_dirs_of_earlier_runs_at_this_path_are_named_and_left(tmp_path, shm_dir):
    """An older Nereus's nereus-<run id>, and a dir whose run file names this run dir under
    another token (the run dir removed and made again): named in one line with their size
    and the rm -r; this run's own dir, another run's, a sentinel file, a linked dir: not named.
    Nothing is removed."""
    import shutil

    from nereus.trainer.elastic.run_token import run_id, run_token, staging_id
    from nereus.trainer.elastic.staging import RUN_FILE, earlier_staging, mark_run

    run, other = tmp_path / "run", tmp_path / "other"
    os.makedirs(shm_dir)
    assert earlier_staging(shm_dir, str(run)) is None
    old = os.path.join(shm_dir, f"nereus-{run_id(str(run))}")  # an older Nereus's, named by the path alone
    os.makedirs(os.path.join(old, "data"))
    with open(os.path.join(old, "data", "box"), "wb") as f:
        f.write(b"\0" * (1 << 20))
    run_token(str(run))
    earlier = os.path.join(shm_dir, f"nereus-{staging_id(str(run))}")
    os.makedirs(earlier)
    mark_run(earlier, str(run))
    shutil.rmtree(run)  # removed and made again: a new token
    run_token(str(run))
    mine = os.path.join(shm_dir, f"nereus-{staging_id(str(run))}")
    run_token(str(other))
    for d, owner in ((mine, run), (os.path.join(shm_dir, f"nereus-{staging_id(str(other))}"), other)):
        os.makedirs(d)
        mark_run(d, str(owner))
    open(os.path.join(shm_dir, f"nereus-{run_id(str(run))}.123.launcher"), "w").close()
    os.symlink(earlier, os.path.join(shm_dir, "nereus-linked"))
    named = {old: f"{old} (1.0 MiB, an older Nereus's)", earlier: f"{earlier} (0.0 MiB)"}
    assert earlier_staging(shm_dir, str(run)) == (
        f"staged copies of earlier runs at {run} are left in {', '.join(named[d] for d in sorted(named))}: this run neither "
        f"restores nor clears them; remove them (rm -r {' '.join(sorted(named))}) once no run at this path (another "
        "container's, or an older Nereus resuming its own) needs them")
    assert os.path.isdir(old) and open(os.path.join(earlier, RUN_FILE)).read() == f"{run}\n"
    assert os.stat(os.path.join(earlier, RUN_FILE)).st_mode & 0o777 == 0o600


def test_a_first_start_checks_the_staging_bases_parents_not_a_dir_named_by_the_path(tmp_path, shm_dir):
    """Before the first start makes the run token, the staging dir's name is unknown: a loose
    dir planted at nereus-<run id> (a public hash) does not stop the launch; once the run dir
    has its token, its own dir is checked."""
    from nereus.cli.train import preflight
    from nereus.trainer.elastic.run_token import run_id, run_token
    from nereus.trainer.elastic.staging import staging_root

    run = tmp_path / "run"
    cfg = load_config(TINY_GRPO, [f"run_dir={run}", f"elastic.staging_dir={shm_dir}"])
    planted = os.path.join(shm_dir, f"nereus-{run_id(str(run))}")
    os.makedirs(planted)
    os.chmod(planted, 0o777)
    preflight(cfg, max_restarts=1)  # no exit: the workers' dir is nereus-<staging id>
    run_token(str(run))
    os.makedirs(staging_root(cfg))
    os.chmod(staging_root(cfg), 0o777)
    import typer

    with pytest.raises(typer.Exit):
        preflight(cfg, max_restarts=1)


def test_a_step_is_logged_only_once_the_step_before_it_is_staged():
    """``Stager.wait`` (which the step loop calls before it logs a step) waits for the write in
    flight; the time joins the next staging's ``wait_s``; a write that failed turns staging
    off on this rank, as ``stage`` does."""
    from nereus.trainer.elastic.staging import Stager

    class Saver:
        def __init__(self, error=None):
            self.waits, self.error = 0, error

        def wait(self):
            self.waits += 1
            time.sleep(0.05)
            if self.error:
                raise self.error

    stager = Stager.__new__(Stager)  # the step loop's view: no process group needed for wait()
    stager.enabled, stager.saver, stager._waited, stager.last, stager.rank = True, Saver(), 0.0, {}, 1
    stager.wait()
    assert stager.saver.waits == 1 and stager._waited >= 0.05 and stager.enabled
    stager.saver, stager.root = Saver(OSError("tmpfs full")), "/nonexistent-staging-root"
    stager.wait()
    assert not stager.enabled and stager.last["failed"] == "OSError: tmpfs full"
    stager.wait()  # off: no wait at all
    assert stager.saver.waits == 1
