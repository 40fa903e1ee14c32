"""Elastic runs: a worker SIGKILLed mid-run is restarted by the agent and the job completes from
the staged copy of its last completed step, each step logged once; a corrupted staged copy is
refused (reason logged) and the durable checkpoint used; a kill during staging leaves the
previous staged step valid. Plus the pure checks of a staged copy."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace

import pytest

from nereus.launch import own_result, parse_nnodes, rendezvous_timeout
from nereus.trainer.config import ConfigError
from nereus.trainer.prepare import load_config
from nereus.trainer.elastic.staging import plan_digest
from nereus.trainer.elastic.restore import check_staged, choose_sources
from tests.distributed_harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_GRPO = os.path.join(ROOT, "configs", "tiny_grpo.yaml")
SMALL = ["rollout.prompts_per_step=8", "grpo.minibatch_size=32", "logging.trackers=[]"]
TWO = ["nproc=2", "plan.actor.train.dp=2", "plan.actor.gen.dp=1", "plan.actor.gen.tp=2", "plan.ref.infer.dp=1", "plan.ref.infer.tp=2"]
ONE = ["nproc=1", "plan.actor.train.dp=1", "plan.actor.train.dp_shard=false", "plan.actor.gen.dp=1", "plan.actor.gen.tp=1",
       "plan.ref.infer.dp=1", "plan.ref.infer.tp=1"]
KEYS = ("actor/loss", "reward_mean", "kl", "actor/grad_norm", "response_length")


@pytest.fixture
def shm_dir():
    """A staging dir of this test's own under /dev/shm, removed afterwards."""
    path = f"/dev/shm/nereus-test-{uuid.uuid4().hex[:10]}"
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def read_metrics(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    return out


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie its parent has yet to reap)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def retire_newest(root: str, at_least: int) -> None:
    """Delete ``root``'s newest committed checkpoint when its step is >= ``at_least`` (manifest
    first, then data: what retention does to the oldest)."""
    from nereus.store.checkpoint import CheckpointStore
    from nereus.store.records import checkpoint_key

    store = CheckpointStore(root)
    steps = store.steps()
    if steps and steps[-1] >= at_least:
        entry = store.meta.get(checkpoint_key(steps[-1]))
        store.meta.put(entry.key, None, expect=entry.generation)
        store.remove_data(entry.value["data"])


def worker_pids(parent: int) -> list[int]:
    """The agent's worker processes among ``parent``'s children (multiprocessing spawn
    children; not its resource tracker), in start order: local rank order."""
    children = []
    for task in os.listdir(f"/proc/{parent}/task"):
        try:
            children += map(int, open(f"/proc/{parent}/task/{task}/children").read().split())
        except OSError:
            pass
    workers = []
    for pid in sorted(set(children)):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            workers.append(pid)
    return workers


# ------------------------------------------------------------------ multi-process


@pytest.mark.timeout(240)
def test_a_killed_worker_is_restarted_from_the_staged_step_and_each_step_is_logged_once(tmp_path, shm_dir):
    run_dir = tmp_path / "run"
    sets = [*SMALL, *TWO, "steps=8", "checkpoint_every=100", f"elastic.staging_dir={shm_dir}", "elastic.collective_timeout_s=60"]
    cmd = [sys.executable, "-c", "from nereus.cli.app import main; main()", "train", TINY_GRPO, "--run-dir", str(run_dir),
           "--max-restarts", "2", *[a for s in sets for a in ("--set", s)]]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    dead, killed_at = [], None
    try:
        deadline = time.monotonic() + 180
        while job.poll() is None and time.monotonic() < deadline:
            lines = read_metrics(run_dir)
            staged = lines[-1].get("staging", {}) if lines else {}
            if staged.get("write_s") is not None and staged["step"] >= 4:  # step 4 or later is committed in /dev/shm
                killed_at = lines[-1]["step"]
                assert killed_at <= 6, f"watched too late: step {killed_at} of 8"  # two steps or more still to run
                pids = worker_pids(job.pid)
                assert len(pids) == 2, f"workers of the job: {pids}"
                os.kill(pids[-1], signal.SIGKILL)  # one worker, not the one that writes the metrics
                while any(alive(p) for p in pids) and time.monotonic() < deadline:  # the agent stops the other one
                    time.sleep(0.005)
                dead = read_metrics(run_dir)  # the dead attempt's records, before the restarted one cuts them
                retire_newest(shm_dir, dead[-1]["step"])  # the restore then re-runs at least one step the dead attempt logged
                break
            time.sleep(0.02)
        out, _ = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # the agent and its workers
    assert killed_at is not None, f"the job ended before the kill:\n{out}"
    assert dead[-1]["step"] < 8, "the kill landed before the job finished"
    assert job.returncode == 0, out
    ours = read_metrics(run_dir)
    assert [r["step"] for r in ours] == list(range(1, 9)), "each step exactly once"
    restores = [json.loads(line) for line in (run_dir / "restores.jsonl").read_text().splitlines()]
    assert len(restores) == 1 and restores[0]["attempt"] == 1 and restores[0]["source"] == "staged", restores
    assert restores[0]["round"] == 2  # the agent store's round counter: the launch's second start
    restored = restores[0]["step"]
    assert 4 <= restored < dead[-1]["step"], (restored, [r["step"] for r in dead])
    assert f"restored step {restored} from the staged copy" in out
    again = {r["step"]: r for r in ours}
    rerun = [before for before in dead if before["step"] > restored]
    assert rerun  # the steps the dead attempt ran past the restored one ran again, the same to the bit
    for before in rerun:
        for k in KEYS:
            assert again[before["step"]][k] == before[k], f"step {before['step']} {k}: {again[before['step']][k]} vs {before[k]}"
    staged = [r for r in ours if r["step"] not in (1, restored + 1)]  # each attempt's first step follows no staging
    assert all(r["staging"]["step"] == r["step"] - 1 and r["staging"]["copy_s"] < r["step_seconds"] for r in staged)
    assert not os.path.exists(shm_dir)  # the finished run gave the node's memory back


