"""The run dir's lock when a job ends untidily: a forked child that outlives its job keeps no lock
of Nereus's, and a holder is named by its pid (from /proc); a finished job's exiting holder and
ranks are waited for, a bounded time, then named for what they are; a worker whose job does not
hold the run dir stops before writing; a reused --rdzv-id of another launch is another job over a
real rendezvous store; `nereus train` on a filesystem without flock exits 2 with one line. The
lock's basics and the end-to-end runs: test_run_dir.py."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nereus.trainer.elastic import run_lock
from nereus.trainer.elastic.run_lock import (Holder, RunDirBusy, RunLock, hold_for_worker, job_identity, parse_holder,
                                            waits_for)
from tests.trainer.elastic.common import TINY_GRPO


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _let_go(run_dir) -> None:
    """Drop this test process's ``hold_for_worker`` of ``run_dir`` (a worker never does)."""
    os.close(run_lock._HELD.pop(os.path.abspath(str(run_dir))))


_FORKER = """
import fcntl, json, os, sys, time
from nereus.trainer.elastic import run_lock
run_dir = sys.argv[1]
lock = run_lock.RunLock(run_dir).acquire()  # a launcher's lock (a worker's LOCK_SH below: rank 0's process alike)
run_lock.hold_for_worker(run_dir)
raw = os.open(os.path.join(run_dir, ".lock.workers"), os.O_RDONLY)  # another library's flock: not Nereus's to close
fcntl.flock(raw, fcntl.LOCK_SH)
ours = [lock.fd, *run_lock._HELD.values()]
if os.fork() == 0:  # a reward pool's process, a DataLoader's worker: fork without exec
    closed = []
    for fd in ours:
        try:
            os.fstat(fd)
            closed.append(False)
        except OSError:
            closed.append(True)
    report = {"pid": os.getpid(), "closed": closed, "forgot": lock.fd is None and not run_lock._HELD}
    open(os.path.join(run_dir, "child.tmp"), "w").write(json.dumps(report))
    os.rename(os.path.join(run_dir, "child.tmp"), os.path.join(run_dir, "child"))
    time.sleep(60)
    os._exit(0)
os._exit(0)  # the job dies; its forked child lives on, orphaned
"""


@pytest.mark.timeout(60)
def test_a_forked_child_outliving_its_job_keeps_no_lock_of_nereus_and_a_holder_is_named_by_pid(tmp_path):
    """A fork child inherits the locks' descriptors (one open file description: the same flock).
    Nereus's are closed in the child (os.register_at_fork), so an orphan keeps neither .lock nor
    its worker's .lock.workers; one that still holds .lock.workers through a descriptor of its own
    is named by its pid (from /proc), not by the dead job's launcher alone."""
    from nereus.trainer.elastic.lock_holders import holders

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = subprocess.Popen([sys.executable, "-c", _FORKER, str(run_dir)])
    child = None
    try:
        assert job.wait(timeout=40) == 0
        deadline = time.monotonic() + 20
        while not (run_dir / "child").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        report = json.loads((run_dir / "child").read_text())
        child = report["pid"]
        assert report["closed"] == [True, True] and report["forgot"], report
        assert holders(str(run_dir / ".lock.workers")) == [child]  # /proc/locks would name the dead job, who took it
        with pytest.raises(RunDirBusy) as busy:
            RunLock(str(run_dir)).acquire(wait_workers_s=0)  # .lock is free (the child closed its copy): only the raw one holds
        line = str(busy.value)
        assert f"launcher is gone (its launcher was pid {job.pid} on host " in line and f"; held by pid {child} (" in line
        os.kill(child, signal.SIGKILL)
        lock = RunLock(str(run_dir)).acquire(wait_workers_s=10)
        assert f"(pid {job.pid} on host" in lock.took_over
        lock.release()
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_proc_locks_names_the_lockers_of_one_file_only():
    text = ("1: FLOCK  ADVISORY  READ  300 fe:00:77 0 EOF\n"
            "1: -> FLOCK  ADVISORY  WRITE 301 fe:00:77 0 EOF\n"  # a blocked waiter: no holder
            "2: FLOCK  ADVISORY  READ  302 fe:00:78 0 EOF\n"  # another file
            "3: OFDLCK ADVISORY  WRITE -1 fe:00:77 0 EOF\n"  # an OFD lock: no pid
            "4: FLOCK  ADVISORY  READ  0 fe:00:77 0 EOF\n"  # another pid namespace's
            "5: POSIX  ADVISORY  WRITE 299 fe:00:77 0 EOF\n"
            "garbage\n")
    from nereus.trainer.elastic.lock_holders import describe_pids, holders, lock_pids

    assert lock_pids(text, os.makedev(0xFE, 0), 77) == [299, 300]
    assert lock_pids(text, os.makedev(0xFE, 1), 77) == [] and lock_pids("", 0, 0) == []
    assert holders("/nonexistent/.lock.workers") == [] and holders(__file__, proc="/nonexistent") == []
    assert describe_pids([]) == "" and describe_pids(list(range(1, 11)), proc="/nonexistent") == \
        "pid 1, pid 2, pid 3, pid 4, pid 5, pid 6, pid 7, pid 8 and 2 more"


