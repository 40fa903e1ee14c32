"""One job per run dir: an exclusive ``flock`` on ``RUN_DIR/.lock``, held for the job's whole life.

Two jobs writing one run dir would interleave their metrics and race on checkpoint steps (the
second used to fail only after a minute, deep in its workers, on a ``CheckpointExistsError``).
The lock is taken before anything in the run dir is looked at or changed; a second ``train``
or ``resume`` on it fails at once with one line naming the holder.

Who holds it:

- one node under Nereus's own launcher (``nereus train``/``nereus resume``, ``--nnodes 1``):
  the launcher process, from before it checks the run dir until the agent returns, every
  restart of the workers included (the agent lives in it). The file is opened ``O_CLOEXEC``
  and the workers are spawned (fork + exec): no worker holds it.
- several nodes (``--nnodes MIN:MAX``, MAX > 1) and under torchrun: no node's launcher can
  tell the job's first start from a node joining later, so global rank 0's worker takes it
  right after the process group forms (``restore.agree_start``, before its run-dir checks)
  and holds it until it exits; each round's rank 0 takes it again. Between two rounds nobody
  holds it for a few seconds; the record names the job (``job_identity`` of the agent's
  ``TORCHELASTIC_RUN_ID``), and a rank 0 finding it held by its own job (the previous
  round's rank 0, still being stopped) waits up to ``SAME_JOB_WAIT_S`` for it
  (``waits_for``). A busy run dir there is an exception on every rank (``RunDirBusy``: the
  worker exits non-zero, the agent counts a failed round and restarts while it may, so a
  lock a lost host's NFS client still holds is tried again; the last round's error names the
  run dir and the holder in one line). Across hosts the lock holds where the shared
  filesystem implements ``flock`` between clients (NFSv4, Lustre mounted ``-o flock``,
  GPFS); elsewhere it excludes jobs on one host only.

Same job: the rendezvous id is the job's identity only when the launch gave one. torchrun's
default ``--rdzv-id`` is the literal ``none`` (and an empty one names nothing): every job
launched without one would share it, so such a run id is no identity (``job_identity`` ->
None, recorded as no job) and a holder is then always another job — no waiting, the round
fails at once with ``RunDirBusy`` and the agent's restart is the retry. ``nereus train``
always has one of its own (``--rdzv-id``, required on several nodes; a fresh uuid on one).

The record (one JSON line: host, pid, start time, job) is written into the file once it is
locked. A clean release unlinks the file while still holding it, then closes it; so an
acquirer re-checks that the path still names the inode it locked, else retries — two holders
never coexist. The kernel releases a dead holder's ``flock``: the next acquirer finds its
record (a clean release leaves none), takes the lock over and logs one line naming it (stale).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass

LOCK_NAME = ".lock"
SAME_JOB_WAIT_S = 30.0
"""How long a worker waits for a lock its own job's previous round still holds."""
_READ_TRIES = 20  # a holder that just locked writes its record within milliseconds


DEFAULT_RUN_IDS = frozenset({"", "none"})
"""Run ids that name no job: torchrun's default ``--rdzv-id`` and an empty one (module docstring)."""


class RunDirBusy(RuntimeError):
    """The run dir is locked by a live job (its message: one line naming the holder)."""


def job_identity(run_id: str | None) -> str | None:
    """The job a lock record names for the agent's run id ``run_id`` (pure): None for none,
    an empty one or torchrun's default ``none`` (any case, blanks around it), which many
    unrelated jobs share; else the id itself."""
    if run_id is None or run_id.strip().lower() in DEFAULT_RUN_IDS:
        return None
    return run_id


@dataclass(frozen=True, kw_only=True, slots=True)
class Holder:
    """Who holds (or held) a run dir's lock, as its record says."""

    host: str
    pid: int
    started: float
    job: str | None = None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        job = f", job {self.job}" if self.job else ""
        return f"pid {self.pid} on host {self.host}, started {when}{job}"


def parse_holder(text: str) -> Holder | None:
    """A lock file's record (pure); None when empty or unreadable (a holder still writing it,
    or a file of another tool)."""
    try:
        d = json.loads(text)
        return Holder(host=str(d["host"]), pid=int(d["pid"]), started=float(d["started"]), job=d.get("job"))
    except (ValueError, KeyError, TypeError):
        return None


