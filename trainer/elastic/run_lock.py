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
  GPFS); with a node-local one (Lustre ``-o localflock``) it excludes jobs on one host only,
  and a filesystem without ``flock`` is refused (``NoFlock``, below).

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

Workers of a dead launcher (``RUN_DIR/.lock.workers``). The kernel drops the launcher's
``flock`` when the launcher alone is SIGKILLed, while its workers may still write the run dir
and its staging (torch gives them SIGINT when their parent dies, and a worker's background
staging thread outlived it). So every worker takes ``LOCK_SH`` on ``.lock.workers`` (opened
``O_CLOEXEC``) before it writes anything and holds it for the rest of its process's life
(``hold_for_worker``, from ``restore.agree_start``), and an acquirer of ``.lock`` must also get
``LOCK_EX|LOCK_NB`` on ``.lock.workers`` — it only checks, and drops it at once, so its own
workers (started later, while it holds ``.lock``) take theirs — else ``RunDirBusy`` naming the
dead launcher's workers (an acquirer of the same job waits for them like for ``.lock``). Our
launcher's workers also die with it (``die_with_launcher``: ``PR_SET_PDEATHSIG`` = SIGKILL on
Linux). ``.lock.workers`` is never unlinked (a worker may hold it; a new inode would split the
lock): a 0-byte file of that name stays in the run dir.