def _launcher(run_dir, endpoint: str, steps: int, staging_dir: str, log, via: str, *, nnodes: str = "1:2",
              sets: tuple = (*ONE, "checkpoint_every=1")) -> subprocess.Popen:
    """One node's launch of `nereus train` on ``--nnodes`` — its own launcher (``via``
    "nereus") or torchrun with the ``nereus`` rendezvous backend ("torchrun") — one worker,
    its own session, its output to the file ``log`` (a pipe nobody reads could fill and
    stall it). ``staging_dir``: the node's own (two nodes never share a /dev/shm)."""
    sets = [*SMALL, *sets, f"steps={steps}", "elastic.collective_timeout_s=30", "elastic.last_call_s=2"]
    train = ["train", TINY_GRPO, "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    if via == "nereus":
        cmd = [sys.executable, "-c", "from nereus.cli.app import main; main()", *train, "--nnodes", nnodes, "--max-restarts", "3",
               "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3",
               "--rdzv-backend", "nereus", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
               "--rdzv-conf", "last_call_timeout=2", "--monitor-interval", "0.1", "-m", "nereus.cli.app", *train]
    env = {**os.environ, "NEREUS_STAGING_DIR": staging_dir}  # the job's config is rank 0's: a node's own path is in its env
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts each worker in a session of its own)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = list(map(int, open(f"/proc/{parent}/task/{task}/children").read().split()))
            except OSError:
                continue
            out += children
            todo += children
    return out


def kill_node(job: subprocess.Popen) -> None:
    """SIGKILL a node: its launcher, its session and every process below it."""
    below = descendants(job.pid)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone already
    job.wait(timeout=30)


