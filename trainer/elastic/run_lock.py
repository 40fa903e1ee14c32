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
  and holds it until its process exits (``keep_until_exit``: not when ``run_worker`` returns,
  since its staging thread and other nodes' ranks may still be exiting; the kernel drops it,
  and the record of a job that ended says ``finished``); each round's rank 0 takes it again. Between two rounds nobody
  holds it — the agent stops the old ranks, rendezvouses again, spawns the new ones and they form
  the process group: tens of seconds (a gap, below); the record names the job (``job_identity`` of the agent's
  ``TORCHELASTIC_RUN_ID``), and a rank 0 finding it held by its own job (the previous
  round's rank 0, still being stopped) waits up to ``SAME_JOB_WAIT_S`` for it
  (``waits_for``). A busy run dir there is an exception on every rank (``RunDirBusy``: the
  worker exits non-zero, the agent counts a failed round and restarts while it may, so a
  lock a lost host's NFS client still holds is tried again; the last round's error names the
  run dir and the holder in one line). Across hosts the lock holds where the shared
  filesystem implements ``flock`` between clients (NFSv4, Lustre mounted ``-o flock``,
  GPFS); with a node-local one (Lustre ``-o localflock``, NFS mounted ``-o local_lock=flock``
  or ``all``) it excludes jobs on one host only, and a filesystem without ``flock`` is refused
  (``NoFlock``, below).

Same job: the rendezvous id is the job's identity only when the launch gave one. torchrun's
default ``--rdzv-id`` is the literal ``none`` (and an empty one names nothing): every job
launched without one would share it, so such a run id is no identity (``job_identity`` ->
None, recorded as no job) and a holder is then always another job — no waiting, the round
fails at once with ``RunDirBusy`` and the agent's restart is the retry. ``nereus train``
always has one of its own (``--rdzv-id``, required on several nodes; a fresh uuid on one).

The record (one JSON line: host, pid, start time, job; ``finished`` once the job ended) is
written into the file once it is locked, before the workers' check below. The launcher's clean
release unlinks the file while still holding it, then closes it; so an acquirer re-checks that
the path still names the inode it locked, else retries — two holders never coexist. The kernel
releases a dead holder's ``flock``: the next acquirer finds its record (a clean release leaves
none), takes the lock over and logs one line naming it (stale) — quietly when it is a finished
job's. A finished holder still exiting is waited for like its workers (below).

Workers of a dead launcher (``RUN_DIR/.lock.workers``). The kernel drops the launcher's
``flock`` when the launcher alone is SIGKILLed, while its workers may still write the run dir
and its staging (torch gives them SIGINT when their parent dies, and a worker's background
staging thread outlived it). So every worker takes ``LOCK_SH`` on ``.lock.workers`` (opened
``O_CLOEXEC``) before it writes anything and holds it for the rest of its process's life
(``hold_for_worker``, from ``restore.agree_start``), and an acquirer of ``.lock`` must also get
``LOCK_EX|LOCK_NB`` on ``.lock.workers`` — it only checks, and drops it at once, so its own
workers (started later, while it holds ``.lock``) take theirs. While it is held the acquirer
puts the previous record back, lets go of ``.lock`` and tries again from the ``flock``, polling,
at most ``acquire``'s ``wait_workers_s`` (the launcher: ``WORKERS_EXIT_WAIT_S``; rank 0:
``same_job_wait_s``), since workers tear down after their launcher or their rank 0 (a resume
right after a SIGKILL or a clean end); then ``RunDirBusy``, one line saying whose workers they
are (a dead launcher's, a finished job's, this job's previous round's) and naming the holders'
pids (``lock_holders``). It never waits holding ``.lock``: a waiting ``resume`` would keep a
restarting job's next rank 0 out (refused at once: not its job's record) and win when the old
ranks exit. Workers of another job's rank 0 (a record naming a job, not finished: its agent may
be restarting it) are not waited for at all: refused at once (``workers_wait``), so such a job's
next round finds the run dir as its last one left it. An acquirer that may wait rides out, for
``CHECK_GRACE_S`` and then for as long as it waits, a ``.lock`` another acquirer holds for its
instant check. The gap: once the old ranks are gone and before the next rank 0 locks (tens of
seconds), nothing holds either file, and another job's acquirer takes the run dir over (its
record's rank 0 is gone); under plain torchrun with its default run id the record names no job
and reads like a launcher's, so such an acquirer also waits for the old ranks, racing the next
round's rank 0. Our launcher's workers also die with it (``die_with_launcher``:
``PR_SET_PDEATHSIG`` = SIGKILL on Linux). ``.lock.workers`` is never unlinked (a worker may hold
it; a new inode would split the lock): a 0-byte file of that name stays in the run dir.

