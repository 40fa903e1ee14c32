"""One job per run dir, and nothing of a job's left in /dev/shm: the run dir's lock (a live holder
named, a stale one taken over), a second `nereus train` refused at once while the first completes,
and the job's /dev/shm entries counted before and after a clean run and a SIGKILLed run + resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nereus.trainer.elastic.run_lock import Holder, RunDirBusy, RunLock, busy_message, parse_holder, stale_message
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


def _shm_of(run_dir) -> list[str]:
    """This job's entries in /dev/shm: its staging dir and its agents' semaphores (named by its run id)."""
    from nereus.trainer.elastic.staging import run_id

    rid = run_id(str(run_dir))
    return sorted(n for n in os.listdir("/dev/shm") if n in (f"nereus-{rid}",) or n.startswith(f"sem.nereus-{rid}-"))


@pytest.mark.timeout(240)
def test_a_second_train_on_a_run_dir_fails_at_once_naming_the_first_which_completes_and_leaves_no_shm(tmp_path):
    run_dir = tmp_path / "run"
    assert _shm_of(run_dir) == []
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
    assert _shm_of(run_dir) == [] and not (run_dir / ".lock").exists()


@pytest.mark.timeout(300)
def test_a_sigkilled_run_leaves_its_shm_files_and_the_resume_removes_them(tmp_path):
    """The whole job (launcher, its resource tracker, workers) SIGKILLed once a staged step
    is committed: its semaphores and staging dir stay in /dev/shm, its lock names a dead pid.
    `nereus resume` takes the lock over (its line), removes the semaphores, restores the staged
    step, finishes; then nothing of the job is left in /dev/shm, and each step is logged once."""
    run_dir, steps = tmp_path / "run", 6
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
    assert _shm_of(run_dir) == []
