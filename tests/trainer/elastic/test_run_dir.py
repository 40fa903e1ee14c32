"""One job per run dir, and nothing of a job's left in /dev/shm: the run dir's lock (a live holder
named, a stale one taken over, a dead launcher's live workers refusing it and named by pid, a
finished job's exiting holder and workers waited for, a forked child keeping no lock, a worker of
another job stopping, a filesystem without flock — `nereus train` exits 2 —, a busy one failing
the round non-zero on several nodes, torchrun's default run id and another launch of a reused one
never "the same job"), a SIGKILLed launcher's worker dying with it, a second `nereus train`
refused at once while the first completes, the semaphores' liveness by a lock, and the job's own
/dev/shm entries before and after a clean run and a SIGKILLed run + resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nereus.trainer.elastic import run_lock
from nereus.trainer.elastic.run_lock import (Holder, NoFlock, RunDirBusy, RunLock, busy_message, hold_for_worker, job_identity,
                                            launch_of, parse_holder, same_job_wait_s, spawned_by, stale_message, waits_for,
                                            workers_message)
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
    assert stale_message(run_dir, holder, alive=False).endswith("that process has exited, and none of its workers holds the run dir")
    assert "its holder no longer holds it, and none" in stale_message(run_dir, holder, alive=None)  # another host
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
    assert lock.took_over.startswith(line) and lock.took_over.endswith("none of its workers holds the run dir")
    assert line in capsys.readouterr().err
    assert parse_holder(open(lock.path).read()).pid == os.getpid()
    lock.release()
    assert os.listdir(run_dir) == []  # a run dir that was there stays


def _comm(pid: int | str = "self") -> str:
    return open(f"/proc/{pid}/comm").read().strip()


def _let_go(run_dir) -> None:
    """Drop this test process's ``hold_for_worker`` of ``run_dir`` (a worker never does)."""
    os.close(run_lock._HELD.pop(os.path.abspath(str(run_dir))))


