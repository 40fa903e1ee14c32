"""The memory-staged per-step state: where a node stages, what it holds, and the ``Stager`` that writes it.

After every completed step the step's whole trainer state is staged in the node's shared
memory (``nereus-<staging id>`` in ``elastic.staging_dir``, default ``/dev/shm``: every run its
own dir, keyed by its run dir's path and the random token its first start left there
(``staging_id``), so runs sharing one base never touch each other's copies; a tmpfs outlives the worker
processes, so an agent's restart finds it). The staged copy *is* a checkpoint of the
store's own format (``store/checkpoint.py``): box files with CRC32C block checksums and a
manifest committed last with a compare-and-swap — the parameters, fp32 masters and AdamW
state as boxes; the step counter, the prompt sampler's position, the LR schedules' positions,
the controller's state, the run's lineage and its plan record in the manifest's job state. A
worker killed while it stages leaves a data directory no manifest names: the previous staged
step stays the newest committed one. ``elastic.staging_keep`` (default 2) staged steps are
kept. Staging starts only when the node's free space holds ``staging_keep + 1`` copies of the
state (else it is off, logged); a failed write (e.g. the tmpfs filled up) removes its partial
data and turns staging off for the rest of the run (logged; training goes on); a run that
finishes removes its staged copies (its own ``nereus-<staging id>`` only).

Several nodes: each node stages its own part — every box one of its ranks holds, replicas
included, so a rank finds all it holds on its own node — as a checkpoint of its own, written
and committed over a gloo group of the node's ranks, its manifest naming the node's global
ranks and the world (``node``). Nodes commit independently; a restore takes the newest step
every node holds, and only when every rank finds it on its own node, staged by that node's
ranks in a world of the same size (else the durable checkpoint). Two nodes whose staging
dirs are one directory (a shared filesystem, or two launches on one machine without their
own ``NEREUS_STAGING_DIR``) would overwrite each other's copies: staging is then off. The
job's config is rank 0's on every node, so a node's own path comes from its environment
(``NEREUS_STAGING_DIR``, over ``elastic.staging_dir``).

Overlap: ``Stager.stage`` copies this rank's boxes into host buffers kept across steps
(pinned on CUDA; the only part on the step's critical path, ``copy_s``), then a background
thread writes and commits them over a gloo group of its own while the next step runs
(``write_s``); the next ``stage`` first waits for it (``wait_s``, 0 when the write finished
under the step). Both figures land in the next step's metrics record (``staging``).

Only its owner reads it: the staging dir is created 0700 (and ``meta/``, ``data/`` in it),
every file the store writes there 0600 (``store/checkpoint.py``: a root whose directory is
0700 is private). On every open — the Stager's, a restore's, a fresh start's or a finished
run's clean-up, the launcher's preflight — the dir (under ``NEREUS_STAGING_DIR``,
``elastic.staging_dir`` or the default alike) is looked at without following a link, and
refused, with one line naming it and its owner, when it is a symlink, not a directory, owned
by another user than the effective uid, or writable by group or other; so is one with an
existing parent (each looked at with ``lstat``, from ``/`` down) that is a symlink or not a
directory, or that another user could swap it in (owned by neither root nor this user, or
group/other-writable without the sticky bit: ``/dev/shm`` itself is root's, sticky). A dir of
this user's readable by others (an older Nereus's) is narrowed to 0700. A refused dir is
never written to nor cleared. Each staged manifest is sealed under the staging id
(``records.manifest_seal``: its files' sizes and CRC32C blocks, its job state — run,
lineage, step): a copy is restored only when its seal matches this run's.

Which source a (re)started job restores: ``trainer/elastic/restore.py``; the launch's round and
the run's lineage: ``trainer/elastic/lineage.py``.

Plan record: ``{"version", "since", "digest"}`` — how many plan changes the lineage has gone
through, the step from which the current plan holds, its digest — kept in the job state
(``plan_record``), advanced when the plan a record is written in differs from the last one.
A staged copy is refused when its record contradicts the durable checkpoint's (an older
version, the same version with another plan, or a change dated at or before the durable
step) or the plan its own manifest names.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import stat
import sys
import time
from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

from .phases import mark
from .run_token import has_token, run_id, staging_id

STAGING_BASE = "/dev/shm"
STAGING_ENV = "NEREUS_STAGING_DIR"
def node_staging_dir() -> str | None:
    """This node's staging dir from its environment (``NEREUS_STAGING_DIR``), None when unset.
    The job's config is one for every node (rank 0's); a path of one node's goes here.
    ConfigError naming the variable when it is not a local absolute path."""
    from ..config import ConfigError

    path = os.environ.get(STAGING_ENV) or None
    if path is not None and ("://" in path or not os.path.isabs(path)):
        raise ConfigError(f"environment variable {STAGING_ENV} must be a local absolute path (node memory, e.g. under "
                          f"/dev/shm), got {path!r}")
    return path


def staging_base(cfg) -> str:
    """The directory this node's runs stage under: ``NEREUS_STAGING_DIR``, else
    ``elastic.staging_dir``, else ``/dev/shm`` (the system's, as its real path)."""
    return node_staging_dir() or cfg.elastic.staging_dir or os.path.realpath(STAGING_BASE)


def staging_root(cfg) -> str:
    """Where this run stages on this node: ``nereus-<staging id>`` in ``staging_base`` — a dir of
    its own, so that runs sharing one base (a node's ``NEREUS_STAGING_DIR``) never write,
    retire or clear each other's copies."""
    return os.path.join(staging_base(cfg), f"nereus-{staging_id(cfg.run_dir)}")


def legacy_staging(base: str) -> str | None:
    """One line naming staged copies an older Nereus left directly in the staging base
    (``<base>/meta``, not ``<base>/nereus-<staging id>``): never found, never restored and never
    cleared by this version (they may be another run's), so they hold node memory until
    removed by hand. None when there are none (reads only)."""
    meta = os.path.join(base, "meta")
    if not os.path.isdir(meta) or os.path.islink(meta):
        return None
    try:
        held = [os.path.join(base, p) for p in ("meta", "data") if os.path.lexists(os.path.join(base, p))]
        size = sum(tree_bytes(p) for p in held)
    except OSError:
        held, size = [meta], 0
    return (f"staging dir {base} holds staged copies in an older layout ({' and '.join(held)}, {size / (1 << 20):.1f} MiB; "
            f"this version stages in {base}/nereus-<staging id>): they are neither restored nor cleared; remove them "
            f"(rm -r {' '.join(held)}) once no older run needs them")


RUN_FILE = "run"
"""In each staging dir: its run dir's absolute path (``earlier_staging`` reads it)."""


def mark_run(root: str, run_dir: str) -> None:
    """Write ``root``'s ``RUN_FILE`` (0600, never through a link)."""
    fd = os.open(os.path.join(root, RUN_FILE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (os.path.abspath(run_dir) + "\n").encode())
    finally:
        os.close(fd)


def earlier_staging(base: str, run_dir: str) -> str | None:
    """One line naming this user's staging dirs in ``base`` that hold an earlier run's copies
    at ``run_dir``'s path, not this run's: an older Nereus's ``nereus-<run id>`` (named by the
    path alone: only that version restores it), and those whose ``RUN_FILE`` names the path
    under another token (the run dir was removed and made again, or another container's run
    at the same path). This run neither restores nor clears them; None when there are none
    (reads only)."""
    path = os.path.abspath(run_dir)
    mine, old = (f"nereus-{staging_id(path)}" if has_token(path) else None), f"nereus-{run_id(path)}"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return None
    found = []
    for name in names:
        if not name.startswith("nereus-") or "." in name or name == mine:  # dotted: the launchers' sentinels
            continue
        d = os.path.join(base, name)
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if name == old:
                found.append((d, ", an older Nereus's"))
                continue
            fd = os.open(os.path.join(d, RUN_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                named = os.read(fd, 1 << 16).decode(errors="replace").strip()
            finally:
                os.close(fd)
            if named == path:
                found.append((d, ""))
        except OSError:
            continue
    if not found:
        return None
    held = ", ".join(f"{d} ({tree_bytes(d) / (1 << 20):.1f} MiB{note})" for d, note in found)
    return (f"staged copies of earlier runs at {path} are left in {held}: this run neither restores nor "
            f"clears them; remove them (rm -r {' '.join(d for d, _ in found)}) once no run at this path "
            "(another container's, or an older Nereus resuming its own) needs them")


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def staging_mode(cfg) -> bool:
    """``elastic.staging``: always, never, or auto — on when the agent may restart the workers."""
    mode = cfg.elastic.staging
    return mode == "always" if mode != "auto" else int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def node_key() -> str:
    """Which node this process is on: the agent's node rank (``GROUP_RANK``) of this round,
    else the host name."""
    group = os.environ.get("GROUP_RANK")
    return f"node {group}" if group not in (None, "") else f"host {socket.gethostname()}"


def group_nodes(keys: list[str]) -> list[list[int]]:
    """Every rank's ``node_key`` -> each node's global ranks, ascending, nodes by lowest rank (pure)."""
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    return sorted(nodes.values())


def shared_dir(nodes: list[list[int]], dirs: list) -> str | None:
    """Why two nodes would stage into one directory (None: each has its own). ``dirs``: each
    rank's ``(host, device, inode)`` of its staging dir (None where it could not tell)."""
    owner: dict = {}
    for ranks in nodes:
        for r in ranks:
            if dirs[r] is None:
                continue
            other = owner.setdefault(tuple(dirs[r]), ranks[0])
            if other != ranks[0]:
                return (f"ranks {other} and {r} are on different nodes but their staging dirs are one directory "
                        f"({dirs[r][0]}, device {dirs[r][1]}, inode {dirs[r][2]}): give each node its own ({STAGING_ENV})")
    return None


def dir_identity(root: str) -> tuple[str, int, int]:
    """The staging dir (created) as ``(host, device, inode)``."""
    st = os.stat(root)
    return socket.gethostname(), st.st_dev, st.st_ino


# ------------------------------------------------------------------ owner and mode (checks pure)

HINT = f"give this job a staging dir of its own ({STAGING_ENV} or elastic.staging_dir)"


def owner_name(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a uid without a name."""
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def dir_refusal(path: str, st: os.stat_result, euid: int) -> str | None:
    """Why a staging dir must not be used (None: it may). ``st``: its ``lstat`` (a link is
    not followed); ``euid``: this process's effective uid (pure)."""
    owner = owner_name(st.st_uid)
    if stat.S_ISLNK(st.st_mode):
        return f"staging dir {path} is a symlink (owned by {owner}): refused; {HINT}"
    if not stat.S_ISDIR(st.st_mode):
        return f"staging dir {path} is not a directory (owned by {owner}): refused; {HINT}"
    if st.st_uid != euid:
        return f"staging dir {path} is owned by {owner}, not by this user ({owner_name(euid)}): refused; {HINT}"
    loose = [who for who, bit in (("group", stat.S_IWGRP), ("other", stat.S_IWOTH)) if st.st_mode & bit]
    if loose:
        return (f"staging dir {path} (owned by {owner}) is writable by {' and '.join(loose)} (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): refused; {HINT}")
    return None


def parent_refusal(path: str, st: os.stat_result, euid: int, target: str | None = None) -> str | None:
    """Why an existing parent of a staging dir must not lead to it (None: it may): a symlink
    (``st`` is its ``lstat``; ``target``: what it names, for the message) or not a directory,
    owned by neither root nor this user, or writable by group or other without the sticky bit
    (another user could swap the dir) (pure)."""
    if stat.S_ISLNK(st.st_mode):
        to = f" (to {target})" if target else ""
        return (f"staging dir's parent {path} is a symlink{to}: refused (no link on the path is followed; give the "
                f"directory's real path); {HINT}")
    if not stat.S_ISDIR(st.st_mode):
        return f"staging dir's parent {path} is not a directory: refused; {HINT}"
    if st.st_uid not in (0, euid):
        return f"staging dir's parent {path} is owned by {owner_name(st.st_uid)}: refused; {HINT}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return (f"staging dir's parent {path} is writable by others without the sticky bit (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): refused; {HINT}")
    return None


def parents(root: str) -> list[str]:
    """``root``'s parents, from ``/`` down (pure)."""
    out, path = [], os.path.dirname(root)
    while True:
        out.append(path)
        if path == os.path.dirname(path):
            return out[::-1]
        path = os.path.dirname(path)


def check_staging_dir(root: str) -> str | None:
    """Why ``root`` must not be used as a staging dir (None: fine, or absent); reads only.
    Every component is looked at with ``lstat`` from ``/`` down (a link is never followed,
    so a symlinked parent is refused like a symlinked dir); the first missing one ends the
    walk (what is below it is made 0700 by ``open_staging_dir``)."""
    if not os.path.isabs(root) or ".." in root.split(os.sep):
        return f"staging dir {root} must be an absolute path without '..': refused; {HINT}"
    root = os.path.normpath(root)
    euid = os.geteuid()
    for parent in parents(root):
        try:
            st = os.lstat(parent)
        except (FileNotFoundError, NotADirectoryError):
            return None
        target = None
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(parent)
            except OSError:
                pass
        why = parent_refusal(parent, st, euid, target)
        if why:
            return why
    try:
        return dir_refusal(root, os.lstat(root), euid)
    except FileNotFoundError:
        return None


def open_staging_dir(root: str, *, create: bool = True) -> str | None:
    """Check ``root`` (``check_staging_dir``), create it 0700 when absent (``create``), narrow
    this user's own to 0700, and make ``meta/`` and ``data/`` in it 0700; the refusal (one
    line) or None. Nothing is created or changed in a refused dir."""
    from nereus.store.dcp_io import PRIVATE_DIR, makedirs_private, private_mode

    why = check_staging_dir(root)
    if why or (not create and not os.path.lexists(root)):
        return why
    if create and not os.path.lexists(root):
        makedirs_private(os.path.dirname(os.path.abspath(root)))
        try:
            os.mkdir(root, PRIVATE_DIR)
            private_mode(root)  # exactly 0700, whatever the umask
        except FileExistsError:
            pass  # made meanwhile: checked below like any other
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return check_staging_dir(root) or f"staging dir {root} cannot be opened: refused; {HINT}"
    try:
        st = os.fstat(fd)
        why = dir_refusal(root, st, os.geteuid())
        if why:
            return why
        if stat.S_IMODE(st.st_mode) != PRIVATE_DIR:
            os.fchmod(fd, PRIVATE_DIR)
    finally:
        os.close(fd)
    for part in ("meta", "data"):
        sub = os.path.join(root, part)
        if not os.path.lexists(sub):
            if create:
                makedirs_private(sub)
        elif os.path.islink(sub) or not os.path.isdir(sub):
            return f"staging dir {root} holds {part} as a link or a file: refused; {HINT}"
        elif stat.S_IMODE(os.stat(sub).st_mode) != PRIVATE_DIR:
            os.chmod(sub, PRIVATE_DIR)
    return None


def clear_staging(root: str) -> None:
    """Remove this run's staged copies on this node: its own dir's (``staging_root``, named
    by the staging id) ``meta/``, ``data/`` and ``RUN_FILE`` only, then that dir if it is left empty — never
    anything else in the base it sits in (another run's ``nereus-<staging id>``, other files). A
    refused dir (``check_staging_dir``) is left as it is, with one line."""
    if not os.path.lexists(root):
        return
    why = check_staging_dir(root)
    if why:
        print(f"nereus: staged copies not cleared: {why}", file=sys.stderr, flush=True)
        return
    for part in ("meta", "data"):
        shutil.rmtree(os.path.join(root, part), ignore_errors=True)
    try:
        os.unlink(os.path.join(root, RUN_FILE))
    except OSError:
        pass
    try:
        os.rmdir(root)
    except OSError:
        pass  # not empty: not only ours


def finish_staging(cfg) -> None:
    """Collective, after the run's last step: every node's staged copies of this run go (the
    durable checkpoint of the last step holds the state); other runs' in the same base stay."""
    dist.barrier()
    if local_rank() == 0:
        clear_staging(staging_root(cfg))


# ------------------------------------------------------------------ plan record and tags (pure)


def plan_digest(plan: Mapping | None) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def advance_plan_record(record: Mapping | None, plan: Mapping, step: int) -> dict:
    """The plan record after a record written at ``step`` in ``plan``: unchanged while the
    plan is the same, else the next version holding from ``step``; version 0 from ``step``
    when there was none."""
    digest = plan_digest(plan)
    if not record or "version" not in record:
        return {"version": 0, "since": step, "digest": digest}
    if record.get("digest") == digest:
        return dict(record)
    return {"version": int(record["version"]) + 1, "since": step, "digest": digest}


def staged_state(run_dir: str, lineage: str | None) -> dict:
    """What a staged manifest's job state adds for ``check_staged``: whose run (its path and
    staging id, under ``"run_id"``: the key it is sealed under) and lineage."""
    return {"staged": {"run": os.path.abspath(run_dir), "run_id": staging_id(run_dir), "lineage": lineage}}


# ------------------------------------------------------------------ staging


def state_bytes(emus, among=None) -> int:
    """The bytes one staged copy of ``emus`` takes: every distinct box once (of those one of
    the ranks ``among`` holds: a node's part) (pure)."""
    from nereus.reshard.layout import itemsize
    from nereus.store.checkpoint import checkpoint_layouts
    from nereus.store.dcp_io import all_boxes

    layouts = checkpoint_layouts(emus)
    return sum(math.prod(lengths) * itemsize(layouts[name].dtype) for name, _, lengths in all_boxes(layouts, among))


def tree_bytes(root: str) -> int:
    """The bytes of the files under ``root`` (0 when it does not exist)."""
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:
                pass
    return total


def free_bytes(root: str) -> int:
    """Free bytes (for an unprivileged writer) on the filesystem ``root`` is or would be on."""
    path = root
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def capacity_refusal(need_each: int, keep: int, free: int, own: int) -> str | None:
    """Why staging must not start (None: it fits): ``keep`` + 1 copies of ``need_each`` bytes
    (the kept ones and the one being written) must fit in the free space plus what this run's
    earlier copies hold (they rotate out). Pure."""
    need = (keep + 1) * need_each
    if need > free + own:
        mib = 1 << 20
        return (f"{keep + 1} copies of the state ({need_each / mib:.1f} MiB each: elastic.staging_keep={keep}, plus the one "
                f"being written) need {need / mib:.1f} MiB, but {free / mib:.1f} MiB are free there")
    return None


class Stager:
    """Stages the trainer's state after each step (module docstring). Construct on every rank
    at the same point (it finds the nodes, creates a gloo group per node and agrees on the
    free space); ``stage`` and ``close`` on every rank. ``enabled`` is False (on every rank)
    when staging did not fit or two nodes share one staging dir."""

    def __init__(self, cfg, rank: int, emus=None) -> None:
        from nereus.store.async_save import AsyncCheckpointer

        self.root, self.rank = staging_root(cfg), rank
        self.last: dict = {}
        self._submitted = 0.0
        self._done = 0.0
        self._waited = 0.0  # seconds ``wait`` waited for the write in flight since the last ``stage``
        self.enabled = True
        self.refused: str | None = None
        world = dist.get_world_size()
        try:
            where = open_staging_dir(self.root) if local_rank() == 0 else None  # one creator per node
            if where is None and local_rank() == 0:
                mark_run(self.root, cfg.run_dir)
        except OSError as e:
            where = f"cannot create it ({e})"
        dist.barrier()  # the node's local rank 0 made it before any other rank looks
        try:
            where = where or check_staging_dir(self.root) or dir_identity(self.root)
        except OSError as e:
            where = f"cannot open it ({e})"
        found: list = [None] * world
        dist.all_gather_object(found, (node_key(), where))
        self.nodes = group_nodes([key for key, _ in found])
        self.node = next(ranks for ranks in self.nodes if rank in ranks)
        why = where if isinstance(where, str) else None
        if why is None and len(self.nodes) > 1:
            shared = shared_dir(self.nodes, [w if isinstance(w, tuple) else None for _, w in found])
            why = shared and f"{shared} (each node stages its own part)"
        if why is None and emus is not None:
            try:
                need = state_bytes(emus, frozenset(self.node) if len(self.nodes) > 1 else None)
                why = capacity_refusal(need, cfg.elastic.staging_keep, free_bytes(self.root), tree_bytes(self.root))
            except OSError as e:
                why = f"cannot read the free space there ({e})"
        flags = [None] * world
        dist.all_gather_object(flags, why)
        refusals = [(r, w) for r, w in enumerate(flags) if w]
        if refusals:
            self.enabled = False
            self.refused = f"staging in {self.root} is off: rank {refusals[0][0]}: {refusals[0][1]}"
            if rank == 0:
                print(f"nereus: {self.refused}", file=sys.stderr, flush=True)
            self.saver = None
            return
        timeout = timedelta(seconds=cfg.elastic.collective_timeout_s)
        if len(self.nodes) == 1:
            group = dist.new_group(backend="gloo", timeout=timeout)
        else:  # every rank creates every node's group, in the same order; each node saves over its own
            groups = [dist.new_group(ranks=ranks, backend="gloo", timeout=timeout) for ranks in self.nodes]
            group = groups[self.nodes.index(self.node)]
        among = self.node if len(self.nodes) > 1 else None
        self.saver = AsyncCheckpointer(self.root, keep=cfg.elastic.staging_keep, sync=False, group=group, among=among,
                                       seal=staging_id(cfg.run_dir))

    def stage(self, step: int, emus, buffers, state: dict, plan: dict) -> None:
        """Stage ``step``: wait for the previous write, copy to host, write in the background."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        try:
            self.saver.wait()
        except Exception as e:  # noqa: BLE001 - every rank sees a failed save (DCP agrees): staging stops, training goes on
            self._failed(e)
            return
        t1 = time.perf_counter()
        waited, self._waited = self._waited + (t1 - t0), 0.0
        state = {**state, "node": {"ranks": list(self.node), "world": sum(map(len, self.nodes))}}
        mark("stage", "start", step, self.rank)  # NEREUS_PHASE_LOG only (tools/bench_faults.py)
        future = self.saver.save(step, emus, buffers, rank=self.rank, state=state, plan=plan)
        self._submitted, self._done = time.perf_counter(), 0.0

        def done(_) -> None:
            self._done = time.perf_counter()
            mark("stage", "end", step, self.rank)

        future.add_done_callback(done)
        self.last = {"step": step, "wait_s": waited, "copy_s": self._submitted - t1}

    def wait(self) -> None:
        """Wait until the write in flight (the last step's staging) has committed: the step
        loop calls it before it logs the next step, so that no step is logged before the one
        before it is staged, and a kill re-runs at most the step it interrupted (a write that
        outlasts a step would otherwise leave two). A failed write turns staging off, as in
        ``stage``; the time waited joins the next staging's ``wait_s``."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        try:
            self.saver.wait()
        except Exception as e:  # noqa: BLE001 - as in stage: staging stops, training goes on
            self._failed(e)
            return
        self._waited += time.perf_counter() - t0

    def _failed(self, e: Exception) -> None:
        """A staging write failed (every rank): off for the rest of the run; the partial data
        directory (e.g. of a write that met a full tmpfs) is removed by the node's local rank 0."""
        self.enabled = False
        self.last = {"step": self.last.get("step"), "failed": f"{type(e).__name__}: {e}"}
        if local_rank() == 0:
            try:
                from nereus.store.checkpoint import CheckpointStore

                CheckpointStore(self.root).clean_orphans(older_than=0)  # only this run writes here
            except Exception as cleanup:  # noqa: BLE001 - best effort; the run goes on
                print(f"nereus: could not remove the failed staging's data ({cleanup})", file=sys.stderr, flush=True)
        if self.rank == 0:
            print(f"nereus: staging step {self.last['step']} failed ({self.last['failed']}); "
                  "staging is off for the rest of the run", file=sys.stderr, flush=True)

    def figures(self) -> dict:
        """The last staging: ``{"step", "copy_s"`` (on the critical path), ``"wait_s"`` (for
        the write before it), ``"write_s"`` (its background write and commit; None while it
        runs)``}``; {} before the first."""
        if not self.last or "failed" in self.last:
            return dict(self.last)
        done = self._done
        return {**self.last, "write_s": (done - self._submitted) if done else None}

    def close(self) -> None:
        if self.saver is None:
            return
        try:
            self.saver.close()
        except Exception as e:  # noqa: BLE001 - the run's outcome does not depend on its last staged copy
            if self.rank == 0:
                print(f"nereus: the last staging failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
