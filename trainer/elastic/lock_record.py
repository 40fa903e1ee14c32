"""The run dir lock's record and its one-line messages (pure): who holds ``RUN_DIR/.lock``, which
job that is, whether an acquirer waits for it, and what a refused acquirer or worker is told.
The mechanics (``flock``, waiting, the workers' lock) are ``run_lock``'s, which imports all of
this; its module docstring says why each rule is as it is.
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass

LOCK_NAME = ".lock"
WORKERS_LOCK_NAME = ".lock.workers"
SAME_JOB_WAIT_S = 30.0
"""How long a worker waits, at most, for a lock its own job's previous round still holds (``same_job_wait_s``)."""
DEFAULT_RUN_IDS = frozenset({"", "none"})
"""Run ids that name no job: torchrun's default ``--rdzv-id`` and an empty one (module docstring)."""


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


@dataclass(frozen=True, kw_only=True, slots=True)
class Holder:
    """Who holds (or held) a run dir's lock, as its record says."""

    host: str
    pid: int
    started: float
    job: str | None = None
    finished: float | None = None
    """When the job ended cleanly (``RunLock.keep_until_exit``); None while it runs, or when it died."""

    def describe(self) -> str:
        job = f", job {self.job}" if self.job else ""
        done = f", finished {_when(self.finished)}" if self.finished is not None else ""
        return f"pid {self.pid} on host {self.host}, started {_when(self.started)}{job}{done}"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def parse_holder(text: str) -> Holder | None:
    """A lock file's record (pure); None when empty or unreadable (a holder still writing it,
    or a file of another tool)."""
    try:
        d = json.loads(text)
        done = d.get("finished")
        return Holder(host=str(d["host"]), pid=int(d["pid"]), started=float(d["started"]), job=d.get("job"),
                      finished=None if done is None else float(done))
    except (ValueError, KeyError, TypeError):
        return None


def waits_for(holder: Holder | None, job: str | None) -> bool:
    """Whether an acquirer of job ``job`` waits for a live ``holder`` (pure): only when both
    name one job, and that job is an identity (``job_identity``: never torchrun's default
    ``none`` or an empty id, which unrelated jobs share)."""
    mine = job_identity(job)
    return holder is not None and mine is not None and job_identity(holder.job) == mine


def workers_wait(previous: Holder | None, job: str | None, until: float) -> float | None:
    """Until when an acquirer of job ``job`` waits for workers still holding ``.lock.workers``
    after ``previous`` held ``.lock`` (pure): ``until`` for a launcher's record (no job), a
    finished one, none, or its own job's previous round (``waits_for``); None — refused at once —
    for another job's rank 0 (its record names a job): that job's agent may be restarting it, and
    its next round must find the run dir as its last one left it."""
    if previous is None or previous.finished is not None or job_identity(previous.job) is None or waits_for(previous, job):
        return until
    return None


def busy_message(run_dir: str, holder: Holder | None, *, job: str | None = None, waited_s: float = 0.0) -> str:
    """The one line an acquirer of job ``job`` gets while ``holder`` holds ``.lock`` (pure): a
    finished holder is one still exiting; one of ``job`` itself (``waits_for``) is its previous
    round's rank 0, which did not let go within ``waited_s``; else another job."""
    lock = os.path.join(run_dir, LOCK_NAME)
    if holder is not None and holder.finished is not None:
        return (f"run dir {run_dir} is still locked by a finished job that has not exited yet ({holder.describe()}; lock "
                f"{lock}): wait for it to exit, stop it, or use another --run-dir")
    if waits_for(holder, job):
        return (f"run dir {run_dir}: this job's previous round's rank 0 ({holder.describe()}; lock {lock}) did not exit "
                f"within {waited_s:.0f}s: stop it, or use another --run-dir")
    who = holder.describe() if holder else "a process that has not written its record yet"
    return (f"run dir {run_dir} is in use by another job ({who}; lock {lock}): wait for it to finish, stop it, "
            "or use another --run-dir")


def workers_message(run_dir: str, holder: Holder | None, *, job: str | None = None, held_by: str = "",
                    waited_s: float = 0.0) -> str:
    """The one line an acquirer gets while workers still hold ``.lock.workers`` after it waited
    ``waited_s`` (pure): ``holder``, the previous holder of ``.lock`` (gone: the acquirer got it),
    finished (its workers are still exiting), of the acquirer's own ``job`` (``waits_for``: its
    previous round's workers), another job's rank 0 (its record names a job: that job's agent may
    be restarting it; not waited for), else a job whose launcher is gone; ``held_by``: who holds
    it (``lock_holders.describe_pids``; "" when not known)."""
    held = f"; held by {held_by}" if held_by else ""
    where = f"lock {os.path.join(run_dir, WORKERS_LOCK_NAME)} held" + (f" after {waited_s:.0f}s" if waited_s >= 1 else "")
    if holder is not None and holder.finished is not None:
        return (f"run dir {run_dir}: a finished job's workers are still exiting (the job was {holder.describe()}{held}; "
                f"{where}): wait for them to exit, stop them, or use another --run-dir")
    if waits_for(holder, job):
        return (f"run dir {run_dir} is still written by workers of this job's previous round ({holder.describe()}{held}; "
                f"{where}): they did not exit; stop them, or use another --run-dir")
    if holder is not None and holder.job:
        return (f"run dir {run_dir}: workers of job {holder.job}, whose rank 0 (pid {holder.pid} on host {holder.host}) is "
                f"gone, still hold the run dir (its record: {holder.describe()}{held}; {where}): that job may be restarting "
                "them; wait for it to end, stop it, or use another --run-dir")
    who = f"its launcher was {holder.describe()}" if holder else "its launcher left no record"
    return (f"run dir {run_dir} is still written by workers of a job whose launcher is gone ({who}{held}; {where}): "
            "wait for them to exit, stop them, or use another --run-dir")


def waiting_message(run_dir: str, holder: Holder | None, wait_s: float, *, job: str | None = None) -> str:
    """The line logged once when an acquirer of job ``job`` starts waiting for ``.lock.workers`` (pure)."""
    if holder is not None and holder.finished is not None:
        whose = "a finished job"
    elif waits_for(holder, job):
        whose = "this job's previous round"
    elif holder is not None and holder.job:
        whose = f"job {holder.job}, whose rank 0 is gone,"
    else:
        whose = "the previous job"
    return (f"nereus: run dir {run_dir}: waiting up to {wait_s:.0f}s for the workers of {whose} to exit (lock "
            f"{os.path.join(run_dir, WORKERS_LOCK_NAME)} held)")


def own_record(holder: Holder | None, *, host: str, pids: set[int] | frozenset, job: str | None) -> bool:
    """Whether ``.lock``'s record ``holder`` is this worker's job's (pure): taken on this
    ``host`` by this process or the launcher that spawned it (``pids``), or naming this
    worker's ``job`` (``job_identity``) — where that is none (torchrun's default run id) a
    record of no job is taken for its own, nothing tells two such jobs apart. A finished
    job's record, or none, never is."""
    if holder is None or holder.finished is not None:
        return False
    if holder.host == host and holder.pid in pids:
        return True
    return job_identity(holder.job) == job


def not_own_message(run_dir: str, holder: Holder | None) -> str:
    """The one line a worker stops with when ``.lock`` is not its job's (pure)."""
    who = holder.describe() if holder else "no record"
    return (f"run dir {run_dir} is locked by another job ({who}; lock {os.path.join(run_dir, LOCK_NAME)}): "
            "this worker's job does not hold it, so the worker stops before writing anything")


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
