"""Restarts: a worker or a node SIGKILLed mid-run is restarted by the agent (on one node, on two,
under `nereus train` and under torchrun) and the job completes from the staged copy of its last
completed step, each step logged once and no committed step lost."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest


from tests.trainer.elastic.common import TINY_GRPO, SMALL, TWO, ONE, KEYS, read_metrics, alive, retire_newest, worker_pids, _launcher, kill_node, _wait_for


@pytest.mark.timeout(240)
def test_a_killed_worker_is_restarted_from_the_staged_step_and_each_step_is_logged_once(tmp_path, shm_dir):
    from nereus.trainer.elastic.run_token import staging_id

    run_dir = tmp_path / "run"
    own = lambda: os.path.join(shm_dir, f"nereus-{staging_id(str(run_dir))}")  # noqa: E731 - the run's own dir, once it started
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
                retire_newest(own(), dead[-1]["step"])  # the restore then re-runs at least one step the dead attempt logged
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
    assert not os.path.exists(own()) and os.listdir(shm_dir) == []  # the finished run gave the node's memory back


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
    from nereus.launch import launch_files
    from nereus.trainer.elastic.run_token import run_id

    assert launch_files(run_id(str(run_dir))) == []  # B's semaphores and sentinel went when A's launch ended


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
    from nereus.trainer.elastic.run_token import staging_id

    own = f"nereus-{staging_id(str(run_dir))}"  # each node's copies: the run's own dir in the node's staging base
    assert not os.path.exists(f"{shm_dir}/a/{own}") and not os.path.exists(f"{shm_dir}/b/{own}")
    assert [n for node in ("a", "b") for n in os.listdir(f"{shm_dir}/{node}") if n.startswith("nereus-")] == []  # no dir of any name