def test_workers_of_a_dead_launcher_keep_the_run_dir_busy_though_its_lock_is_free(tmp_path):
    """The launcher alone SIGKILLed: the kernel freed RUN_DIR/.lock, but its workers (one here:
    this process's LOCK_SH on .lock.workers) still write. An acquirer is refused with one line
    naming them and the dead launcher, whose record stays; once they are gone it takes over.
    A dead rank 0's record (it names a job) is said to be that, and refused at once, not waited for.
    The launcher's own check drops .lock.workers at once: its workers take it while it holds .lock."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    dead = _dead_pid()
    record = {"host": os.uname().nodename, "pid": dead, "started": time.time() - 60, "job": None}
    with open(os.path.join(run_dir, ".lock"), "w") as f:
        json.dump(record, f)
    hold_for_worker(run_dir, check=False)  # a worker of that job: its record is not this process's
    hold_for_worker(run_dir, check=False)  # idempotent: one descriptor per process
    try:
        with pytest.raises(RunDirBusy) as busy:
            RunLock(run_dir).acquire(wait_workers_s=0)
        assert str(busy.value) == workers_message(run_dir, parse_holder(json.dumps(record)),
                                                  held_by=f"pid {os.getpid()} ({_comm()})")  # the holder, from /proc
        assert str(busy.value).startswith(f"run dir {run_dir} is still written by workers of a job whose launcher is gone "
                                          f"(its launcher was pid {dead} on host ")
        assert f"held by pid {os.getpid()} " in str(busy.value) and f"lock {run_dir}/.lock.workers held" in str(busy.value)
        assert parse_holder(open(os.path.join(run_dir, ".lock")).read()).pid == dead  # left for the next acquirer to name
        record["job"] = "j@launch-a"  # a dead rank 0's (torchrun, several nodes): its agent may be restarting the job
        with open(os.path.join(run_dir, ".lock"), "w") as f:
            json.dump(record, f)
        t0 = time.monotonic()
        with pytest.raises(RunDirBusy) as busy:
            RunLock(run_dir).acquire(wait_workers_s=30)
        assert time.monotonic() - t0 < 5  # not waited for
        assert str(busy.value).startswith(f"run dir {run_dir}: workers of job j@launch-a, whose rank 0 (pid {dead} on host ")
        assert ", still hold the run dir (" in str(busy.value) and "launcher" not in str(busy.value)
        t0 = time.monotonic()
        with pytest.raises(RunDirBusy, match="still written by workers of this job's previous round \\(pid "):
            RunLock(run_dir, job="j", launch="launch-a").acquire(wait_same_job_s=0.5)  # its own job: waited for, bounded
        assert 0.5 <= time.monotonic() - t0 < 5
        assert parse_holder(open(os.path.join(run_dir, ".lock")).read()).pid == dead  # a refused acquirer's record undone
    finally:
        _let_go(run_dir)
    lock = RunLock(run_dir).acquire()  # the workers are gone: taken over
    assert lock.took_over.endswith("none of its workers holds the run dir")
    hold_for_worker(run_dir)  # this launcher's own worker, while it holds .lock
    _let_go(run_dir)
    lock.release()
    assert sorted(os.listdir(run_dir)) == [".lock.workers"]  # never unlinked (a worker may hold it)


_LAUNCHER = """
import os, subprocess, sys, time
env = {**os.environ, "NEREUS_LAUNCHER": f"{os.getpid()}:run-a", "TORCHELASTIC_RUN_ID": "run-a"}
subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]], env=env)
time.sleep(120)
"""
_WORKER = """
import os, sys, threading, time
from nereus.trainer.elastic.run_lock import die_with_launcher, hold_for_worker
armed = die_with_launcher()
hold_for_worker(sys.argv[1], check=False)  # no launcher's record: this test's launcher takes no lock
threading.Thread(target=time.sleep, args=(120,)).start()  # non-daemon, like the background staging write
open(os.path.join(sys.argv[1], "worker"), "w").write(f"{os.getpid()} {armed}")
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_a_sigkilled_launchers_worker_dies_with_it_and_only_then_frees_the_run_dir(tmp_path):
    """The launcher process alone SIGKILLed (its lock freed by the kernel): its worker — which
    holds .lock.workers and a non-daemon thread, as a worker mid-staging does — is SIGKILLed
    by the kernel (PR_SET_PDEATHSIG), and until it is gone the run dir is refused."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(run_dir), _WORKER], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (run_dir / "worker").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        pid, armed = (run_dir / "worker").read_text().split()
        assert armed == ("True" if sys.platform.startswith("linux") else "False")
        with pytest.raises(RunDirBusy, match=f"is still written by workers of a job whose launcher is gone .*held by pid {pid} "):
            RunLock(str(run_dir)).acquire(wait_workers_s=0)  # .lock is free: nobody holds it
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        lock = RunLock(str(run_dir)).acquire(wait_workers_s=10)  # a resume at once: waits for the worker's exit
        lock.release()
        try:  # gone, or a zombie its new parent (this container's init) has not reaped
            assert open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            pass
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_filesystem_without_flock_is_one_line_naming_the_run_dir_and_leaves_nothing(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    run_dir = str(tmp_path / "nfs" / "run")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(NoFlock) as e:
        RunLock(run_dir).acquire()
    line = str(e.value)
    assert line.startswith(f"run dir {os.path.abspath(run_dir)} cannot be locked: its filesystem does not support flock "
                           "(ENOLCK: No locks available)") and "\n" not in line
    assert not os.path.exists(tmp_path / "nfs")  # nothing written: the parent it made went too
    def unsupported(fd, op):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(fcntl, "flock", unsupported)
    with pytest.raises(NoFlock, match="(EOPNOTSUPP|ENOTSUP): Operation not supported"):
        hold_for_worker(run_dir)  # a worker (torchrun, several nodes) says the same
    assert os.path.abspath(run_dir) not in run_lock._HELD


def test_the_same_job_is_one_launch_and_waits_less_than_the_collective_timeout():
    """A --rdzv-id hard-coded in a Slurm script names many launches: the launch id the
    rendezvous store hands every round of one launch tells them apart (pure). The wait for
    one's own previous round is at most half the collective timeout the other ranks wait in."""
    assert job_identity("slurm-train", "a1") == "slurm-train@a1" and job_identity("none", "a1") is None
    assert not waits_for(Holder(host="h", pid=1, started=0.0, job=job_identity("slurm-train", "a1")),
                         job_identity("slurm-train", "b2"))  # a new launch reusing the id: another job, no wait
    assert waits_for(Holder(host="h", pid=1, started=0.0, job="slurm-train@a1"), job_identity("slurm-train", "a1"))
    assert launch_of("slurm-train:a1", "slurm-train") == "a1" and launch_of("x:y:a1", "x:y") == "a1"
    assert launch_of("other:a1", "slurm-train") is None and launch_of(None, "slurm-train") is None
    assert launch_of("slurm-train:", "slurm-train") is None
    assert same_job_wait_s(30) == 15 and same_job_wait_s(50) == 25 and same_job_wait_s(600) == 30
    assert spawned_by("123:run-a", "run-a") == 123 and spawned_by("123:run-a", "run-b") is None
    assert spawned_by(None, "run-a") is None and spawned_by("x:run-a", "run-a") is None and spawned_by("1:r", None) is None


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
    first = RunLock(run_dir, job="slurm-7", launch="a1").acquire()
    t0 = time.monotonic()
    with pytest.raises(RunDirBusy, match=", job slurm-7@a1"):
        RunLock(run_dir, job="slurm-7", launch="b2").acquire(wait_same_job_s=20)  # the same --rdzv-id, another launch
    assert time.monotonic() - t0 < 5
    first.release()


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
    cfg = load_config(TINY_GRPO, [f"run_dir={run_dir}"])
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(typer.Exit) as exit_:
        run_job(cfg, False)
    assert exit_.value.exit_code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {line}"] and run_dir in err[0] and "pid 12 on host h" in err[0]
    monkeypatch.setenv("LOCAL_RANK", "1")  # every other rank of the node: the same exit, no line of its own
    with pytest.raises(typer.Exit) as exit_:
        run_job(cfg, False)
    assert exit_.value.exit_code == 1 and capsys.readouterr().err == ""


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
    """A launcher's semaphores carry the run and its key, and it holds a sentinel locked while it
    lives; a later launch removes a key's files only when its sentinel is unlocked — never by a
    pid, which another pid namespace sharing /dev/shm (--ipc=host) may reuse."""
    import fcntl
    import gc
    import multiprocessing

    from nereus.launch import (drop_sentinels, hold_sentinel, launcher_alive, named_semaphores, remove_stale_semaphores,
                               sem_owner, sentinel_path, stale_semaphores)

    tag = f"test{os.getpid()}"
    with named_semaphores(tag):
        lock = multiprocessing.get_context("spawn").Lock()  # what torch's agent makes for its queues and events
    made = stale_semaphores(tag)
    key = hold_sentinel(tag)
    assert key.startswith(f"{os.getpid()}.") and len(made) == 1
    assert os.path.basename(made[0]).startswith(f"sem.nereus-{tag}.{key}-") and sem_owner(os.path.basename(made[0]), tag) == key
    assert launcher_alive(tag, key) is True and os.path.exists(sentinel_path(tag, key))
    assert remove_stale_semaphores(tag) == [] and stale_semaphores(tag) == made  # its launcher (this process) runs: kept
    del lock
    gc.collect()
    assert stale_semaphores(tag) == []  # a clean exit unlinks them
    drop_sentinels()  # at exit
    assert not os.path.exists(sentinel_path(tag, key)) and launcher_alive(tag, key) is None
    assert sem_owner(f"sem.nereus-{tag}.123-abcd1234", tag) is None and sem_owner(f"sem.nereus-{tag}-abcd1234", tag) is None

    shm = str(tmp_path)
    dead, live, gone = f"{os.getppid()}.0000dead", f"{_dead_pid()}.0000a11e", "77.000000ff"
    for k in (dead, live):
        open(sentinel_path(tag, k, shm), "w").close()
    holder = os.open(sentinel_path(tag, live, shm), os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another namespace's live launcher: its pid means nothing here
    try:
        for name in (f"sem.nereus-{tag}.{dead}-abcd1234",  # what a SIGKILLed launcher's group left, on any node
                     f"sem.nereus-{tag}.{live}-abcd1234",  # a live launch's (another node's agent on this host)
                     f"sem.nereus-{tag}.{gone}-abcd1234",  # no sentinel: a launcher at its very end
                     f"sem.nereus-{tag}.{_dead_pid()}-abcd1234",  # an older Nereus's (pid only)
                     f"sem.nereus-{tag}-abcd1234",  # an older Nereus's (no pid)
                     "sem.mp-abcd1234"):  # another program's
            (tmp_path / name).write_bytes(b"x")
        assert launcher_alive(tag, dead, shm) is False and launcher_alive(tag, live, shm) is True
        assert launcher_alive(tag, gone, shm) is None
        assert [os.path.basename(p) for p in remove_stale_semaphores(tag, shm)] == \
            [f"sem.nereus-{tag}.{dead}-abcd1234", f"nereus-{tag}.{dead}.launcher"]
        left = sorted(os.listdir(tmp_path))
        assert sorted(os.path.basename(p) for p in remove_stale_semaphores(tag, shm, locked=True)) == \
            sorted(n for n in left if n.startswith(f"sem.nereus-{tag}") and live not in n)  # under the run dir's lock
        assert sorted(os.listdir(tmp_path)) == sorted([f"sem.nereus-{tag}.{live}-abcd1234", f"nereus-{tag}.{live}.launcher",
                                                       "sem.mp-abcd1234"])
    finally:
        os.close(holder)


def test_a_launch_that_ends_removes_what_a_launcher_of_its_run_killed_meanwhile_left(monkeypatch):
    """A node's launcher SIGKILLed while the job went on (a node that left, on this host) left
    its semaphores and sentinel; no later launch of the run may come, so the surviving launch
    removes them as it ends — a live launcher's (its sentinel locked) stay, and so do its files
    (``launch_files`` lists them all)."""
    import fcntl

    from nereus import launch
    from nereus.launch import drop_sentinels, hold_sentinel, launch_files, launch_local, sentinel_path

    tag = f"test{os.getpid()}end"
    dead, live = "1.0000dead", "2.0000a11e"  # their pids mean nothing: another pid namespace's, say
    names = [f"sem.nereus-{tag}.{dead}-abcd1234", f"sem.nereus-{tag}.{live}-abcd1234"]
    for k in (dead, live):
        open(sentinel_path(tag, k), "w").close()
    for name in names:
        open(os.path.join(launch.SHM, name), "w").close()
    holder = os.open(sentinel_path(tag, live), os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a live launcher of the run on this host
    monkeypatch.setattr(launch, "elastic_launch", lambda config, fn: lambda *args: {0: fn(*args)})  # no agent: its end only
    try:
        assert launch_local(str, 1, 7, shm_tag=tag) == {0: "7"}
        left = sorted(os.path.basename(p) for p in launch_files(tag))
        assert left == sorted([f"sem.nereus-{tag}.{live}-abcd1234", f"nereus-{tag}.{live}.launcher",
                               f"nereus-{tag}.{hold_sentinel(tag)}.launcher"])  # this process's own, until it exits
    finally:
        os.close(holder)
        drop_sentinels()
        for p in launch_files(tag):
            os.unlink(p)


def _cli(*args, log=None, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "from nereus.cli.app import main; main()", *args]
    return subprocess.Popen(cmd, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=log is None,
                            start_new_session=True, env=env)


def _train_args(run_dir, steps, *extra):
    sets = [*SMALL, *ONE, f"steps={steps}", "elastic.collective_timeout_s=60", *extra]
    return ["train", TINY_GRPO, "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]


SHM = "/dev/shm"


def _shm() -> set[str]:
    return set(os.listdir(SHM))


def _shm_of(run_dir) -> list[str]:
    """This job's entries in /dev/shm: its staging dir (``nereus-<staging id>``), its agents'
    semaphores (named by its run id: ``sem.nereus-<run id>.<launcher key>-*``) and its
    launchers' sentinels."""
    from nereus.trainer.elastic.run_token import run_id, staging_id

    rid, sid = run_id(str(run_dir)), staging_id(str(run_dir))
    return sorted(n for n in _shm() if n in (f"nereus-{rid}", f"nereus-{sid}")
                  or n.startswith((f"sem.nereus-{rid}.", f"sem.nereus-{rid}-", f"nereus-{rid}.")))


def _leaked(before: set[str], run_dir) -> list[str]:
    """This job's entries in /dev/shm (``_shm_of``) that were not there in the listing
    ``before``: what other programs (other engineers' runs, their ``sem.mp-*``) make meanwhile
    is not counted."""
    return sorted(set(_shm_of(run_dir)) - before)


@pytest.mark.timeout(240)
def test_a_second_train_on_a_run_dir_fails_at_once_naming_the_first_which_completes_and_leaves_no_shm(tmp_path):
    run_dir = tmp_path / "run"
    before = _shm()
    # staging on: it stages, and gives the memory back; 8 steps: still running when the second is up on a loaded machine
    first = _cli(*_train_args(run_dir, 8), "--max-restarts", "1")
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
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 9))
    assert _leaked(before, run_dir) == [] and not (run_dir / ".lock").exists()


@pytest.mark.timeout(300)
def test_a_sigkilled_run_leaves_its_shm_files_and_the_resume_removes_them(tmp_path):
    """The whole job (launcher, its resource tracker, workers) SIGKILLed once a staged step
    is committed, before its first durable checkpoint: its semaphores and staging dir stay in
    /dev/shm, its lock names a dead pid. `nereus resume` takes the lock over (its line), removes
    the semaphores, restores the staged step (no committed step is lost for want of a durable
    one), finishes; then nothing of the job is left in /dev/shm, and each step is logged once."""
    run_dir, steps = tmp_path / "run", 6
    before = _shm()
    log = open(tmp_path / "train.log", "w")
    phases = tmp_path / "phases.jsonl"  # the staged copy's commit is marked there (trainer/elastic/phases.py)
    job = _cli(*_train_args(run_dir, steps, "checkpoint_every=100"), "--max-restarts", "1", log=log,
               env={**os.environ, "NEREUS_PHASE_LOG": str(phases)})
    try:
        deadline = time.monotonic() + 150
        while job.poll() is None and time.monotonic() < deadline:
            marks = [json.loads(line) for line in phases.read_text().splitlines(keepends=True) if line.endswith("\n")] \
                if phases.exists() else []  # a line being written has no newline yet
            if any(m["phase"] == "stage" and m["edge"] == "end" and m["step"] >= 3 for m in marks):
                break  # step 3's copy is committed; the next stage waits for it, so steps 5 and 6 are still to run
            time.sleep(0.02)
        killed_at = read_metrics(run_dir)[-1]["step"]
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        log.close()
    assert killed_at < steps, (tmp_path / "train.log").read_text()[-3000:]
    from nereus.store.checkpoint import CheckpointStore

    assert CheckpointStore(str(run_dir / "checkpoints")).steps() == []  # only the staged copy holds the steps run
    left = _shm_of(run_dir)
    from nereus.trainer.elastic.run_token import staging_id

    assert any(n.startswith("sem.nereus-") for n in left) and f"nereus-{staging_id(str(run_dir))}" in left, left
    resumed = subprocess.run([sys.executable, "-c", "from nereus.cli.app import main; main()", "resume", str(run_dir),
                              "--max-restarts", "1"], capture_output=True, text=True, timeout=200)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"took over the stale lock of run dir {run_dir} (pid {job.pid} on host" in resumed.stderr
    restores = [json.loads(line) for line in (run_dir / "restores.jsonl").read_text().splitlines()]
    assert restores[-1]["source"] == "staged" and restores[-1]["step"] >= 3, restores
    assert "in the staged copy's plan" in resumed.stdout, resumed.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, steps + 1))
    assert _leaked(before, run_dir) == []


