"""Run a function on N local worker processes, or as one worker under torchrun.

On one machine Nereus starts its own workers through torch.distributed's elastic
launcher (the API behind ``torchrun``): spawn start method (tensorstore aborts in forked
children), c10d rendezvous (on a free loopback port, or ``--rdzv-endpoint`` for several
nodes). With ``max_restarts`` > 0 the agent restarts every worker when one dies (and
re-forms the group when nodes join or leave, between ``MIN:MAX`` nodes); the workers then
restore the newest valid state (``trainer/elastic/staging.py``). Under an existing ``torchrun``
(``RANK``/``WORLD_SIZE`` already set, multi-node) the caller runs the worker function in
its own process instead: torchrun's own agent restarts it.

Deadlines: every collective of the workers has ``elastic.collective_timeout_s``; the
agent's rendezvous waits ``join_timeout_s``, longer (``rendezvous_timeout``), so a dead
peer fails the survivors' collectives and becomes a restart, never a hang. Once ``MIN``
nodes are in, a rendezvous waits ``elastic.last_call_s`` more for others (torchrun's
``last_call_timeout``, 30 s by default).

Every rendezvous round publishes the workers' store (``publish_store_every_round``): torch's
dynamic rendezvous with TCP store sharing writes its address only in a node's first round
(and the first time a node becomes rank 0), so a node joining a running job waited for keys
no one wrote, and both sides failed after 60 s. The agent also hands its workers the
rendezvous round (``RDZV_ROUND_ENV``; 0: the launch's first), which tells a restart from a
fresh start even when the workers' store is new (a node that sorts before the old rank 0
joined and hosts it now). Under torchrun the same wrapper comes with the rendezvous backend
``nereus`` (``nereus/rendezvous.py``, registered through torch's ``torchrun.handlers`` entry
point): ``torchrun --rdzv-backend nereus``.

A worker that is stopped (SIGSTOP, a debugger) ignores the SIGTERM its group is stopped
with when a peer failed (torch.multiprocessing's ``ProcessContext.join``) or when the agent
stops it (``PContext.close``), and torch 2.13 then waits 30 s before its SIGKILL, on every
restart (the agent's ``shutdown_timeout`` reaches only its final shutdown): a hung worker cost
collective_timeout_s + 30 s + the restart. ``continue_on_close`` sends SIGCONT to the
group's live processes as those waits begin, so the SIGTERM acts at once (a SIGCONT to a
running process does nothing). Installed with ``publish_store_every_round``, so under
``torchrun --rdzv-backend nereus`` too.

Semaphores: torch's agent makes multiprocessing semaphores for every start of the workers
(a ``SimpleQueue`` per worker and an ``Event``: 7 for one worker, 13 for four), named files in
``/dev/shm`` (``sem.mp-XXXX``). A clean exit unlinks them, and so does the launcher's resource
tracker when the launcher alone dies; a SIGKILL of the whole process group (the tracker with
it) leaves them until reboot. ``launch_local(..., shm_tag=...)`` names them
``sem.nereus-<tag>.<key>-XXXX`` (``named_semaphores``: the ``semprefix`` CPython's
``multiprocessing`` reads from the process's config; spawned children inherit it), ``key`` being
the launcher's ``<pid>.<8 hex>``, and the launcher holds ``LOCK_EX`` on a sentinel
``nereus-<tag>.<key>.launcher`` in ``/dev/shm`` for its life (``hold_sentinel``; unlinked at
exit). Every later launch on the same run dir, on one node or several, removes what a killed one
left on its node: the semaphores and sentinel of every key whose sentinel is unlocked, and
unlocked temporary sentinels (``remove_stale_semaphores``); so does every launch as it ends (a
node's launcher SIGKILLed on this host while the job went on, which no later launch may follow).
Liveness is the lock, never the pid:
a ``/dev/shm`` shared across pid namespaces (containers run ``--ipc=host``) holds other namespaces' launchers, whose pids mean
nothing here. Files without a sentinel (an older Nereus's ``sem.nereus-<tag>-XXXX`` and
``sem.nereus-<tag>.<pid>-XXXX``) go only under the run dir's lock, on one node. Under torchrun
its own agent makes them, named as torch does (``sem.mp-*``): Nereus cannot tell them from other
programs' and leaves them.

Workers and their launcher: the launcher hands its workers ``NEREUS_LAUNCHER`` (its pid and
the agent run id), and each worker asks the kernel for SIGKILL when the launcher dies
(``run_lock.die_with_launcher``), so a SIGKILLed launcher leaves no worker writing the run dir.
Every round also hands the workers the launch's id (``NEREUS_LAUNCH_ID``, ``launch_id``), by
which the run dir's lock tells this launch's rounds from another launch reusing its ``--rdzv-id``.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import logging
import os
import re
import socket
from typing import Any, Callable, Iterator

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def under_torchrun() -> bool:
    """True inside a process that torchrun (or another elastic agent) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_nnodes(text: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` -> (min, max); ValueError naming the flag."""
    lo, sep, hi = str(text).partition(":")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ValueError(f"--nnodes {text!r}: expected N or MIN:MAX (integers), e.g. 1:2") from None
    if low < 1 or high < low:
        raise ValueError(f"--nnodes {text!r}: needs 1 <= MIN <= MAX")
    return low, high


RDZV_ROUND_ENV = "NEREUS_RDZV_ROUND"
LAUNCH_ID_ENV = "NEREUS_LAUNCH_ID"
"""``<rdzv id>:<launch id>``: the launch id the rendezvous store gave every round of this
launch (``publish_store_every_round``); trainer/elastic/run_lock.py reads it."""
LAUNCHER_ENV = "NEREUS_LAUNCHER"
"""``<pid>:<rdzv id>`` of the Nereus launcher that spawned this worker (``run_lock.die_with_launcher``)."""


def launcher_env(run_id: str) -> str:
    """``LAUNCHER_ENV``'s value for this process launching the agent run ``run_id``."""
    return f"{os.getpid()}:{run_id}"



def publish_store_every_round() -> None:
    """Wrap torch's ``DynamicRendezvousHandler.next_rendezvous`` (once per process) so that
    in every round rank 0 writes the address of the workers' store under the round's keys and
    every other rank reads it from them, and the round number reaches the workers
    (``RDZV_ROUND_ENV`` = ``<run id>:<round>`` in the agent's environment, which its workers
    inherit; a worker trusts it only under the same ``TORCHELASTIC_RUN_ID``).

    torch 2.13 builds that address once per handler (again only when a node first becomes
    rank 0): a node's later rounds reuse it, so rank 0 never writes it for a round a new
    node joins (the new node waits for it, rank 0 for the new node's role info: a
    ``DistStoreError`` on both after 60 s), and a node whose rank 0 changed would keep
    pointing at its old store."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

    real = dr.DynamicRendezvousHandler.next_rendezvous
    if getattr(real, "nereus_wrapped", False):
        return

    def next_rendezvous(self):
        info = real(self)
        os.environ[RDZV_ROUND_ENV] = f"{self._settings.run_id}:{self._state_holder.state.round}"
        launch = launch_id(self)
        if launch:
            os.environ[LAUNCH_ID_ENV] = f"{self._settings.run_id}:{launch}"
        if not self.use_agent_store:
            return info
        keys = RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY
        if info.rank == 0:  # this node's own server (torch made one when it first was rank 0), never a cached address
            here = RendezvousStoreInfo(master_addr=self._this_node.addr, master_port=self._shared_tcp_store_server.port)
            info.store.set(keys[0], here.master_addr.encode())
            info.store.set(keys[1], str(here.master_port).encode())
            self._bootstrap_store_info = here
            return RendezvousInfo(info.store, info.rank, info.world_size, here)
        addr, port = (info.store.get(k).decode() for k in keys)  # this round's rank 0's; not kept for a later round
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(master_addr=addr, master_port=int(port)))

    next_rendezvous.nereus_wrapped = True
    dr.DynamicRendezvousHandler.next_rendezvous = next_rendezvous
    continue_on_close()


def launch_id(handler) -> str | None:
    """This launch's id, the same for every round and node of it: set once in the rendezvous
    store (``compare_set``: the first agent's wins), which lives as long as the launch — a
    new launch reusing a ``--rdzv-id`` meets a new store, so a new id (``run_lock``'s same
    job). None when the store cannot tell (another backend's)."""
    import uuid

    cached = getattr(handler, "_nereus_launch_id", None)
    if cached:
        return cached
    try:
        import torch.distributed as dist

        store = dist.PrefixStore(f"nereus.launch.{handler._settings.run_id}", handler._store)
        value = store.compare_set("id", "", uuid.uuid4().hex[:12])
        value = value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # noqa: BLE001 - no launch id: the rdzv id alone names the job
        return None
    handler._nereus_launch_id = value or None
    return handler._nereus_launch_id


def continue_on_close() -> None:
    """Wrap torch's ``PContext.close`` and ``ProcessContext._join_procs_with_timeout`` (once
    per process) to SIGCONT the workers as they are stopped (module docstring)."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.multiprocessing.spawn import ProcessContext

    real = PContext.close
    if getattr(real, "nereus_wrapped", False):
        return
    real_join = ProcessContext._join_procs_with_timeout

    def join_procs_with_timeout(self, timeout: float) -> None:
        for process in self.processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass
        return real_join(self, timeout)

    ProcessContext._join_procs_with_timeout = join_procs_with_timeout

    def close(self, death_sig=None, timeout: int = 30) -> None:
        try:
            pids = list(self.pids().values())
        except Exception:  # noqa: BLE001 - nothing started yet: nothing to continue
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass
        return real(self, death_sig, timeout)

    close.nereus_wrapped = True
    PContext.close = close


def rendezvous_timeout(collective_timeout_s: float) -> float:
    """The agent's rendezvous join timeout: longer than every collective's deadline."""
    return max(600.0, 2.0 * collective_timeout_s)


SHM = "/dev/shm"
_KEY = re.compile(r"[0-9]+\.[0-9a-f]{8}")
_SENTINELS: dict[str, tuple[str, int, str]] = {}
"""This process's launcher key, sentinel descriptor and path by tag (``hold_sentinel``)."""


def sem_prefix(tag: str, key: str) -> str:
    """The semaphore names of a launch tagged ``tag`` by the launcher of ``key``
    (``hold_sentinel``): ``/nereus-<tag>.<key>``, files ``sem.nereus-<tag>.<key>-XXXX``."""
    return f"/nereus-{tag}.{key}"


def sem_owner(name: str, tag: str) -> str | None:
    """The launcher key in a semaphore file's name of ``tag`` (``sem_prefix``), None for one of
    an older Nereus (``sem.nereus-<tag>-XXXX``, ``sem.nereus-<tag>.<pid>-XXXX``) (pure)."""
    head = f"sem.nereus-{tag}."
    if not name.startswith(head):
        return None
    key = name[len(head):].partition("-")[0]
    return key if _KEY.fullmatch(key) else None


def sentinel_path(tag: str, key: str, shm: str = SHM) -> str:
    """The launcher of ``key``'s sentinel: ``nereus-<tag>.<key>.launcher``, locked while it lives."""
    return os.path.join(shm, f"nereus-{tag}.{key}.launcher")


def hold_sentinel(tag: str, shm: str = SHM) -> str | None:
    """This process's launcher key for ``tag`` (``<pid>.<8 hex>``: unique across pid namespaces),
    made once per process: its sentinel is created locked (``LOCK_EX``, ``O_CLOEXEC``; made under
    a temporary name, then renamed, so no one sees it unlocked) and held until the process exits,
    then unlinked (``atexit``); None where it cannot be made (no ``shm``, no ``flock``)."""
    if tag in _SENTINELS:
        return _SENTINELS[tag][0]
    import fcntl
    import uuid

    key = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
    path = sentinel_path(tag, key, shm)
    tmp = f"{path}.tmp"
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, path)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    if not _SENTINELS:
        atexit.register(drop_sentinels)
    _SENTINELS[tag] = (key, fd, path)
    return key


def drop_sentinels() -> None:
    """Unlink and let go of this process's sentinels (at exit): each is forgotten before its
    descriptor is closed, so nothing ever reads a closed (or reused) descriptor as a sentinel."""
    while _SENTINELS:
        _, (_, fd, path) = _SENTINELS.popitem()
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.close(fd)


def _forget_sentinels_in_child() -> None:
    """A forked child neither holds its parent's sentinels nor unlinks them."""
    for _, fd, _ in _SENTINELS.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _SENTINELS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_sentinels_in_child)


def launcher_alive(tag: str, key: str, shm: str = SHM) -> bool | None:
    """Whether the launcher of ``key`` runs, by its sentinel's lock — never by a pid, which
    another pid namespace sharing ``shm`` (``--ipc=host``) may reuse: True while it is locked
    (or cannot be looked at), False when it is there unlocked (its launcher died), None when it
    is not there (a launcher at its very end, or none of this Nereus)."""
    import fcntl

    if tag in _SENTINELS and _SENTINELS[tag][0] == key:
        return True
    try:
        fd = os.open(sentinel_path(tag, key, shm), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # held (BlockingIOError), or no flock here: taken for alive
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def named_semaphores(tag: str | None) -> Iterator[None]:
    """The multiprocessing semaphores this process makes meanwhile are named by ``tag`` and this
    process's launcher key (module docstring); a no-op without a tag, on a Python without
    ``semprefix``, or where no sentinel can be made."""
    import multiprocessing

    config = getattr(multiprocessing.current_process(), "_config", None)
    key = hold_sentinel(tag) if tag is not None and isinstance(config, dict) and "semprefix" in config else None
    if key is None:
        yield
        return
    old, config["semprefix"] = config["semprefix"], sem_prefix(tag, key)
    try:
        yield
    finally:
        config["semprefix"] = old


def _mine(paths: list[str]) -> list[str]:
    out = []
    for path in sorted(paths):
        try:
            if os.lstat(path).st_uid == os.geteuid():
                out.append(path)
        except FileNotFoundError:
            pass
    return out


def stale_semaphores(tag: str, shm: str = SHM) -> list[str]:
    """The semaphore files of launches tagged ``tag`` in ``shm`` that this user owns (live
    launches' too)."""
    return _mine(glob.glob(os.path.join(shm, f"sem.nereus-{tag}.*")) + glob.glob(os.path.join(shm, f"sem.nereus-{tag}-*")))


def launcher_sentinels(tag: str, shm: str = SHM) -> list[str]:
    """The sentinels of launches tagged ``tag`` in ``shm`` that this user owns (live ones' too)."""
    return _mine(glob.glob(os.path.join(shm, f"nereus-{tag}.*.launcher")))


def launch_files(tag: str, shm: str = SHM) -> list[str]:
    """Every file of launches tagged ``tag`` in ``shm`` that this user owns, live launches' too:
    semaphores, sentinels and temporary sentinels (what a leak check counts)."""
    tmps = _mine(glob.glob(os.path.join(shm, f"nereus-{tag}.*.launcher.tmp")))
    return sorted(stale_semaphores(tag, shm) + launcher_sentinels(tag, shm) + tmps)


SENTINEL_TMP_AGE_S = 10.0
"""A sentinel's temporary file younger than this is never removed (``hold_sentinel`` locks and renames it at once)."""


def stale_sentinel_tmps(tag: str, shm: str = SHM) -> list[str]:
    """The temporary sentinels (``<sentinel>.tmp``) of launches tagged ``tag`` in ``shm`` that
    this user owns, left by a launcher killed between making one and renaming it: unlocked
    (``LOCK_EX|LOCK_NB`` is granted) and older than ``SENTINEL_TMP_AGE_S``."""
    import fcntl
    import time

    stale = []
    for path in _mine(glob.glob(os.path.join(shm, f"nereus-{tag}.*.launcher.tmp"))):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < SENTINEL_TMP_AGE_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held (its launcher is renaming it), or no flock here: left
            continue
        finally:
            os.close(fd)
        stale.append(path)
    return stale


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_semaphores(tag: str, shm: str = SHM, *, locked: bool = False) -> list[str]:
    """Unlink what killed launches tagged ``tag`` left in ``shm``: the semaphores and sentinel of
    every launcher whose sentinel is there unlocked (``launcher_alive`` False) — safe on any node
    at any time, so every launch does it, one node or several — and, with ``locked`` (under the
    run dir's lock: no launch of the tag runs here), those without a sentinel too (an older
    Nereus's names); and the unlocked temporary sentinels of launchers killed while making one
    (``stale_sentinel_tmps``); returns what went."""
    gone, alive = [], {}
    for path in stale_semaphores(tag, shm):
        key = sem_owner(os.path.basename(path), tag)
        if key is not None and key not in alive:
            alive[key] = launcher_alive(tag, key, shm)
        verdict = alive.get(key) if key is not None else None
        if verdict or (verdict is None and not locked):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            gone.append(path)
    for path in launcher_sentinels(tag, shm):  # after its semaphores: while it is there they are told apart
        key = os.path.basename(path)[len(f"nereus-{tag}."):-len(".launcher")]
        if _KEY.fullmatch(key) and launcher_alive(tag, key, shm) is False:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                gone.append(path)
    for path in stale_sentinel_tmps(tag, shm):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            gone.append(path)
    return gone


AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class OneLineFailures(logging.Filter):
    """On the agent's log of a failed worker (``logger.exception`` with the worker's whole
    traceback): when the worker's error is one of ``names`` (``module.Class``: errors whose
    message says all, e.g. ``RunDirBusy``), the traceback is dropped and the error's line
    appended instead; every other failure is logged as torch logs it."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and self.names:
            last = next((line for line in reversed(str(error).splitlines()) if line.strip()), "")
            for name in self.names:
                if last.startswith(f"{name}: "):
                    record.msg = f"{record.msg}: %s"
                    record.args = (*(record.args or ()), last[len(name) + 2:])
                    record.exc_info, record.exc_text = None, None
                    break
        return True


@contextlib.contextmanager
def one_line_failures(errors: tuple[type, ...]) -> Iterator[None]:
    """Meanwhile the agent logs a worker that failed with one of ``errors`` in one line
    (``OneLineFailures``)."""
    if not errors:
        yield
        return
    log = logging.getLogger(AGENT_LOGGER)
    quiet = OneLineFailures(tuple(f"{e.__module__}.{e.__qualname__}" for e in errors))
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any, run_id: str = "nereus", nnodes: str = "1",
                 max_restarts: int = 0, rdzv_endpoint: str | None = None, collective_timeout_s: float = 300.0,
                 last_call_s: int = 30, shm_tag: str | None = None, one_line_errors: tuple[type, ...] = ()) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` local processes (per node); returns this node's ranks'
    return values by global rank (of the last attempt, when the agent restarted them).
    Several nodes meet under ``run_id``, which must then be the same on every node.

    ``fn`` must be a module-level function. Workers find their rank in ``RANK`` and
    initialise the process group from the environment (``init_method="env://"``). A job
    whose workers still fail after ``max_restarts`` restarts raises the launcher's
    ``ChildFailedError``. ``shm_tag``: the agent's semaphores are named by it (module docstring).
    ``one_line_errors``: worker exceptions the agent logs in one line, without their traceback.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    low, high = parse_nnodes(nnodes)
    if high > 1 and rdzv_endpoint is None:
        raise ValueError(f"--nnodes {nnodes}: several nodes need --rdzv-endpoint HOST:PORT (where every node's agent meets)")
    config = LaunchConfig(
        min_nodes=low,
        max_nodes=high,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv_endpoint or f"127.0.0.1:{free_port()}",
        rdzv_configs={"join_timeout": rendezvous_timeout(collective_timeout_s), "last_call_timeout": last_call_s},
        max_restarts=max_restarts,
        start_method="spawn",
        monitor_interval=0.1,
    )
    publish_store_every_round()
    os.environ[LAUNCHER_ENV] = launcher_env(run_id)  # the workers die with this process (run_lock.die_with_launcher)
    try:
        with named_semaphores(shm_tag), one_line_failures(one_line_errors):
            return elastic_launch(config, fn)(*args)
    finally:  # this launch's round must not reach what this process starts later
        for name in (RDZV_ROUND_ENV, LAUNCH_ID_ENV, LAUNCHER_ENV):
            os.environ.pop(name, None)
        if shm_tag is not None:  # a launcher of this run SIGKILLed here meanwhile (a node that left): no later launch may come
            with contextlib.suppress(OSError):
                remove_stale_semaphores(shm_tag)


def own_result(results: dict[int, Any]) -> Any:
    """The result to report on this node: its lowest global rank's (``launch_local`` returns
    this node's workers' results only, keyed by global rank; rank 0 is on one node alone)."""
    if not results:
        raise RuntimeError("the launch returned no worker results on this node")
    return results[min(results)]