A dying job's late rank can take ``LOCK_SH`` just after a new job's check: so the acquirer writes
its record before it checks, and a worker reads the record once it holds ``LOCK_SH`` and stops
(``RunDirBusy``, one line) unless it is its own job's (``own_record``: its launcher's or its own
pid on its host, or its job) — before it writes anything, its staging included.

Forked children (a reward pool, a DataLoader's workers: fork without exec, which ``O_CLOEXEC``
does not cover) share the lock's open file description: an orphan would keep a dead job's lock
for ever. Every fork closes the child's copies of this process's lock descriptors
(``os.register_at_fork``); a child's ``RunLock`` forgets its lock, so it never unlinks it.

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
``NoFlock``, one line naming the run dir and the filesystem problem (``nereus train`` and
``resume`` exit 2 on one node; on several nodes and under torchrun rank 0's worker fails with it:
exit 1).
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

from nereus.launch import LAUNCH_ID_ENV, LAUNCHER_ENV, launcher_env, pid_alive  # noqa: F401 - the launcher's names, read here

from .lock_holders import describe_pids, holders
from .lock_record import (DEFAULT_RUN_IDS, LOCK_NAME, SAME_JOB_WAIT_S, WORKERS_LOCK_NAME, Holder,  # noqa: F401 - re-exported
                          busy_message, job_identity, launch_of, no_flock_message, not_own_message, own_record, parse_holder, same_job_wait_s,
                          spawned_by, stale_message, waiting_message, waits_for, workers_message, workers_wait)

WORKERS_EXIT_WAIT_S = 30.0
"""How long the launcher's acquire waits, at most, for a previous job's exiting workers and a finished
holder (a worker's waits ``same_job_wait_s``)."""
WORKER_LOCK_WAIT_S = 10.0
"""How long a worker tries for ``LOCK_SH`` on ``.lock.workers`` (an acquirer holds ``LOCK_EX`` for an instant only)."""
NO_FLOCK_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
POLL_S = 0.2
"""How often a waiting acquirer tries again (from the ``flock``: it holds nothing meanwhile)."""
CHECK_GRACE_S = 1.0
"""How long an acquirer that may wait rides out a lock held by another acquirer's check (an instant)."""
_READ_TRIES = 20  # a holder that just locked writes its record within milliseconds


class RunDirBusy(RuntimeError):
    """The run dir is locked by a live job (its message: one line naming the holder)."""


