"""Who holds a lock file on this host, as ``/proc`` tells: ``run_lock``'s refusals name them.

A ``flock`` belongs to an open file description, which a fork shares: a child forked by a
worker (a reward pool's process, a DataLoader's worker) that outlives it keeps the lock, and
``/proc/locks`` still names the pid that took it — the dead worker. So the holders are looked
for first among this host's processes' open files: a process with a descriptor of the file
(``/proc/PID/fd``) whose ``fdinfo`` carries a ``lock:`` line holds it (``fd_holders``). Other
users' processes cannot be looked into: then the pids ``/proc/locks`` names that still run are
given (``lock_pids``). Nothing where ``/proc`` is missing (not Linux), for a holder on another
host (a shared filesystem's lock), or in another pid namespace (``/proc/locks`` shows its pid as
0 there): the refusal is then worded without pids.
"""

from __future__ import annotations

import os

PROC = "/proc"
_MAX_NAMED = 8  # a refusal names at most this many pids (a big job's ranks: the rest are counted)


def lock_pids(text: str, dev: int, ino: int) -> list[int]:
    """The pids ``/proc/locks``'s ``text`` names for locks held on the file ``(dev, ino)``
    (pure): sorted, once each; blocked waiters (``->``) and unknown pids (0, -1: another pid
    namespace's, an OFD lock's) left out."""
    pids: set[int] = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":
            continue
        where = fields[5].split(":")
        try:
            pid = int(fields[4])
            same = len(where) == 3 and \
                (int(where[0], 16), int(where[1], 16), int(where[2])) == (os.major(dev), os.minor(dev), ino)
        except ValueError:
            continue
        if same and pid > 0:
            pids.add(pid)
    return sorted(pids)


def fd_holders(path: str, proc: str = PROC) -> list[int]:
    """The processes of this host, among those whose open files can be read, that hold a lock
    on ``path`` through a descriptor of theirs (sorted)."""
    try:
        st = os.stat(path)
        entries = os.listdir(proc)
    except OSError:
        return []
    want = (st.st_dev, st.st_ino)
    holders = []
    for entry in entries:
        if not entry.isdecimal():
            continue
        fd_dir = os.path.join(proc, entry, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # exited, or another user's
            continue
        for fd in fds:
            try:
                target = os.stat(os.path.join(fd_dir, fd))
                if (target.st_dev, target.st_ino) != want:
                    continue
                with open(os.path.join(proc, entry, "fdinfo", fd)) as f:
                    if any(line.startswith("lock:") for line in f):
                        holders.append(int(entry))
                        break
            except OSError:
                continue
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
