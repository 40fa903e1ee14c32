"""One job per run dir, and nothing of a job's left in /dev/shm: the run dir's lock (a live holder
named, a stale one taken over, a busy one failing the round non-zero on several nodes, torchrun's
default run id never "the same job"), a second `nereus train` refused at once while the first
completes, and the whole /dev/shm listing compared before and after a clean run and a SIGKILLed
run + resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nereus.trainer.elastic.run_lock import (Holder, RunDirBusy, RunLock, busy_message, job_identity, parse_holder, stale_message,
                                            waits_for)
from tests.trainer.elastic.common import ONE, SMALL, TINY_GRPO, read_metrics


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_the_lock_names_its_live_holder_and_takes_a_dead_ones_over(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    holder = Holder(host="h", pid=12, started=0.0, job="J")
    assert parse_holder(json.dumps({"host": "h", "pid": 12, "started": 0.0, "job": "J"})) == holder
    assert parse_holder("") is None and parse_holder("{not json") is None
    assert "is in use by another job (pid 12 on host h, started" in busy_message(run_dir, holder)
    assert stale_message(run_dir, holder, alive=False).endswith("that process is gone")
    assert stale_message(run_dir, holder, alive=None).endswith("its holder no longer holds it")  # another host
    assert "lock passes from this job's previous round" in stale_message(run_dir, holder, alive=False, job="J")  # a restart

    first = RunLock(run_dir).acquire()
    assert first.took_over is None and parse_holder(open(first.path).read()).pid == os.getpid()
    with pytest.raises(RunDirBusy, match=f"in use by another job \\(pid {os.getpid()} on host "):
        RunLock(run_dir).acquire()  # a second open file description: flock excludes it even in one process
    first.release()
    assert not os.path.exists(run_dir)  # released: no record left, and the run dir it made (nothing else in it) went

    os.makedirs(run_dir)
    dead = _dead_pid()
    with open(os.path.join(run_dir, ".lock"), "w") as f:  # a SIGKILLed holder's record; the kernel dropped its flock
        json.dump({"host": os.uname().nodename, "pid": dead, "started": time.time() - 60, "job": None}, f)
    lock = RunLock(run_dir).acquire()
    line = f"nereus: took over the stale lock of run dir {run_dir} (pid {dead} on host"
    assert lock.took_over.startswith(line) and lock.took_over.endswith("that process is gone")
    assert line in capsys.readouterr().err
    assert parse_holder(open(lock.path).read()).pid == os.getpid()
    lock.release()
    assert os.listdir(run_dir) == []  # a run dir that was there stays


def test_only_a_job_with_a_run_id_of_its_own_waits_for_its_previous_round(tmp_path):
    """torchrun's default --rdzv-id is the literal "none": two unrelated jobs launched without
    one share it, so it (and an empty one) is no identity — a holder is then another job, not
    waited for; a run id of the job's own is (pure decision, then the lock itself)."""
    assert job_identity("none") is None and job_identity("NONE ") is None and job_identity("") is None
    assert job_identity(None) is None and job_identity("job-7f3a") == "job-7f3a"
    held = Holder(host="h", pid=12, started=0.0, job="none")
    assert not waits_for(held, "none")  # torchrun's default on both sides: two unrelated jobs
    assert not waits_for(Holder(host="h", pid=12, started=0.0, job=None), None)
    assert not waits_for(Holder(host="h", pid=12, started=0.0, job=""), "")
    assert not waits_for(None, "job-7f3a") and not waits_for(Holder(host="h", pid=12, started=0.0, job="a"), "b")
    assert waits_for(Holder(host="h", pid=12, started=0.0, job="job-7f3a"), "job-7f3a")  # its own previous round
    assert "passes from this job's previous round" not in stale_message("/r", held, alive=False, job="none")

    run_dir = str(tmp_path / "run")
    first = RunLock(run_dir, job="none").acquire()
    assert first.job is None and parse_holder(open(first.path).read()).job is None  # recorded as no job
    t0 = time.monotonic()
    with pytest.raises(RunDirBusy, match="in use by another job"):
        RunLock(run_dir, job="none").acquire(wait_same_job_s=20)  # another job: refused at once, never waited for
    assert time.monotonic() - t0 < 5
    first.release()
    own = RunLock(run_dir, job="job-7f3a").acquire()
    t0 = time.monotonic()
    with pytest.raises(RunDirBusy, match=", job job-7f3a"):
        RunLock(run_dir, job="job-7f3a").acquire(wait_same_job_s=0.5)  # its own job: waited for, then busy
    assert time.monotonic() - t0 >= 0.5
    own.release()