def waits_for(holder: Holder | None, job: str | None) -> bool:
    """Whether an acquirer of job ``job`` waits for a live ``holder`` (pure): only when both
    name one job, and that job is an identity (``job_identity``: never torchrun's default
    ``none`` or an empty id, which unrelated jobs share)."""
    mine = job_identity(job)
    return holder is not None and mine is not None and job_identity(holder.job) == mine


def busy_message(run_dir: str, holder: Holder | None) -> str:
    """The one line a second job gets (pure)."""
    who = holder.describe() if holder else "a process that has not written its record yet"
    return (f"run dir {run_dir} is in use by another job ({who}; lock {os.path.join(run_dir, LOCK_NAME)}): "
            "wait for it to finish, stop it, or use another --run-dir")


def stale_message(run_dir: str, holder: Holder | None, *, alive: bool | None, job: str | None = None) -> str:
    """The line logged when a dead holder's lock is taken over (pure). ``alive``: whether
    its pid runs (None: another host, not known); ``job``: the taker's (its own job's
    previous round held it: a restart)."""
    who = holder.describe() if holder else "an unreadable record"
    if waits_for(holder, job):
        return f"nereus: run dir {run_dir}'s lock passes from this job's previous round ({who}) to this one"
    if alive is None:
        why = "its holder no longer holds it"
    elif alive:
        why = "that pid runs but does not hold it (a reused pid)"
    else:
        why = "that process is gone"
    return f"nereus: took over the stale lock of run dir {run_dir} ({who}): {why}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """The exclusive lock of one run dir (module docstring). ``acquire`` then ``release``
    (or ``with``); ``acquire`` raises :class:`RunDirBusy` while a live job holds it."""

    def __init__(self, run_dir: str, job: str | None = None) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_NAME)
        self.job = job_identity(job)
        """The job it is taken for (``job_identity``: None when the run id names no job)."""
        self.fd: int | None = None
        self.took_over: str | None = None
        """The stale holder's line, when this acquire took a dead holder's lock over."""
        self._made_dir = False

    def acquire(self, *, wait_same_job_s: float = 0.0) -> RunLock:
        """Take the lock now; a holder of the same job (``waits_for``) is waited for up to
        ``wait_same_job_s``. A stale record is taken over (``took_over``, logged on stderr)."""
        if not os.path.isdir(self.run_dir):
            os.makedirs(self.run_dir, exist_ok=True)
            self._made_dir = True
        deadline = time.monotonic() + wait_same_job_s
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                if waits_for(holder, self.job) and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                self._forget_dir()
                raise RunDirBusy(busy_message(self.run_dir, holder)) from None
            except BaseException:
                os.close(fd)
                raise
            if not self._still_named(fd):  # released and unlinked between our open and our flock: a new file
                os.close(fd)
                continue
            break
        self.fd = fd
        previous = self._holder(fd, tries=1)
        if previous is not None or os.fstat(fd).st_size:
            alive = pid_alive(previous.pid) if previous and previous.host == socket.gethostname() else None
            self.took_over = stale_message(self.run_dir, previous, alive=alive, job=self.job)
            print(self.took_over, file=sys.stderr, flush=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "job": self.job}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        return self

    def release(self) -> None:
        """Unlink the file while holding it, then close it (module docstring); the run dir
        too when this lock made it and nothing else is in it."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if self._still_named(fd):
                os.unlink(self.path)
        finally:
            os.close(fd)
        self._forget_dir()

    def _forget_dir(self) -> None:
        if self._made_dir:
            try:
                os.rmdir(self.run_dir)  # a run refused before it wrote anything leaves no directory behind
            except OSError:
                pass
            self._made_dir = False

    def _still_named(self, fd: int) -> bool:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    @staticmethod
    def _holder(fd: int, tries: int = _READ_TRIES) -> Holder | None:
        for i in range(tries):
            holder = parse_holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            if holder is not None or i == tries - 1:
                return holder
            time.sleep(0.05)
        return None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