def test_a_rank_that_cannot_hold_the_workers_lock_stops_every_rank_with_its_error(tmp_path, monkeypatch):
    """agree_start: the ranks' lock outcomes are gathered, so one rank's NoFlock (a node mounted
    without flock) stops all of them with that line, instead of leaving the rest in a barrier."""
    import errno
    import types

    from nereus.trainer.elastic import restore, run_lock
    from nereus.trainer.prepare import load_config
    from tests.trainer.elastic.common import TINY_GRPO

    cfg = load_config(TINY_GRPO, [f"run_dir={tmp_path / 'run'}"])
    monkeypatch.setenv("LOCAL_RANK", "1")  # no staging cleared
    failing = run_lock.NoFlock(run_lock.no_flock_message(cfg.run_dir, OSError(errno.ENOLCK, "No locks available")))
    outcomes: dict[int, object] = {}

    def run_as(rank: int, fails: bool):
        calls: list[str] = []

        def gather(out, mine):
            outcomes[rank] = mine
            out[:] = [outcomes.get(r) for r in range(2)]

        def broadcast(d, src):
            if d[0] is None:
                d[0] = {"restoring": False, "restart": False, "lineage": "L", "error": None, "busy": False}

        monkeypatch.setattr(restore, "dist", types.SimpleNamespace(get_rank=lambda: rank, get_world_size=lambda: 2, broadcast_object_list=broadcast,
                                                                   all_gather_object=gather, barrier=lambda: calls.append("barrier")))

        def hold(run_dir, **kw):
            if fails:
                raise failing

        monkeypatch.setattr(run_lock, "hold_for_worker", hold)
        return restore.agree_start(cfg, False, None, None)["error"], calls

    assert run_as(1, True) == (str(failing), [])
    assert run_as(0, False) == (str(failing), [])  # rank 0's own lock was fine: it stops too, with rank 1's line
    outcomes.clear()
    assert run_as(0, False) == (None, ["barrier"])  # every rank fine: it goes on
