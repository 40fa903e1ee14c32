"""Who holds a lock file on this host, as ``/proc`` tells: ``run_lock``'s refusals name them.

A ``flock`` belongs to an open file description, which a fork shares: a child forked by a
worker (a reward pool's process, a DataLoader's worker) that outlives it keeps the lock, and
``/proc/locks`` still names the pid that took it — the dead worker. So the holders are looked
for first among this host's processes' open files: a process holds it when one of its
descriptors' ``/proc/PID/fdinfo/FD`` carries a ``lock:`` line on the file's ``dev:ino``
(``fd_holders``). Only procfs is read: no descriptor's target is stat'ed, so a process with a
file open on a hung NFS mount cannot block the walk; the walk runs only when ``/proc/locks``
has a lock on the file, and stops after ``WALK_S`` (a host with very many processes). Other
users' processes cannot be looked into: then the pids ``/proc/locks`` names that still run are
given (``lock_pids``). Nothing where ``/proc`` is missing (not Linux), for a holder on another
host (a shared filesystem's lock), or in another pid namespace (``/proc/locks`` shows its pid as
0 there): the refusal is then worded without pids.
"""

from __future__ import annotations

import os
import time

PROC = "/proc"
_MAX_NAMED = 8  # a refusal names at most this many pids (a big job's ranks: the rest are counted)
WALK_S = 2.0  # fd_holders looks no longer than this


def _lock_fields(line: str) -> tuple[int, tuple[int, int, int]] | None:
    """``(pid, (major, minor, ino))`` of one held lock in ``/proc/locks``'s format (``fdinfo``'s
    ``lock:`` lines, past that word, have it too) (pure); None for a blocked waiter (``->``) or
    a line that is not one."""
    fields = line.split()
    if len(fields) < 6 or fields[1] == "->":
        return None
    where = fields[5].split(":")
    try:
        return int(fields[4]), (int(where[0], 16), int(where[1], 16), int(where[2])) if len(where) == 3 else None
    except ValueError:
        return None


def _key(dev: int, ino: int) -> tuple[int, int, int]:
    return os.major(dev), os.minor(dev), ino


def lock_pids(text: str, dev: int, ino: int) -> list[int]:
    """The pids ``/proc/locks``'s ``text`` names for locks held on the file ``(dev, ino)``
    (pure): sorted, once each; blocked waiters (``->``) and unknown pids (0, -1: another pid
    namespace's, an OFD lock's) left out."""
    want = _key(dev, ino)
    return sorted({lock[0] for lock in map(_lock_fields, text.splitlines()) if lock and lock[1] == want and lock[0] > 0})


def _locked(text: str, dev: int, ino: int) -> bool:
    """Whether ``/proc/locks``'s ``text`` has any lock held on ``(dev, ino)``, whoever's (pure)."""
    want = _key(dev, ino)
    return any(lock and lock[1] == want for lock in map(_lock_fields, text.splitlines()))


def fd_holders(path: str, proc: str = PROC, walk_s: float = WALK_S) -> list[int]:
    """The processes of this host, among those whose open files can be read, that hold a lock
    on ``path`` through a descriptor of theirs (sorted; those found within ``walk_s``)."""
    try:
        st = os.stat(path)
        with open(os.path.join(proc, "locks")) as f:
            if not _locked(f.read(), st.st_dev, st.st_ino):
                return []  # nobody holds it: no walk
        entries = os.listdir(proc)
    except OSError:
        return []
    want, deadline, holders = _key(st.st_dev, st.st_ino), time.monotonic() + walk_s, []
    for entry in entries:
        if not entry.isdecimal():
            continue
        if time.monotonic() > deadline:
            break
        info_dir = os.path.join(proc, entry, "fdinfo")
        try:
            fds = os.listdir(info_dir)
        except OSError:  # exited, or another user's
            continue
        for fd in fds:
            try:
                with open(os.path.join(info_dir, fd)) as f:
                    locks = [_lock_fields(line[len("lock:"):]) for line in f if line.startswith("lock:")]
            except OSError:
                continue
            if any(lock and lock[1] == want for lock in locks):
                holders.append(int(entry))
                break
    return sorted(holders)


def holders(path: str, proc: str = PROC) -> list[int]:
    """Who holds a lock on ``path`` on this host (module docstring); [] when it cannot be told."""
    found = fd_holders(path, proc)
    if found:
        return found
    try:
        st = os.stat(path)
        with open(os.path.join(proc, "locks")) as f:
            text = f.read()
    except OSError:
        return []
    return [pid for pid in lock_pids(text, st.st_dev, st.st_ino) if os.path.exists(os.path.join(proc, str(pid)))]


def describe_pids(pids: list[int], proc: str = PROC) -> str:
    """``pid 12 (python3), pid 34 (python3)``: each with its command name where it can be read,
    at most ``_MAX_NAMED`` of them, the rest counted (``""`` for none)."""
    named = []
    for pid in pids[:_MAX_NAMED]:
        try:
            with open(os.path.join(proc, str(pid), "comm")) as f:
                named.append(f"pid {pid} ({f.read().strip()})")
        except OSError:
            named.append(f"pid {pid}")
    more = len(pids) - len(named)
    return ", ".join(named) + (f" and {more} more" if more > 0 else "")