class NoFlock(RuntimeError):
    """The run dir's filesystem does not implement ``flock`` (its message: one line)."""


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
        self._made_dirs: list[str] = []
        self.kept = False
        """``keep_until_exit`` was called: held until the process exits."""

    def acquire(self, *, wait_same_job_s: float = 0.0, wait_workers_s: float | None = None) -> RunLock:
        """Take the lock now. Waited for, all within one bound from the call on: a holder of the
        same job (``waits_for``), up to ``wait_same_job_s``; a finished holder not yet exited and
        workers still holding ``.lock.workers``, up to ``wait_workers_s`` (None:
        ``wait_same_job_s`` when given — a worker's acquire, which the other ranks wait for in a
        collective — else ``WORKERS_EXIT_WAIT_S``) — but never another job's rank 0's workers
        (``workers_wait``). Nothing is waited for while holding ``.lock``: a busy check puts the
        previous record back, lets go and tries again from the ``flock``. This job's record is
        written before the workers' check (``hold_for_worker``). A stale record is taken over
        (``took_over``, logged on stderr); a finished job's quietly."""
        if wait_workers_s is None:
            wait_workers_s = wait_same_job_s if wait_same_job_s > 0 else WORKERS_EXIT_WAIT_S
        self._make_dirs()
        start = time.monotonic()
        same_until, exit_until = start + wait_same_job_s, start + max(wait_same_job_s, wait_workers_s)
        # a rank 0 with a job of its own rides out another acquirer's instant check; once waiting, every acquirer does
        patient_until = start + min(CHECK_GRACE_S, wait_same_job_s) if self.job else start
        told = False
        try:
            while True:
                fd, holder = self._try_lock()
                now = time.monotonic()
                if fd is None:
                    if (waits_for(holder, self.job) and now < same_until) or now < patient_until or \
                            (holder is not None and holder.finished is not None and now < exit_until):
                        time.sleep(POLL_S)
                        continue
                    raise RunDirBusy(busy_message(self.run_dir, holder, job=self.job, waited_s=wait_same_job_s))
                before = os.pread(fd, 4096, 0)
                previous = parse_holder(before.decode(errors="replace"))
                try:
                    # first the record: a dying job's late worker taking LOCK_SH after the check reads it and stops
                    self._write(fd, {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "job": self.job})
                    free = self._workers_free()
                except BaseException:
                    self._put_back(fd, before)
                    raise
                if free:
                    break
                self._put_back(fd, before)  # let go before waiting: this job's next round, or a resume, may come first
                until = workers_wait(previous, self.job, exit_until)
                now = time.monotonic()
                if until is None or now >= until:
                    held_by = describe_pids(holders(os.path.join(self.run_dir, WORKERS_LOCK_NAME)))
                    waited = until - start if until is not None else 0.0
                    raise RunDirBusy(workers_message(self.run_dir, previous, job=self.job, held_by=held_by, waited_s=waited))
                if not told:
                    print(waiting_message(self.run_dir, previous, until - now, job=self.job), file=sys.stderr, flush=True)
                    told = True
                patient_until = max(patient_until, until)
                time.sleep(POLL_S)
        except BaseException:
            self._forget_dir()
            raise
        self.fd = fd
        _LOCKS.add(self)
        if before.strip() and (previous is None or previous.finished is None):
            alive = pid_alive(previous.pid) if previous and previous.host == socket.gethostname() else None
            self.took_over = stale_message(self.run_dir, previous, alive=alive, job=self.job)
            print(self.took_over, file=sys.stderr, flush=True)
        return self

    def _make_dirs(self) -> None:
        """Make the run dir and its missing parents, each kept (deepest first) for ``_forget_dir``."""
        missing, d = [], self.run_dir
        while not os.path.isdir(d) and os.path.dirname(d) != d:
            missing.append(d)
            d = os.path.dirname(d)
        os.makedirs(self.run_dir, exist_ok=True)
        self._made_dirs = missing

    def _try_lock(self) -> tuple[int | None, Holder | None]:
        """``LOCK_EX|LOCK_NB`` on ``.lock`` (made if missing): its descriptor, or None and the
        holder's record while another holds it; tried again when the file was released and
        unlinked between the open and the flock (a new file); ``NoFlock`` leaves no file it made."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.run_dir)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                return None, holder
            except NoFlock:
                if not os.fstat(fd).st_size and self._still_named(fd):
                    os.unlink(self.path)  # made just now: no lock can be held on this filesystem anyway
                os.close(fd)
                raise
            except BaseException:
                os.close(fd)
                raise
            if self._still_named(fd):
                return fd, None
            os.close(fd)

    def _put_back(self, fd: int, before: bytes) -> None:
        """Undo this acquire's record and let go: the previous holder's record back (for the next
        acquirer to name), or no file when there was none (unlinked while still locked)."""
        try:
            if before.strip():
                os.ftruncate(fd, 0)
                os.pwrite(fd, before, 0)
            elif self._still_named(fd):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)

    @staticmethod
    def _write(fd: int, record: dict) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)

    def keep_until_exit(self, *, finished: bool) -> None:
        """Hold the lock until this process exits (the kernel drops it then), never unlinked:
        global rank 0's worker, whose threads (a staging write) and whose job's other ranks may
        still be exiting. ``finished``: the job ended — its record says so (``Holder.finished``),
        and an acquirer waits for it and its workers, then takes it over quietly. ``release``
        does nothing afterwards."""
        if self.fd is None:
            return
        self.kept = True
        if finished:
            try:  # a record that cannot be marked only costs the next acquirer its "finished" line
                record = parse_holder(os.pread(self.fd, 4096, 0).decode(errors="replace"))
                if record is not None:
                    self._write(self.fd, {"host": record.host, "pid": record.pid, "started": record.started,
                                          "job": record.job, "finished": time.time()})
            except OSError:
                pass

    def release(self) -> None:
        """Unlink the file while holding it, then close it (module docstring); the run dir
        and its parents too where this lock made them and nothing else is in them. Nothing after ``keep_until_exit``."""
        if self.fd is None or self.kept:
            return
        fd, self.fd = self.fd, None
        _LOCKS.discard(self)
        try:
            if self._still_named(fd):
                os.unlink(self.path)
        finally:
            os.close(fd)
        self._forget_dir()

    def _forget_dir(self) -> None:
        """Remove the directories ``_make_dirs`` made, deepest first, while they are empty: a run
        refused before it wrote anything leaves none behind."""
        made, self._made_dirs = self._made_dirs, []
        for d in made:
            try:
                os.rmdir(d)
            except OSError:
                break

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
_LOCKS: set[RunLock] = set()
"""This process's held ``RunLock``s (their descriptors are closed in a forked child)."""