def test_a_busy_run_dir_under_torchrun_exits_non_zero_with_one_line(tmp_path, monkeypatch, capsys):
    """Under torchrun the worker's RunDirBusy (every rank's) is exit 1 — a failed round its
    agent restarts — with one line naming the run dir and the holder, no traceback."""
    import typer

    from nereus import launch
    from nereus.cli.train import run_job
    from nereus.trainer.prepare import load_config
    from nereus.trainer.runtime import worker

    run_dir = str(tmp_path / "run")
    line = busy_message(run_dir, Holder(host="h", pid=12, started=0.0, job="other"))

    def busy(*args, **kwargs):
        raise RunDirBusy(line)

    monkeypatch.setattr(launch, "under_torchrun", lambda: True)
    monkeypatch.setattr(worker, "run_worker", busy)
    with pytest.raises(typer.Exit) as exit_:
        run_job(load_config(TINY_GRPO, [f"run_dir={run_dir}"]), False)
    assert exit_.value.exit_code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {line}"] and run_dir in err[0] and "pid 12 on host h" in err[0]


@pytest.mark.timeout(240)
def test_a_busy_run_dir_on_several_nodes_fails_every_round_non_zero_naming_the_holder(tmp_path):
    """`nereus train --nnodes 1:2` (rank 0's worker takes the lock): another job holds it, so
    every round fails (the workers exit non-zero; the agent restarts them: a lock a lost
    host's NFS client still holds may be free by then), and the launch ends with exit 1 and
    one error line naming the run dir and the holder."""
    from tests.distributed_harness import free_port

    run_dir = tmp_path / "run"
    holder = RunLock(str(run_dir), job="another-job").acquire()
    try:
        args = _train_args(run_dir, 2, "elastic.last_call_s=1")
        done = subprocess.run([sys.executable, "-c", "from nereus.cli.app import main; main()", *args, "--nnodes", "1:2",
                               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "busy-test", "--max-restarts", "1"],
                              capture_output=True, text=True, timeout=200)
    finally:
        holder.release()
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-4000:]
    assert errors[0].startswith("error: workers failed after 1 restart(s): ") and "Traceback" not in errors[0]
    assert f"run dir {run_dir} is in use by another job (pid {os.getpid()} on host" in errors[0]
    assert "job another-job" in errors[0]
    rounds = [line for line in out.splitlines() if "failed (exitcode: 1)" in line]
    assert len(rounds) == 2, out[-4000:]  # the busy round failed (non-zero) and the agent restarted it, once
    assert all(f"run dir {run_dir} is in use by another job" in line for line in rounds)  # the agent's log: one line each
    assert "Traceback" not in out, out[-4000:]


def test_the_agents_semaphores_carry_the_run_and_a_later_launch_removes_a_killed_ones(tmp_path):
    import gc
    import multiprocessing

    from nereus.launch import named_semaphores, remove_stale_semaphores, stale_semaphores

    tag = f"test{os.getpid()}"
    with named_semaphores(tag):
        lock = multiprocessing.get_context("spawn").Lock()  # what torch's agent makes for its queues and events
    made = stale_semaphores(tag)
    assert len(made) == 1 and os.path.basename(made[0]).startswith(f"sem.nereus-{tag}-")
    del lock
    gc.collect()
    assert stale_semaphores(tag) == []  # a clean exit unlinks them
    (tmp_path / f"sem.nereus-{tag}-abcd1234").write_bytes(b"x")  # what a SIGKILLed launcher's group left
    (tmp_path / "sem.mp-abcd1234").write_bytes(b"x")  # another program's
    assert [os.path.basename(p) for p in remove_stale_semaphores(tag, str(tmp_path))] == [f"sem.nereus-{tag}-abcd1234"]
    assert sorted(os.listdir(tmp_path)) == ["sem.mp-abcd1234"]


def _cli(*args, log=None) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "from nereus.cli.app import main; main()", *args]
    return subprocess.Popen(cmd, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=log is None,
                            start_new_session=True)