Same job: under Nereus's launcher (and ``torchrun --rdzv-backend nereus``) the rendezvous
store hands every round of one launch the same launch id (``nereus.launch``:
``LAUNCH_ID_ENV``), so the job is ``<rdzv id>@<launch id>``: a new launch that reuses a
``--rdzv-id`` (one hard-coded in a Slurm script) is another job and is never waited for.
Without it (plain torchrun's c10d rendezvous) the rdzv id alone names the job. The wait is
``same_job_wait_s``: at most half of ``elastic.collective_timeout_s``, so that the other ranks,
waiting in the broadcast of rank 0's decision, hear ``RunDirBusy`` before their collective
times out.

A filesystem without ``flock`` (``ENOLCK``, ``EOPNOTSUPP``, ``ENOSYS``: NFSv3 without lockd,
Lustre mounted without ``-o flock``, some FUSE filesystems) cannot keep one job per run dir:
``NoFlock``, one line naming the run dir and the filesystem problem (``nereus train`` exits 2).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

from nereus.launch import LAUNCH_ID_ENV, LAUNCHER_ENV, launcher_env, pid_alive  # noqa: F401 - the launcher's names, read here

LOCK_NAME = ".lock"
WORKERS_LOCK_NAME = ".lock.workers"
SAME_JOB_WAIT_S = 30.0
"""How long a worker waits, at most, for a lock its own job's previous round still holds (``same_job_wait_s``)."""
WORKER_LOCK_WAIT_S = 10.0
"""How long a worker tries for ``LOCK_SH`` on ``.lock.workers`` (an acquirer holds ``LOCK_EX`` for an instant only)."""
NO_FLOCK_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_READ_TRIES = 20  # a holder that just locked writes its record within milliseconds


DEFAULT_RUN_IDS = frozenset({"", "none"})
"""Run ids that name no job: torchrun's default ``--rdzv-id`` and an empty one (module docstring)."""


class RunDirBusy(RuntimeError):
    """The run dir is locked by a live job (its message: one line naming the holder)."""


class NoFlock(RuntimeError):
    """The run dir's filesystem does not implement ``flock`` (its message: one line)."""


def job_identity(run_id: str | None, launch: str | None = None) -> str | None:
    """The job a lock record names for the agent's run id ``run_id`` (pure): None for none,
    an empty one or torchrun's default ``none`` (any case, blanks around it), which many
    unrelated jobs share; else the id itself, qualified by the launch id ``launch`` when the
    rendezvous gave one (``<run id>@<launch>``: a reused ``--rdzv-id`` is another job)."""
    if run_id is None or run_id.strip().lower() in DEFAULT_RUN_IDS:
        return None
    return f"{run_id}@{launch}" if launch else run_id


def same_job_wait_s(collective_timeout_s: float) -> float:
    """How long rank 0 waits for its own job's previous round (pure): ``SAME_JOB_WAIT_S``,
    at most half the collective timeout the other ranks wait for its decision with."""
    return max(0.0, min(SAME_JOB_WAIT_S, collective_timeout_s / 2))


def no_flock_message(run_dir: str, err: OSError) -> str:
    """The one line for a run dir whose filesystem has no ``flock`` (pure)."""
    name = errno.errorcode.get(err.errno or 0, str(err.errno))
    return (f"run dir {run_dir} cannot be locked: its filesystem does not support flock ({name}: {err.strerror}); "
            "one job per run dir cannot be kept there: use a run dir on a local disk or on a filesystem with flock "
            "(NFSv4, Lustre mounted -o flock, GPFS)")


def _flock(fd: int, op: int, run_dir: str) -> None:
    """``flock``; a filesystem without it is ``NoFlock`` (BlockingIOError passes through)."""
    try:
        fcntl.flock(fd, op)
    except BlockingIOError:
        raise
    except OSError as e:
        if e.errno in NO_FLOCK_ERRNOS:
            raise NoFlock(no_flock_message(run_dir, e)) from None
        raise


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


def workers_message(run_dir: str, holder: Holder | None) -> str:
    """The one line an acquirer gets while workers of a job whose launcher is gone still
    hold ``.lock.workers`` (pure)."""
    who = f"its launcher was {holder.describe()}" if holder else "its launcher left no record"
    return (f"run dir {run_dir} is still written by workers of a job whose launcher is gone ({who}; lock "
            f"{os.path.join(run_dir, WORKERS_LOCK_NAME)} held): wait for them to exit, stop them, or use another --run-dir")


def stale_message(run_dir: str, holder: Holder | None, *, alive: bool | None, job: str | None = None) -> str:
    """The line logged when a dead holder's lock is taken over, once no worker of its holds
    ``.lock.workers`` either (pure). ``alive``: whether its pid runs (None: another host,
    not known); ``job``: the taker's (its own job's previous round held it: a restart)."""
    who = holder.describe() if holder else "an unreadable record"
    if waits_for(holder, job):
        return f"nereus: run dir {run_dir}'s lock passes from this job's previous round ({who}) to this one"
    if alive is None:
        why = "its holder no longer holds it"
    elif alive:
        why = "that pid runs but does not hold it (a reused pid)"
    else:
        why = "that process has exited"
    return f"nereus: took over the stale lock of run dir {run_dir} ({who}): {why}, and none of its workers holds the run dir"


class RunLock:
    """The exclusive lock of one run dir (module docstring). ``acquire`` then ``release``
    (or ``with``); ``acquire`` raises :class:`RunDirBusy` while a live job holds it."""

    def __init__(self, run_dir: str, job: str | None = None, launch: str | None = None) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_NAME)
        self.job = job_identity(job, launch)
        """The job it is taken for (``job_identity``: None when the run id names no job;
        ``<run id>@<launch>`` when the rendezvous gave a launch id)."""
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
                _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.run_dir)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                if waits_for(holder, self.job) and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                self._forget_dir()
                raise RunDirBusy(busy_message(self.run_dir, holder)) from None
            except NoFlock:
                if not os.fstat(fd).st_size and self._still_named(fd):
                    os.unlink(self.path)  # made just now: no lock can be held on this filesystem anyway
                os.close(fd)
                self._forget_dir()
                raise
            except BaseException:
                os.close(fd)
                self._forget_dir()
                raise
            if not self._still_named(fd):  # released and unlinked between our open and our flock: a new file
                os.close(fd)
                continue
            break
        previous = self._holder(fd, tries=1)
        try:
            while not self._workers_free():  # a dead launcher's workers still run (module docstring)
                if waits_for(previous, self.job) and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                raise RunDirBusy(workers_message(self.run_dir, previous))
        except BaseException:
            os.close(fd)  # the dead holder's record stays, for the next acquirer to name
            self._forget_dir()
            raise
        self.fd = fd
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

    def _workers_free(self) -> bool:
        """Whether no worker holds ``.lock.workers`` (``LOCK_EX|LOCK_NB``, dropped at once)."""
        try:
            fd = os.open(os.path.join(self.run_dir, WORKERS_LOCK_NAME), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except PermissionError:  # another user's 0644 file (made before it was 0666): a local flock needs no write
            fd = os.open(os.path.join(self.run_dir, WORKERS_LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return True  # no worker ever ran here (workers create it)
        try:
            _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.run_dir)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

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


_HELD: dict[str, int] = {}
"""This process's ``.lock.workers`` descriptors by run dir (held until it exits)."""


def hold_for_worker(run_dir: str, *, timeout_s: float = WORKER_LOCK_WAIT_S) -> None:
    """This worker's ``LOCK_SH`` on ``RUN_DIR/.lock.workers``, taken before it writes the run
    dir or its staging and held for the rest of the process's life — never released, so that
    a thread that outlives the worker's main one (its background staging) is still covered
    (module docstring). Idempotent. ``RunDirBusy`` when an acquirer's exclusive check holds it
    for ``timeout_s``; ``NoFlock`` on a filesystem without ``flock``."""
    run_dir = os.path.abspath(run_dir)
    if run_dir in _HELD:
        return
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, WORKERS_LOCK_NAME)
    fd = _open_workers_file(path)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                _flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, run_dir)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RunDirBusy(f"run dir {run_dir}: {path} stayed locked exclusively for {timeout_s:.0f}s (another "
                                     "job checking the run dir): stop it, or use another --run-dir") from None
                time.sleep(0.05)
    except BaseException:
        os.close(fd)
        raise
    _HELD[run_dir] = fd