def _drop_in_child() -> None:
    """In a child forked from this process (a reward pool's, a DataLoader's worker: fork
    without exec, which ``O_CLOEXEC`` does not cover): close the inherited descriptors of the
    run dir's locks. A flock belongs to the open file description the fork shares, so an
    orphaned child would hold the dead job's lock forever; closing its own copies leaves the
    parent's lock as it is (no ``LOCK_UN``), and the child's ``RunLock`` forgets it (its
    ``release`` cannot unlink the parent's file)."""
    for lock in list(_LOCKS):
        if lock.fd is not None:
            try:
                os.close(lock.fd)
            except OSError:
                pass
            lock.fd = None
    for fd in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)


def worker_identity() -> tuple[frozenset[int], str | None]:
    """This worker's ``own_record`` ``pids`` (itself, and the Nereus launcher that spawned it)
    and ``job`` (its agent run and launch, as rank 0's record names them), from the environment."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    launcher = spawned_by(os.environ.get(LAUNCHER_ENV), run)
    pids = frozenset({os.getpid()} | ({launcher} if launcher is not None else set()))
    return pids, job_identity(run, launch_of(os.environ.get(LAUNCH_ID_ENV), run))


def read_record(run_dir: str) -> Holder | None:
    """``RUN_DIR/.lock``'s record (None: no file, or none readable in it)."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return parse_holder(os.pread(fd, 4096, 0).decode(errors="replace"))
    finally:
        os.close(fd)


def hold_for_worker(run_dir: str, *, timeout_s: float = WORKER_LOCK_WAIT_S, check: bool = True) -> None:
    """This worker's ``LOCK_SH`` on ``RUN_DIR/.lock.workers``, taken before it writes the run
    dir or its staging and held for the rest of the process's life — never released, so that
    a thread that outlives the worker's main one (its background staging) is still covered
    (module docstring). Idempotent. ``RunDirBusy`` when an acquirer's exclusive check holds it
    for ``timeout_s``, and (``check``) when, once it is held, ``.lock``'s record is not this
    worker's job's (``own_record``: a late worker of a dying job, after another job took the
    run dir) — the lock is then let go; ``NoFlock`` on a filesystem without ``flock``."""
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
        if check:  # the acquirer wrote its record before its check: read after LOCK_SH, it is the holder's
            pids, job = worker_identity()
            record = read_record(run_dir)
            if not own_record(record, host=socket.gethostname(), pids=pids, job=job):
                raise RunDirBusy(not_own_message(run_dir, record))
    except BaseException:
        os.close(fd)
        raise
    _HELD[run_dir] = fd


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