def test_the_holders_are_read_from_procfs_alone_and_only_when_the_file_is_locked(tmp_path):
    """fd_holders reads /proc/PID/fdinfo's lock lines (a fake /proc with no fd/ links at all:
    no descriptor's target, which may sit on a hung mount, is stat'ed); it does not walk when
    /proc/locks has no lock on the file, and stops at its time cap."""
    from nereus.trainer.elastic.lock_holders import fd_holders

    target = tmp_path / ".lock.workers"
    target.write_text("")
    st = os.stat(target)
    here = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    proc = tmp_path / "proc"
    for pid, lines in {"300": [f"lock:\t1: FLOCK  ADVISORY  READ  299 {here} 0 EOF"],  # a fork child of 299
                       "301": ["pos:\t0", "lock:\t1: FLOCK  ADVISORY  READ  301 fe:00:1 0 EOF"],  # another file
                       "302": ["pos:\t0"]}.items():
        (proc / pid / "fdinfo").mkdir(parents=True)
        (proc / pid / "fdinfo" / "4").write_text("\n".join(lines) + "\n")
    (proc / "303").mkdir()  # no fdinfo: exited, or another user's
    (proc / "self").mkdir()
    (proc / "locks").write_text(f"1: FLOCK  ADVISORY  READ  299 {here} 0 EOF\n")
    assert fd_holders(str(target), proc=str(proc)) == [300]
    assert fd_holders(str(target), proc=str(proc), walk_s=-1) == []  # past its cap before the first process
    (proc / "locks").write_text("1: FLOCK  ADVISORY  READ  299 fe:00:1 0 EOF\n")
    assert fd_holders(str(target), proc=str(proc)) == []  # no lock on the file: no walk, though 300's fdinfo says one