def launch_of(value: str | None, run_id: str | None) -> str | None:
    """The launch id ``LAUNCH_ID_ENV``'s ``value`` names for the agent run ``run_id``, else
    None (unset, malformed, or another launch's) (pure)."""
    run, _, launch = (value or "").rpartition(":")
    return launch if launch and run_id is not None and run == run_id else None


def spawned_by(value: str | None, run_id: str | None) -> int | None:
    """The launcher's pid ``LAUNCHER_ENV`` names when it names this worker's own agent run
    ``run_id`` (``TORCHELASTIC_RUN_ID``), else None (unset, malformed, or inherited from
    another launch: under torchrun) (pure)."""
    pid, _, run = (value or "").partition(":")
    if not pid.isdecimal() or run_id is None or run != run_id:
        return None
    return int(pid)


def die_with_launcher() -> bool:
    """A worker that Nereus's launcher spawned (``LAUNCHER_ENV``) is SIGKILLed by the kernel
    when the launcher dies (``PR_SET_PDEATHSIG``, Linux; torch's own is a SIGINT, which a
    running staging thread outlived); one whose launcher is already gone exits at once.
    Returns whether it was armed (False: not spawned by our launcher, or not Linux)."""
    launcher = spawned_by(os.environ.get(LAUNCHER_ENV), os.environ.get("TORCHELASTIC_RUN_ID"))
    if launcher is None or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != launcher:  # it died before the prctl: no signal will come
        os._exit(1)
    return True


def _open_workers_file(path: str) -> int:
    """``.lock.workers`` for flock: made 0666 under the umask (a group-shared run dir stays
    usable by the group: the file is the lock, it holds nothing), read-only where another user
    made it without write for us (a local flock needs no write; NFS's emulation does)."""
    flags = os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, os.O_RDWR | flags, 0o666)
    except PermissionError:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)