def _wait_for(run_dir, ok, deadline: float, what: str) -> list[dict]:
    while time.monotonic() < deadline:
        lines = read_metrics(run_dir)
        if ok(lines):
            return lines
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; metrics: {[(r['step'], len(r['peak_memory_bytes'])) for r in read_metrics(run_dir)]}")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("via", ["nereus", "torchrun"])
def test_a_node_that_joins_and_a_node_that_leaves_resize_the_job_and_lose_no_committed_step(tmp_path, shm_dir, via):
    """Two launches on this machine stand for two nodes (their run dir for a shared
    filesystem, their staging dirs for each node's /dev/shm), one process each, under
    `nereus train --nnodes 1:2` or under `torchrun --rdzv-backend nereus` (torch's own c10d
    backend never hands the joining node the workers' store). Node A starts alone; node B
    joins once step 2 is logged: A's agent restarts its workers, the job re-plans for 2 ranks
    and restores the newest durable step (A's staged copy is of a world of 1). Once two steps
    ran on both, B dies (SIGKILL of its launcher and worker): A's worker fails its
    collectives, the job re-plans for 1 rank, restores and finishes. Each step is logged once."""
    from nereus.store.checkpoint import CheckpointStore
    from tests.distributed_harness import free_port

    run_dir, endpoint, steps = tmp_path / "run", f"127.0.0.1:{free_port()}", 40
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("a", "b")}
    a = _launcher(run_dir, endpoint, steps, f"{shm_dir}/a", logs["a"], via)
    b = None
    try:
        deadline = time.monotonic() + 240
        _wait_for(run_dir, lambda rows: len(rows) >= 2, deadline, "step 2 on node A")
        b = _launcher(run_dir, endpoint, steps, f"{shm_dir}/b", logs["b"], via)
        both = _wait_for(run_dir, lambda rows: sum(len(r["peak_memory_bytes"]) == 2 for r in rows) >= 2, deadline, "2 steps on 2 nodes")
        assert both[-1]["step"] < steps - 4, "the job ran too fast to leave steps for after the leave"
        kill_node(b)
        a.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for job in (a, b):
            if job is not None:
                kill_node(job)
        for log in logs.values():
            log.close()
    out = (tmp_path / "a.log").read_text(errors="replace")
    assert a.returncode == 0, out[-6000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "each step exactly once"
    worlds = [len(r["peak_memory_bytes"]) for r in rows]
    changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert changes == [1, 2, 1], worlds  # alone, with B, alone again
    restores = [json.loads(line) for line in (run_dir / "restores.jsonl").read_text().splitlines()]
    assert [(r["world"], r["source"]) for r in restores] == [(2, "durable"), (1, "durable")], restores
    assert [r["rdzv_round"] for r in restores] == [1, 2] and [r["round"] for r in restores] == [2, 3], restores  # restarts
    assert [r["plan"] for r in restores] == ["planned for 2 ranks by the controller", "the launch's plan"]
    joined, left = (worlds.index(2) + 1, len(worlds) - worlds[::-1].index(2))  # the first and the last step on 2 ranks
    assert (restores[0]["step"], restores[1]["step"]) == (joined - 1, left)  # each world went on from the last committed step
    assert CheckpointStore(str(run_dir / "checkpoints")).steps()[-1] == steps


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_on_two_nodes_a_killed_worker_is_restarted_from_the_step_both_nodes_staged(tmp_path, shm_dir):
    """Two `nereus train --nnodes 2:2` launchers, one process each, each node staging its
    part in its own dir. Node B's worker is SIGKILLed once a staged step >= 4 is committed:
    both agents restart their workers, which restore the newest step both nodes hold from
    their own nodes' copies, and finish; each step once, and both nodes' copies are given
    back at the end."""
    from tests.distributed_harness import free_port

    run_dir, endpoint, steps = tmp_path / "run", f"127.0.0.1:{free_port()}", 10
    sets = (*ONE, "checkpoint_every=100")
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("a", "b")}
    nodes = {name: _launcher(run_dir, endpoint, steps, f"{shm_dir}/{name}", logs[name], "nereus", nnodes="2:2", sets=sets)
             for name in ("a", "b")}
    killed_at = None
    try:
        deadline = time.monotonic() + 240
        while killed_at is None and time.monotonic() < deadline and all(n.poll() is None for n in nodes.values()):
            lines = read_metrics(run_dir)
            staged = lines[-1].get("staging", {}) if lines else {}
            if staged.get("write_s") is not None and staged["step"] >= 4:
                killed_at = lines[-1]["step"]
                pids = worker_pids(nodes["b"].pid)
                assert len(pids) == 1, f"node b's workers: {pids}"
                os.kill(pids[0], signal.SIGKILL)
            time.sleep(0.02)
        for name in ("a", "b"):
            nodes[name].wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for job in nodes.values():
            kill_node(job)
        for log in logs.values():
            log.close()
    out = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in ("a", "b")}
    assert killed_at is not None and killed_at < steps, f"the job ended before the kill:\n{out['a'][-4000:]}"
    assert [nodes[n].returncode for n in ("a", "b")] == [0, 0], out["a"][-4000:] + out["b"][-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "each step exactly once"
    assert all(len(r["peak_memory_bytes"]) == 2 for r in rows)
    restores = [json.loads(line) for line in (run_dir / "restores.jsonl").read_text().splitlines()]
    assert len(restores) == 1 and restores[0]["source"] == "staged" and restores[0]["world"] == 2, restores
    assert 3 <= restores[0]["step"] <= killed_at, (restores, killed_at)  # a step both nodes held; step 3's at the latest
    assert not os.path.exists(f"{shm_dir}/a") and not os.path.exists(f"{shm_dir}/b")


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
    states[2] = {k: v.clone() for k, v in trainer.stages["actor.train"].buffers().items()}
    lrs[2] = trainer.stages["actor.train"].optimizer.param_groups[0]["lr"]
    out = []
    for corrupt in (False, True):
        if corrupt:
            data = os.path.join(shm_dir, "data")
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
        out.append((step, record, same, [s.kind for s in sources], os.path.isdir(shm_dir), (fresh.step, lr == lrs[step])))
    out.append(_capacity_and_a_failed_write(cfg, rank, fresh, shm_dir))
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
    data = os.path.join(shm_dir, "data")
    left = os.listdir(data) if os.path.isdir(data) else []
    return tiny.enabled, tiny.refused, full.figures().get("failed"), left, CheckpointStore(shm_dir).steps()


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
    mine = shm_dir if shared else f"{shm_dir}/{rank}"
    cfg = load_config(TINY_GRPO, [*SMALL, *TWO, "plan.actor.train.dp_shard=true", f"run_dir={run_dir}",
                                  f"elastic.staging_dir={mine}"])
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
    staged, durable, capacity = run_distributed(_train_and_stage, 1, str(tmp_path / "run"), shm_dir, timeout=110)[0]
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
    store = CheckpointStore(shm_dir)
    assert store.steps() == [1]
    written = sorted(os.listdir(os.path.join(shm_dir, "data")))
    assert len(written) == 2 and written[1].startswith("000000000002-")  # step 2's boxes, named by no manifest
    store.verify(store.manifest(1))  # every block of step 1 against its checksums
    view = local_view(shm_dir, str(tmp_path / "run" / "checkpoints"))
    assert view["staged"]["step"] == 1 and check_staged(view["staged"], durable_step=None, run_dir=str(tmp_path / "run")) is None


def _actor_state(trainer, rank):
    """actor.train's every parameter and AdamW tensor, gathered whole on rank 0 (raw bytes)."""
    from nereus.reshard.gather import gather_full
    from tests.trainer.test_resume import raw_bytes

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
    staged = CheckpointStore(shm_dir)
    assert staged.steps() == [1]
    staged.verify(staged.manifest(1))
    step, record, state = run_distributed(_restore_and_gather, 2, str(run_dir),
                                          [*SMALL, *TWO, f"elastic.staging_dir={shm_dir}"], timeout=150)[0]
    assert step == 1 and record["source"] == "staged"
    assert _same(state, pickle.loads((run_dir / "before.pkl").read_bytes()))  # every element, as before the transition began
    cfg = load_config(TINY_GRPO, [*SMALL, *TWO, f"run_dir={run_dir}"])
    restarted, how = plan_for_start(cfg, staged.manifest(1).plan, 2)
    assert restarted.plan == cfg.plan and how == "the restored state's plan"  # the old plan: the move never committed


# ------------------------------------------------------------------ pure checks


def _view(step=5, run="/r", plan=None, layouts=None, lineage="L1", record=None, node=None):
    plan = plan if plan is not None else {"actor": {"train": {"dp": 2, "tp": 1, "pp": 1}}}
    return {"step": step, "data": f"data/{step}", "plan": plan, "staged": {"run": run, "lineage": lineage},
            "plan_record": record if record is not None else {"version": 1, "since": 3, "digest": plan_digest(plan)},
            "layouts": layouts if layouts is not None else [["actor.train", [2, 1, 1], [2, 1, 1]]],
            "node": node if node is not None else {"ranks": [0, 1], "world": 2}}


def _durable(lineage="L1", version=1, since=3, plan=None):
    plan = plan if plan is not None else {"actor": {"train": {"dp": 2, "tp": 1, "pp": 1}}}
    return {"lineage": lineage, "plan_record": {"version": version, "since": since, "digest": plan_digest(plan)}}


def test_check_staged_names_why_a_copy_is_refused():
    assert check_staged(_view(), durable_step=4, run_dir="/r", durable_state=_durable()) is None
    assert check_staged(_view(), durable_step=5, run_dir="/r") is None  # as new as the durable: the faster source
    assert check_staged(None, durable_step=4, run_dir="/r") == "no staged copy"
    assert "older than the durable checkpoint's 6" in check_staged(_view(), durable_step=6, run_dir="/r")
    assert "belongs to run '/other'" in check_staged(_view(run="/other"), durable_step=4, run_dir="/r")
    bad = _view()
    bad["plan_record"]["digest"] = "0" * 16
    assert "plan record does not match the plan its manifest names" in check_staged(bad, durable_step=None, run_dir="/r")
    moved = _view(layouts=[["actor.train", [1, 2, 1], [2, 1, 1]]])
    assert "actor.train's data is in dp·tp·pp [1, 2, 1], but its plan record says [2, 1, 1]" in check_staged(moved, durable_step=None, run_dir="/r")
    assert "cannot be read" in check_staged({"error": "its manifest cannot be read (x)"}, durable_step=None, run_dir="/r")


def test_a_staged_copy_of_another_launch_or_plan_history_is_refused():
    # a restart trusts only its launch's lineage; a launch's first start, the durable checkpoint's
    assert check_staged(_view(), durable_step=4, run_dir="/r", lineage="L1") is None
    assert "staged by another launch (lineage 'L0', this launch's is 'L1')" in check_staged(
        _view(lineage="L0"), durable_step=None, run_dir="/r", lineage="L1")
    assert "the durable checkpoint's is 'L2'" in check_staged(_view(), durable_step=4, run_dir="/r", durable_state=_durable("L2"))
    # the plan record against the durable checkpoint's: a real version, not the manifest's own plan again
    assert "plan version 1 is older than the durable checkpoint's 2" in check_staged(
        _view(), durable_step=4, run_dir="/r", durable_state=_durable(version=2, since=4))
    other = {"actor": {"train": {"dp": 1, "tp": 2, "pp": 1}}}
    assert "names another plan than the durable checkpoint's" in check_staged(
        _view(), durable_step=4, run_dir="/r", durable_state=_durable(plan=other))
    later = _view(record={"version": 2, "since": 4, "digest": plan_digest(_view()["plan"])})
    assert check_staged(later, durable_step=3, run_dir="/r", durable_state=_durable()) is None  # moved after the durable step
    assert "dates from step 4, but the durable checkpoint of step 4 still has version 1" in check_staged(
        later, durable_step=4, run_dir="/r", durable_state=_durable())


def test_the_plan_record_counts_plan_changes():
    from nereus.trainer.elastic.staging import advance_plan_record

    a, b = {"actor": {"train": {"dp": 2}}}, {"actor": {"train": {"dp": 1, "tp": 2}}}
    first = advance_plan_record(None, a, 0)
    assert first == {"version": 0, "since": 0, "digest": plan_digest(a)}
    assert advance_plan_record(first, a, 5) == first
    assert advance_plan_record(first, b, 5) == {"version": 1, "since": 5, "digest": plan_digest(b)}


def test_choose_sources_orders_staged_first_and_needs_every_rank_to_see_it():
    views = [{"staged": _view(), "durable": 4, "durable_plan": {"p": 1}, "durable_state": _durable()}] * 2
    sources, reasons = choose_sources(views, run_dir="/r", staged_root="/dev/shm/x", durable_root="/r/checkpoints")
    assert [(s.kind, s.step) for s in sources] == [("staged", 5), ("durable", 4)] and reasons == []
    other = [views[0], {"staged": None, "durable": 4, "durable_plan": None, "durable_state": _durable()}]
    sources, reasons = choose_sources(other, run_dir="/r", staged_root="/dev/shm/x", durable_root="/r/checkpoints")
    assert [s.kind for s in sources] == ["durable"] and "rank 1 sees none on its node (a new machine" in reasons[0]
    stale = [{"staged": _view(step=3, node={"ranks": [0], "world": 1}), "durable": 4, "durable_plan": None}]
    sources, reasons = choose_sources(stale, run_dir="/r", staged_root="/dev/shm/x", durable_root="/r/checkpoints")
    assert [s.kind for s in sources] == ["durable"] and "staged copy of step 3 refused: its step 3 is older" in reasons[0]
    nothing = [{"staged": None, "durable": None, "durable_plan": None}]
    assert choose_sources(nothing, run_dir="/r", staged_root="/x", durable_root="/y") == ([], [])


def _node_view(rank_steps, node, world=2, **kw):
    """One rank's view of its node's staged copies: the newest first, then the older ones."""
    staged = [_view(step=s, node={"ranks": node, "world": world}, **kw) for s in sorted(rank_steps, reverse=True)]
    return {"staged": staged[0] if staged else None, "staged_older": staged[1:], "durable": 4, "durable_plan": None,
            "durable_state": _durable()}


def test_on_several_nodes_the_newest_step_every_node_holds_on_every_rank_s_own_node_is_restored():
    def choose(views):
        sources, reasons = choose_sources(views, run_dir="/r", staged_root="/dev/shm/x", durable_root="/r/checkpoints")
        return [(s.kind, s.step) for s in sources], reasons

    # two nodes, one rank each: each node's part of step 5, different data dirs on each
    assert choose([_node_view([5], [0]), _node_view([5], [1])]) == ([("staged", 5), ("durable", 4)], [])
    # node 0 committed step 6 before node 1 died staging it: the step both hold
    assert choose([_node_view([5, 6], [0]), _node_view([5], [1])]) == ([("staged", 5), ("durable", 4)], [])
    got, reasons = choose([_node_view([6], [0]), _node_view([5], [1])])  # staging_keep=1: nothing in common
    assert got == [("durable", 4)] and "no staged step in common (rank 0: [6], rank 1: [5])" in reasons[0]
    # the ranks moved between nodes: rank 0 finds node 1's part on its node
    got, reasons = choose([_node_view([5], [1]), _node_view([5], [0])])
    assert got == [("durable", 4)] and "rank 0's node staged it for ranks [1] of a world of 2, not for rank 0 of 2" in reasons[0]
    got, reasons = choose([_node_view([5], [0], world=4), _node_view([5], [1], world=4)])  # the world shrank
    assert got == [("durable", 4)] and "a world of 4, not for rank 0 of 2" in reasons[0]
    other = {"actor": {"train": {"dp": 1, "tp": 2, "pp": 1}}}
    got, reasons = choose([_node_view([5], [0]), _node_view([5], [1], plan=other, layouts=[["actor.train", [1, 2, 1], [1, 2, 1]]])])
    assert got == [("durable", 4)] and "rank 1's node holds another copy of it than rank 0's" in reasons[0]
    # the newest common step refused (another plan on one node), the one before it restored
    mixed = _node_view([5, 6], [1])
    mixed["staged"] = _view(step=6, node={"ranks": [1], "world": 2}, lineage="L2")
    got, reasons = choose([_node_view([5, 6], [0]), mixed])
    assert got == [("staged", 5), ("durable", 4)] and "staged step 6 refused: rank 1's node holds another copy" in reasons[0]
    unreadable = _node_view([5], [1])
    unreadable["staged"] = {"error": "its manifest cannot be read (x)"}
    got, reasons = choose([_node_view([5], [0]), unreadable])
    assert got == [("durable", 4)] and reasons == ["staged copy refused on rank 1: its manifest cannot be read (x)"]


def test_a_node_s_own_staging_dir_comes_from_its_environment(monkeypatch):
    from nereus.trainer.elastic.staging import STAGING_ENV, staging_root

    cfg = load_config(TINY_GRPO, ["elastic.staging_dir=/dev/shm/from-config"])
    monkeypatch.delenv(STAGING_ENV, raising=False)
    assert staging_root(cfg) == "/dev/shm/from-config"
    monkeypatch.setenv(STAGING_ENV, "/dev/shm/node-b")
    assert staging_root(cfg) == "/dev/shm/node-b"  # the config is rank 0's on every node; the node's own path wins
    for bad in ("shm/x", "s3://bucket/x"):
        monkeypatch.setenv(STAGING_ENV, bad)
        with pytest.raises(ConfigError, match=f"environment variable {STAGING_ENV} must be a local absolute path"):
            staging_root(cfg)


def test_nodes_are_told_apart_and_a_staging_dir_two_nodes_share_is_refused():
    from nereus.trainer.elastic.staging import group_nodes, shared_dir

    assert group_nodes(["node 1", "node 0", "node 1", "node 0"]) == [[0, 2], [1, 3]]
    nodes = [[0, 1], [2, 3]]
    own = [("h0", 1, 7), ("h0", 1, 7), ("h1", 1, 7), ("h1", 1, 7)]  # the same path on two machines
    assert shared_dir(nodes, own) is None
    one = [("h0", 1, 7)] * 4  # two launches on one machine, one /dev/shm dir
    assert "ranks 0 and 2 are on different nodes but their staging dirs are one directory" in shared_dir(nodes, one)
    assert shared_dir([[0, 1, 2, 3]], one) is None  # one node: its ranks share its dir


def test_an_unreadable_durable_manifest_is_refused_on_every_rank_not_fatal(tmp_path, monkeypatch):
    from nereus.store.checkpoint import CheckpointStore
    from nereus.trainer.elastic.restore import DURABLE_REFUSED, local_view

    durable = tmp_path / "checkpoints"
    (durable / "meta").mkdir(parents=True)

    def broken(self):
        raise OSError("Input/output error")

    monkeypatch.setattr(CheckpointStore, "steps", broken)
    view = local_view(str(tmp_path / "no-staging"), str(durable))
    assert view["durable"] is None and "cannot be read (OSError: Input/output error)" in view["durable_error"]
    fine = {"staged": _view(), "durable": 4, "durable_plan": None, "durable_state": _durable()}
    sources, reasons = choose_sources([fine, {**view, "staged": _view()}], run_dir="/r", staged_root="/x", durable_root=str(durable))
    assert sources == [] and reasons[0].startswith(f"{DURABLE_REFUSED} on rank 1: its manifest cannot be read")


def test_elastic_config_and_flags_are_checked():
    with pytest.raises(ConfigError, match="'elastic.staging' must be one of 'auto', 'always', 'never'"):
        load_config(TINY_GRPO, ["elastic.staging=sometimes"])
    for bad in ("0", "true"):
        with pytest.raises(ConfigError, match="'elastic.staging_keep'"):
            load_config(TINY_GRPO, [f"elastic.staging_keep={bad}"])
    for bad in ("-1", "5", ".inf", ".nan"):
        with pytest.raises(ConfigError, match="'elastic.collective_timeout_s' must be a finite number of seconds >= 30"):
            load_config(TINY_GRPO, [f"elastic.collective_timeout_s={bad}"])
    assert load_config(TINY_GRPO, ["elastic.collective_timeout_s=30"]).elastic.collective_timeout_s == 30
    with pytest.raises(ConfigError, match="'elastic.staging_dir' must be an absolute path"):
        load_config(TINY_GRPO, ["elastic.staging_dir=shm/x"])
    with pytest.raises(ConfigError, match="'elastic.staging_dir' must be a local path .* not a URL"):
        load_config(TINY_GRPO, ["elastic.staging_dir=s3://bucket/stage"])
    with pytest.raises(ConfigError, match="did you mean 'elastic.staging_dir'"):
        load_config(TINY_GRPO, ["elastic.staging_dirr=/x"])
    for bad in ("0", "-3"):  # torch refuses a last_call_timeout of 0 only at launch, unnamed
        with pytest.raises(ConfigError, match="'elastic.last_call_s' must be an integer number of seconds >= 1"):
            load_config(TINY_GRPO, [f"elastic.last_call_s={bad}"])
    for bad in ("1.5", "true"):
        with pytest.raises(ConfigError, match="'elastic.last_call_s' expects int"):
            load_config(TINY_GRPO, [f"elastic.last_call_s={bad}"])
    assert parse_nnodes("1:3") == (1, 3) and parse_nnodes("2") == (2, 2)
    for bad in ("0:2", "3:1", "a:b"):
        with pytest.raises(ValueError, match=f"--nnodes '{bad}'"):
            parse_nnodes(bad)
    assert rendezvous_timeout(30) > 30 and rendezvous_timeout(500) > 500  # the agent waits longer than any collective
    assert own_result({2: {"step": 8, "node": "b"}, 3: {"step": 8}}) == {"step": 8, "node": "b"}  # this node's ranks, not 0


def test_staging_mode_and_capacity_are_checked(monkeypatch):
    from nereus.trainer.elastic.staging import capacity_refusal, staging_mode

    assert staging_mode(load_config(TINY_GRPO, ["elastic.staging=always"])) is True
    assert staging_mode(load_config(TINY_GRPO, ["elastic.staging=never"])) is False
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert staging_mode(load_config(TINY_GRPO, ["elastic.staging=auto"])) is False
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert staging_mode(load_config(TINY_GRPO, ["elastic.staging=auto"])) is True
    mib = 1 << 20
    assert capacity_refusal(10 * mib, 2, 30 * mib, 0) is None
    assert capacity_refusal(10 * mib, 2, 10 * mib, 20 * mib) is None  # this run's earlier copies rotate out
    assert "3 copies of the state (10.0 MiB each" in capacity_refusal(10 * mib, 2, 29 * mib, 0)


def test_a_restart_is_told_from_a_fresh_start_by_the_launchs_store():
    """Every rank of a round agrees on its number over the agent's store, whatever an earlier
    round left there (a membership change keeps TORCHELASTIC_RESTART_COUNT); a new launch (a
    new store, even under a reused rendezvous id) starts at round 1."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from nereus.trainer.elastic.lineage import ROUND_KEY, decide_restart, join_round

    def round_of(store_port, world, stale=None):
        got, errors = {}, []

        def one(rank):
            try:
                client = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=timedelta(seconds=20))
                got[rank] = join_round(client, rank, world, 20)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(r,)) for r in reversed(range(world))]  # the others before rank 0
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        return got

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
    assert set(round_of(server.port, 2).values()) == {1}  # the launch's first start
    server.set(f"{ROUND_KEY}/hello/1", "a-dead-round's-token")  # left behind by a killed rank 1
    assert set(round_of(server.port, 3).values()) == {2}  # a node joined: the same restart count, the next round
    again = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
    assert set(round_of(again.port, 2).values()) == {1}  # a new launch: fresh, whatever its rendezvous id
    assert not decide_restart(0, 1) and decide_restart(0, 2) and decide_restart(1, 2) and not decide_restart(0, None)
    assert decide_restart(1, None)  # without an agent store: the restart count alone
    # a joined node sorting first hosts a new workers' store (its count starts over): the agent's rendezvous round still tells
    assert decide_restart(0, 1, 1) and not decide_restart(0, 1, 0) and not decide_restart(0, None, None)


def test_the_agents_rendezvous_round_counts_only_under_its_own_launch(monkeypatch):
    from nereus.launch import RDZV_ROUND_ENV
    from nereus.trainer.elastic.lineage import rdzv_round

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    for value, want in (("job-a:3", 3), ("job-a:0", 0), ("job-b:3", None), ("3", None), ("job-a:x", None)):
        monkeypatch.setenv(RDZV_ROUND_ENV, value)
        assert rdzv_round() == want, value  # a value another launch left in the environment is not this one's round
    monkeypatch.delenv(RDZV_ROUND_ENV)
    assert rdzv_round() is None


@pytest.mark.timeout(120)
def test_every_rendezvous_round_names_the_store_of_its_own_rank_0():
    """Two agents' rendezvous handlers in one process (torch's c10d backend on loopback, the
    wrapper of nereus.launch): A alone; B, which sorts first, joins (B is rank 0: both use
    B's store); B dies; A alone again uses its own store, not B's dead one. Without the
    wrapper torch hands the joining node no address at all, and A would keep B's."""
    import threading

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from nereus.launch import RDZV_ROUND_ENV, publish_store_every_round
    from tests.distributed_harness import free_port

    publish_store_every_round()
    endpoint = f"127.0.0.1:{free_port()}"

    def handler():
        return get_rendezvous_handler(RendezvousParameters(backend="c10d", endpoint=endpoint, run_id="rank0", min_nodes=1,
                                                           max_nodes=2, join_timeout=60, last_call_timeout=1,
                                                           keep_alive_interval=1, keep_alive_max_attempt=3))

    b, a = handler(), handler()  # b first: the lower pid-free descriptor sorts first
    assert sorted([a._this_node, b._this_node])[0] == b._this_node
    got = {}

    def meet(name, h):
        info = h.next_rendezvous()
        got[name] = (info.rank, info.world_size, info.bootstrap_store_info.master_port)

    try:
        meet("a alone", a)
        joined = threading.Thread(target=meet, args=("b joins", b))
        joined.start()
        deadline = time.monotonic() + 30
        while a.num_nodes_waiting() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        meet("a with b", a)
        joined.join(30)
        assert got["a alone"] == (0, 1, a._shared_tcp_store_server.port)
        assert got["b joins"] == (0, 2, b._shared_tcp_store_server.port) and got["a with b"] == (1, 2, b._shared_tcp_store_server.port)
        b._stop_heartbeats()  # b dies
        b._shared_tcp_store_server = None
        meet("a alone again", a)
        assert got["a alone again"] == (0, 1, a._shared_tcp_store_server.port)
        assert os.environ[RDZV_ROUND_ENV] == "rank0:2"
    finally:
        os.environ.pop(RDZV_ROUND_ENV, None)
        for h in (a, b):
            h._stop_heartbeats()


def test_a_start_plans_for_the_world_there_is():
    from nereus.trainer.config import config_to_dict
    from nereus.trainer.elastic.resume import plan_for_start, runs_on

    cfg = load_config(TINY_GRPO, [*SMALL, *TWO])
    same, how = plan_for_start(cfg, None, 2)
    assert same is cfg and how == "the launch's plan"
    wider, how = plan_for_start(cfg, None, 4)  # nproc 2 per node on 2 nodes: the first start plans for 4 ranks
    assert wider.nproc == 4 and how == "planned for 4 ranks by the controller"
    moved = config_to_dict(load_config(TINY_GRPO, [*SMALL, *TWO, "plan.actor.gen.dp=2", "plan.actor.gen.tp=1"]).plan)
    got, how = plan_for_start(cfg, moved, 2)  # a restart (also under --resume) takes the restored state's plan
    assert (got.plan.actor.gen.dp, got.plan.actor.gen.tp) == (2, 1) and how == "the restored state's plan"
    # a node joined: the restored plan (the launch's too) holds 2 of the 4 ranks there are now
    grown, how = plan_for_start(cfg, config_to_dict(cfg.plan), 4)
    assert grown.nproc == 4 and runs_on(grown.plan, 4) and how == "planned for 4 ranks by the controller"


def test_a_restarted_worker_takes_the_restored_plan_where_it_runs():
    from nereus.trainer.config import config_to_dict
    from nereus.trainer.elastic.resume import plan_for_world

    cfg = load_config(TINY_GRPO, [*SMALL, *TWO])
    same, how = plan_for_world(cfg, config_to_dict(cfg.plan), 2)
    assert same is cfg and how == "the restored state's plan"
    moved = config_to_dict(load_config(TINY_GRPO, [*SMALL, *TWO, "plan.actor.gen.dp=2", "plan.actor.gen.tp=1"]).plan)
    got, how = plan_for_world(cfg, moved, 2)  # a controller moved actor.gen before the worker died
    assert (got.plan.actor.gen.dp, got.plan.actor.gen.tp) == (2, 1) and how == "the restored state's plan"
    shrunk, how = plan_for_world(cfg, moved, 1)  # a node left: neither plan runs on 1 rank
    assert shrunk.nproc == 1 and how == "planned for 1 ranks by the controller"
    assert all(len(sc.ranks or range(1)) == 1 and sc.dp * sc.tp * sc.pp == 1 for sc in shrunk.plan.stages().values())


def test_the_trackers_are_flushed_before_a_state_commits(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nereus.trainer.metrics.trackers import TensorBoard, flush_trackers

    tb = TensorBoard.open(str(tmp_path), 0)
    tb.log(1, {"reward_mean": 0.5}, {})
    flush_trackers([tb, object()])  # a tracker without flush is skipped
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1]  # on disk before close: a SIGKILL now loses nothing
    tb.close()


def test_bad_launch_flags_are_one_line_errors_before_the_run_dir_changes(tmp_path):
    from typer.testing import CliRunner

    from nereus.cli.app import app

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "keep").write_text("x")
    for flags, message in ((["--nnodes", "1:2"], "several nodes need --rdzv-endpoint HOST:PORT"),
                           (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1"], "several nodes need --rdzv-id ID"),
                           (["--nnodes", "2:1"], "--nnodes '2:1': needs 1 <= MIN <= MAX"),
                           (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1")):
        result = CliRunner().invoke(app, ["train", TINY_GRPO, "--run-dir", str(run_dir), "--overwrite", *flags])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
        assert (run_dir / "checkpoints" / "keep").exists()  # --overwrite deleted nothing


def test_only_a_fresh_start_s_rank_0_checks_the_run_dir_on_several_nodes_or_under_torchrun(tmp_path, monkeypatch):
    """A node's launcher (one joining later too) and a torchrun worker (restarted too) leave the
    run dir to the workers: they pass --overwrite on, and delete nothing themselves."""
    from typer.testing import CliRunner

    from nereus.cli import train as cli_train
    from nereus.cli.app import app
    from nereus.store.checkpoint import CheckpointStore
    from nereus.trainer.elastic.restore import fresh_run_dir

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "keep").write_text("x")  # the launcher's --overwrite would delete this
    calls = []
    monkeypatch.setattr(cli_train, "run_job", lambda cfg, resume, **kw: calls.append(kw))
    flags = ["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "job-1", "--overwrite"]
    result = CliRunner().invoke(app, ["train", TINY_GRPO, "--run-dir", str(run_dir), *flags, *[a for s in SMALL for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    assert calls[-1]["overwrite"] is True and calls[-1]["rdzv_id"] == "job-1" and (run_dir / "checkpoints" / "keep").exists()
    for key, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("TORCHELASTIC_RUN_ID", "none")):
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(app, ["train", TINY_GRPO, "--run-dir", str(run_dir), "--overwrite", *[a for s in SMALL for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    assert calls[-1]["overwrite"] is True and (run_dir / "checkpoints" / "keep").exists()
    monkeypatch.setattr(CheckpointStore, "steps", lambda self: [1])
    assert "holds checkpoints of an earlier run (steps [1])" in fresh_run_dir(str(run_dir), False)  # rank 0's own check
    assert fresh_run_dir(str(run_dir), True) is None and not (run_dir / "checkpoints").exists()