def test_an_acquirer_waits_a_bounded_time_for_a_finished_jobs_exiting_holder_and_workers(tmp_path, capsys):
    """Rank 0 keeps .lock until its process exits, its record saying the job finished; other
    ranks (other nodes) may still be exiting. A `resume` then waits for them (bounded), takes the
    lock quietly, and when they do not exit says so — not "another job"."""
    import fcntl
    import threading

    run_dir = str(tmp_path / "run")
    rank0 = RunLock(run_dir, job="j", launch="a").acquire()
    rank0.keep_until_exit(finished=True)
    rank0.release()  # nothing: held until the process exits
    record = parse_holder(open(rank0.path).read())
    assert record.pid == os.getpid() and record.job == "j@a" and record.finished is not None
    t0 = time.monotonic()
    with pytest.raises(RunDirBusy, match=f"run dir {run_dir} is still locked by a finished job that has not exited yet \\(pid "):
        RunLock(run_dir).acquire(wait_workers_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5
    worker = os.open(os.path.join(run_dir, ".lock.workers"), os.O_RDWR | os.O_CREAT)  # another rank, still exiting
    fcntl.flock(worker, fcntl.LOCK_SH)
    threading.Timer(0.3, os.close, (rank0.fd,)).start()  # rank 0's process exits: the kernel drops its lock
    threading.Timer(0.8, os.close, (worker,)).start()  # then the last rank's
    capsys.readouterr()
    t0 = time.monotonic()
    lock = RunLock(run_dir).acquire(wait_workers_s=10)
    assert 0.7 <= time.monotonic() - t0 < 9 and lock.took_over is None
    err = capsys.readouterr().err
    assert f"nereus: run dir {run_dir}: waiting up to " in err and "for the workers of a finished job to exit" in err
    assert "took over" not in err
    run_lock._LOCKS.discard(rank0)
    lock.keep_until_exit(finished=True)  # this one's workers never exit
    os.close(lock.fd)
    run_lock._LOCKS.discard(lock)
    worker = os.open(os.path.join(run_dir, ".lock.workers"), os.O_RDWR)
    fcntl.flock(worker, fcntl.LOCK_SH)
    try:
        with pytest.raises(RunDirBusy) as busy:
            RunLock(run_dir).acquire(wait_workers_s=1)
    finally:
        os.close(worker)
    line = str(busy.value)
    assert line.startswith(f"run dir {run_dir}: a finished job's workers are still exiting (the job was pid {os.getpid()}")
    assert f"held by pid {os.getpid()} (" in line and "held after 1s" in line and "\n" not in line
    assert "launcher is gone" not in line and "another job" not in line


def test_a_worker_takes_the_run_dir_only_while_its_own_job_holds_it(tmp_path, monkeypatch):
    """The acquirer writes its record before it checks .lock.workers, and every worker reads it
    once it holds LOCK_SH: a late worker of a dying job, whose LOCK_SH came after another job's
    check, stops with one line and lets go, before it writes anything (staging, the run dir)."""
    from nereus.trainer.elastic.run_lock import not_own_message, own_record

    mine = dict(host="h", pids=frozenset({5, 6}), job="run-b@l2")
    assert own_record(Holder(host="h", pid=6, started=0.0), **mine)  # its launcher's record (one node)
    assert own_record(Holder(host="g", pid=9, started=0.0, job="run-b@l2"), **mine)  # its rank 0's, on another node
    assert not own_record(Holder(host="g", pid=6, started=0.0), **mine)  # pid 6 of another host
    assert not own_record(Holder(host="h", pid=9, started=0.0, job="run-b@l1"), **mine)  # the same --rdzv-id, another launch
    assert not own_record(Holder(host="h", pid=6, started=0.0, finished=1.0), **mine)  # a finished job's
    assert not own_record(None, **mine)
    assert own_record(Holder(host="g", pid=9, started=0.0, job="none"), host="h", pids=frozenset({5}), job=None)  # no identity
    assert not own_record(Holder(host="g", pid=9, started=0.0, job="run-a"), host="h", pids=frozenset({5}), job=None)

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    seen = []
    probe = RunLock._workers_free

    def seeing(self):
        seen.append(parse_holder(open(self.path).read()))
        return probe(self)

    monkeypatch.setattr(RunLock, "_workers_free", seeing)
    lock = RunLock(run_dir, job="run-a", launch="l1").acquire()
    assert seen[0].pid == os.getpid() and seen[0].job == "run-a@l1"  # written before the check
    lock.release()

    other = {"host": os.uname().nodename, "pid": _dead_pid(), "started": time.time(), "job": "run-a@l1"}
    with open(os.path.join(run_dir, ".lock"), "w") as f:  # run-a's rank 0 holds the run dir
        json.dump(other, f)
    monkeypatch.delenv("NEREUS_LAUNCHER", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    monkeypatch.setenv("NEREUS_LAUNCH_ID", "run-a:l0")  # a late rank of an earlier launch of run-a
    with pytest.raises(RunDirBusy) as busy:
        hold_for_worker(run_dir)
    assert str(busy.value) == not_own_message(os.path.abspath(run_dir), parse_holder(json.dumps(other)))
    assert "is locked by another job (pid " in str(busy.value) and "job run-a@l1" in str(busy.value)
    assert os.path.abspath(run_dir) not in run_lock._HELD
    RunLock(run_dir).acquire(wait_workers_s=0).release()  # it let go of .lock.workers
    with open(os.path.join(run_dir, ".lock"), "w") as f:
        json.dump(other, f)
    monkeypatch.setenv("NEREUS_LAUNCH_ID", "run-a:l1")  # a rank of run-a's own launch
    hold_for_worker(run_dir)
    _let_go(run_dir)


def test_a_reused_rdzv_id_of_another_launch_is_another_job_over_a_real_store():
    """The launch id every agent of one launch reads from its rendezvous store (the first one's
    wins): a new launch under the same --rdzv-id meets a new store, so a new id — another job."""
    import types
    from datetime import timedelta

    import torch.distributed as dist

    from nereus.launch import launch_id

    def agent(store):
        return types.SimpleNamespace(_settings=types.SimpleNamespace(run_id="slurm-train"), _store=store)

    first = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    peer = dist.TCPStore("127.0.0.1", first.port, 1, is_master=False, timeout=timedelta(seconds=10))
    a, b = launch_id(agent(first)), launch_id(agent(peer))
    later = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    c = launch_id(agent(later))
    assert a and a == b and c and c != a
    held = Holder(host="h", pid=1, started=0.0, job=job_identity("slurm-train", a))
    assert waits_for(held, job_identity("slurm-train", b)) and not waits_for(held, job_identity("slurm-train", c))
    assert launch_id(types.SimpleNamespace(_settings=types.SimpleNamespace(run_id="x"), _store=None)) is None


def test_train_on_a_filesystem_without_flock_exits_2_with_one_line(tmp_path, monkeypatch):
    """`nereus train` (one node: the launcher takes the lock) on a run dir whose filesystem
    answers flock with ENOLCK: exit 2, one line on stderr naming the run dir, nothing written."""
    import errno
    import fcntl

    from typer.testing import CliRunner

    from nereus.cli.app import app

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    run_dir = tmp_path / "nfs" / "run"
    monkeypatch.setattr(fcntl, "flock", no_locks)
    result = CliRunner().invoke(app, ["train", TINY_GRPO, "--run-dir", str(run_dir)])
    assert result.exit_code == 2, result.output
    line = run_lock.no_flock_message(str(run_dir), OSError(errno.ENOLCK, "No locks available"))
    assert result.stderr.splitlines() == [f"error: {line}"]
    assert not (tmp_path / "nfs").exists()  # neither the run dir nor the parent it made


@pytest.mark.timeout(60)
def test_a_refused_acquirer_never_holds_the_lock_while_a_restarting_jobs_old_ranks_exit(tmp_path, capsys):
    """Torchrun or several nodes: job T's rank 0 died (the kernel freed .lock), its other ranks are
    still being stopped by T's agent (LOCK_SH on .lock.workers). A mistaken `resume` B meanwhile
    is refused at once (the record names T: its agent may be restarting it) and holds nothing;
    T's next round's rank 0 waits, without holding .lock, and gets the run dir once they exit."""
    import fcntl
    import threading

    run_dir = str(tmp_path / "run")
    first = RunLock(run_dir, job="j", launch="l").acquire()  # T's rank 0 ...
    first.keep_until_exit(finished=False)
    os.close(first.fd)  # ... dies: the kernel drops its flock
    run_lock._LOCKS.discard(first)
    ranks = os.open(os.path.join(run_dir, ".lock.workers"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(ranks, fcntl.LOCK_SH)  # T's other ranks, still exiting
    seen = {}

    def intruder():
        t0 = time.monotonic()
        try:
            seen["b"] = RunLock(run_dir).acquire()
        except RunDirBusy as e:
            seen["b"] = e
        seen["b_s"] = time.monotonic() - t0

    b = threading.Thread(target=intruder)
    b.start()
    time.sleep(0.5)
    threading.Timer(1.5, os.close, (ranks,)).start()  # T's old ranks finish exiting
    t0 = time.monotonic()
    lock = RunLock(run_dir, job="j", launch="l").acquire(wait_same_job_s=15)  # T's next round's rank 0
    took = time.monotonic() - t0
    b.join(timeout=40)
    assert isinstance(seen["b"], RunDirBusy), seen
    assert seen["b_s"] < 5, seen  # at once, not after a wait
    line = str(seen["b"])
    assert line.startswith(f"run dir {run_dir}: workers of job j@l, whose rank 0 (pid {os.getpid()} on host ")
    assert "launcher" not in line and "\n" not in line
    assert 1 <= took < 10 and "passes from this job's previous round" in lock.took_over
    assert parse_holder(open(lock.path).read()).job == "j@l"
    err = capsys.readouterr().err
    assert "waiting up to 15s for the workers of this job's previous round to exit" in err and "took over" not in err
    lock.release()


def test_the_same_jobs_live_previous_rank_0_is_named_as_that_and_a_refusal_leaves_nothing_it_made(tmp_path):
    """A rank 0 of job J finding J's previous round's rank 0 still holding .lock (hung, SIGSTOPped)
    past its wait says so, not "another job"; an acquirer refused after waiting for workers leaves
    no .lock it made, and none of the directories it made."""
    import fcntl

    from nereus.trainer.elastic.run_lock import waiting_message

    run_dir = str(tmp_path / "run")
    previous = RunLock(run_dir, job="j", launch="l").acquire()
    t0 = time.monotonic()
    with pytest.raises(RunDirBusy) as busy:
        RunLock(run_dir, job="j", launch="l").acquire(wait_same_job_s=1)
    assert 1 <= time.monotonic() - t0 < 5
    assert str(busy.value).startswith(f"run dir {run_dir}: this job's previous round's rank 0 (pid {os.getpid()} on host ")
    assert str(busy.value).endswith(", job j@l; lock " f"{run_dir}/.lock) did not exit within 1s: stop it, or use another --run-dir")
    with pytest.raises(RunDirBusy, match="is in use by another job"):
        RunLock(run_dir).acquire()  # a launcher: another job, at once
    previous.release()
    assert waiting_message("/r", Holder(host="h", pid=1, started=0.0, job="k"), 3).startswith(
        "nereus: run dir /r: waiting up to 3s for the workers of job k, whose rank 0 is gone, to exit")

    os.makedirs(run_dir)
    ranks = os.open(os.path.join(run_dir, ".lock.workers"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(ranks, fcntl.LOCK_SH)  # workers that left no record
    try:
        with pytest.raises(RunDirBusy, match="launcher left no record.*held after 1s"):
            RunLock(run_dir).acquire(wait_workers_s=1)
        assert sorted(os.listdir(run_dir)) == [".lock.workers"]  # no 0-byte .lock left
    finally:
        os.close(ranks)
    nested = tmp_path / "a" / "b" / "run"
    RunLock(str(nested)).acquire().release()  # what it made, parents included, goes with it while empty
    assert not (tmp_path / "a").exists()


def test_a_launcher_killed_while_making_its_sentinel_leaves_nothing_and_sentinels_are_forgotten_before_closed(tmp_path):
    """A sentinel is made under a temporary name, locked, then renamed: a launcher killed in between
    leaves `<sentinel>.tmp`, which a later launch removes once it is unlocked and not brand new."""
    import fcntl

    from nereus import launch

    tag = "tmptag"
    old = tmp_path / f"nereus-{tag}.123.0000abcd.launcher.tmp"
    fresh = tmp_path / f"nereus-{tag}.124.0000abcd.launcher.tmp"
    held = tmp_path / f"nereus-{tag}.125.0000abcd.launcher.tmp"
    for path in (old, fresh, held):
        path.write_text("")
    past = time.time() - 2 * launch.SENTINEL_TMP_AGE_S
    os.utime(old, (past, past))
    os.utime(held, (past, past))
    fd = os.open(held, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live launcher renaming it
    try:
        assert launch.remove_stale_semaphores(tag, str(tmp_path)) == [str(old)]
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh.name, held.name]

    saved = dict(launch._SENTINELS)
    launch._SENTINELS.clear()
    try:
        key = launch.hold_sentinel(tag, str(tmp_path))
        path = launch.sentinel_path(tag, key, str(tmp_path))
        assert os.path.exists(path) and launch.launcher_alive(tag, key, str(tmp_path))
        closed = []
        real_close = os.close

        def close(fd):
            closed.append(dict(launch._SENTINELS))  # what a reader of _SENTINELS would see meanwhile
            real_close(fd)

        os.close = close
        try:
            launch.drop_sentinels()
        finally:
            os.close = real_close
        assert closed == [{}] and not launch._SENTINELS and not os.path.exists(path)
    finally:
        launch._SENTINELS.update(saved)