def _train_args(run_dir, steps, *extra):
    sets = [*SMALL, *ONE, f"steps={steps}", "elastic.collective_timeout_s=60", *extra]
    return ["train", TINY_GRPO, "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]


SHM = "/dev/shm"
LEAKABLE = ("sem.", "psm_", "torch_", "nereus-")
"""What nereus or torch (multiprocessing) make in /dev/shm: semaphores (``sem.mp-*``,
``sem.nereus-*``), torch's shared-memory files (``psm_*`` for ``file_descriptor`` sharing,
``torch_*`` for ``file_system``) and staging dirs (``nereus-<run id>``)."""


def _shm() -> set[str]:
    return set(os.listdir(SHM))


def _leaked(before: set[str]) -> list[str]:
    """What appeared in /dev/shm since the listing ``before`` that nereus or torch makes
    (``LEAKABLE``): whatever was there before (other runs' leftovers) is not counted, nor a
    file another program made meanwhile under a name neither makes."""
    return sorted(n for n in _shm() - before if n.startswith(LEAKABLE))


def _shm_of(run_dir) -> list[str]:
    """This job's entries in /dev/shm: its staging dir and its agents' semaphores (named by its run id)."""
    from nereus.trainer.elastic.staging import run_id

    rid = run_id(str(run_dir))
    return sorted(n for n in _shm() if n == f"nereus-{rid}" or n.startswith(f"sem.nereus-{rid}-"))


@pytest.mark.timeout(240)
def test_a_second_train_on_a_run_dir_fails_at_once_naming_the_first_which_completes_and_leaves_no_shm(tmp_path):
    run_dir = tmp_path / "run"
    before = _shm()
    first = _cli(*_train_args(run_dir, 3), "--max-restarts", "1")  # staging on: it stages, and gives the memory back
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(run_dir / ".lock") and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        second = subprocess.run([sys.executable, "-c", "from nereus.cli.app import main; main()", *_train_args(run_dir, 3)],
                                capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        out, _ = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert second.returncode == 2 and took < 10, (took, second.stderr)
    line = second.stderr.strip().splitlines()
    assert len(line) == 1 and f"is in use by another job (pid {first.pid} on host" in line[0], second.stderr
    assert first.returncode == 0, out
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert _leaked(before) == [] and not (run_dir / ".lock").exists()


@pytest.mark.timeout(300)
def test_a_sigkilled_run_leaves_its_shm_files_and_the_resume_removes_them(tmp_path):
    """The whole job (launcher, its resource tracker, workers) SIGKILLed once a staged step
    is committed: its semaphores and staging dir stay in /dev/shm, its lock names a dead pid.
    `nereus resume` takes the lock over (its line), removes the semaphores, restores the staged
    step, finishes; then nothing of the job is left in /dev/shm, and each step is logged once."""
    run_dir, steps = tmp_path / "run", 6
    before = _shm()
    log = open(tmp_path / "train.log", "w")
    job = _cli(*_train_args(run_dir, steps, "checkpoint_every=2"), "--max-restarts", "1", log=log)
    try:
        deadline = time.monotonic() + 150
        while job.poll() is None and time.monotonic() < deadline:
            lines = read_metrics(run_dir)
            staged = lines[-1].get("staging", {}) if lines else {}
            if staged.get("write_s") is not None and staged["step"] >= 3:
                break
            time.sleep(0.02)
        killed_at = read_metrics(run_dir)[-1]["step"]
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        log.close()
    assert killed_at < steps, (tmp_path / "train.log").read_text()[-3000:]
    left = _shm_of(run_dir)
    assert any(n.startswith("sem.nereus-") for n in left) and any(not n.startswith("sem.") for n in left), left
    resumed = subprocess.run([sys.executable, "-c", "from nereus.cli.app import main; main()", "resume", str(run_dir),
                              "--max-restarts", "1"], capture_output=True, text=True, timeout=200)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"took over the stale lock of run dir {run_dir} (pid {job.pid} on host" in resumed.stderr
    restores = [json.loads(line) for line in (run_dir / "restores.jsonl").read_text().splitlines()]
    assert restores[-1]["source"] == "staged" and restores[-1]["step"] >= 3, restores
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, steps + 1))
    assert _leaked(before) == []
