"""The choice of the source a (re)started job restores, and the restore itself.

Restore (``choose_sources`` then ``restore_newest``): every rank reports what it sees — the
staged manifests on its node and the newest durable step — and every rank derives the same
ordered list: the newest staged step that every rank sees and that passes every check of
``check_staged`` (this run's — its seal matches the staging id — and this lineage's, not older than the durable checkpoint, its
plan record consistent with the durable checkpoint's and with the layouts its data was saved
from, the same on every node, staged on each rank's node by that rank in a world of this
size), then the durable checkpoint (every rank reads the same manifest).
Each source's bytes are verified on read (reshard's checksummed staged reads); the ranks
agree on the outcome in one object collective, and a source that failed on any rank is
refused on every rank, with its reason logged (stderr and ``RUN_DIR/restores.jsonl``), and
the next one is loaded. A refused staged copy (for any reason) is deleted, so the next
attempt does not meet it again and later staging does not collide with its steps: the job
never loops on a bad copy. A fresh start deletes every node's staged copies before it starts.


The staged copies themselves: ``trainer/elastic/staging.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Mapping

import torch.distributed as dist

from .run_token import RUN_TOKEN, adopt_run_token, run_token, staging_id
from .staging import check_staging_dir, clear_staging, local_rank, plan_digest, staging_root

DURABLE_REFUSED = "durable checkpoint refused"


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """A committed state a job can restore: ``kind`` staged | durable, its checkpoint root."""

    kind: str
    root: str
    step: int
    plan: dict | None = None


def fresh_run_dir(run_dir: str, overwrite: bool) -> str | None:
    """A fresh run must not share its run dir with an earlier run's checkpoints (a later
    ``--resume`` would pick the newest of either): the refusal's message, or None — after
    deleting them when ``overwrite``. Call on one process (the launch's, or global rank 0 of a
    fresh start), never on a restart."""
    from nereus.store.checkpoint import CheckpointStore

    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = CheckpointStore(root).steps()
    if not steps and not overwrite:
        return None
    if not overwrite:
        return (f"run dir {run_dir!r} holds checkpoints of an earlier run (steps {steps}): pass --resume to continue it, "
                "--overwrite to start over (its checkpoints are deleted), or another --run-dir")
    shutil.rmtree(root)
    return None


def agree_start(cfg, resume: bool, overwrite: bool | None = None, lock=None) -> dict:
    """Collective, right after the process group forms: ``{"restoring", "restart",
    "lineage", "error", "busy", "token"}``, decided by rank 0 and the same on every rank
    (``token``: the run's, ``run_token.run_token``, which every rank adopts: its staged copies'
    key). ``restart``:
    ``is_restart``; ``restoring``: ``resume`` or a restart; ``lineage``: the launch's
    published lineage on a restart, a new one on a fresh start. ``lock`` (rank 0's, when
    the launcher does not hold the run dir's: ``run_lock.RunLock``) is taken first; a live
    job's is the error (``busy`` True: ``run_worker`` raises it on every rank). Then every
    rank takes ``LOCK_SH`` on ``.lock.workers`` for its life (``run_lock.hold_for_worker``). A fresh start clears every node's staged copies (its local rank 0);
    with ``overwrite`` not None (the launcher left the run dir to the workers: under
    torchrun, several nodes) rank 0 also refuses an earlier run's checkpoints or deletes
    them (``fresh_run_dir``) — never on a restart."""
    from .lineage import is_restart, launch_lineage, new_lineage
    from .run_lock import NoFlock, RunDirBusy, hold_for_worker, same_job_wait_s

    decision: list = [None]
    if dist.get_rank() == 0:
        restart = is_restart()
        lineage = launch_lineage() if restart else None
        error, busy = None, False
        if lock is not None:
            try:  # waits at most half the collective timeout the other ranks wait in the broadcast below with
                lock.acquire(wait_same_job_s=same_job_wait_s(cfg.elastic.collective_timeout_s))
            except (RunDirBusy, NoFlock, OSError) as e:
                busy = isinstance(e, RunDirBusy)
                error = str(e) if isinstance(e, (RunDirBusy, NoFlock)) else f"cannot lock run dir {cfg.run_dir}: {e}"
        if error is None and not (resume or restart) and overwrite is not None:
            try:
                error = fresh_run_dir(cfg.run_dir, overwrite)
            except OSError as e:
                error = f"cannot clear {cfg.run_dir}/checkpoints: {e}"
        token = None
        if error is None:
            try:
                token = run_token(cfg.run_dir)
            except OSError as e:
                error = f"cannot make the run token {cfg.run_dir}/{RUN_TOKEN}: {e}"
        decision[0] = {"restoring": bool(resume or restart), "restart": restart,
                       "lineage": lineage if restart else (None if resume else new_lineage()), "error": error,
                       "busy": busy, "token": token}
    dist.broadcast_object_list(decision, src=0)
    out = decision[0]
    if out.get("token") is not None:  # every rank stages under rank 0's run's id, whatever run dir its node sees
        adopt_run_token(cfg.run_dir, out["token"])
    if not out["error"]:  # before this rank writes anything: an acquirer refuses the run dir while it lives (run_lock.py)
        mine = None
        try:
            hold_for_worker(cfg.run_dir)
        except (RunDirBusy, NoFlock) as e:
            mine = {"error": str(e), "busy": isinstance(e, RunDirBusy)}
        except OSError as e:
            mine = {"error": f"cannot lock run dir {cfg.run_dir} for this worker: {e}", "busy": False}
        # every rank goes on, or every rank stops with the first rank's error: one rank alone never leaves the rest waiting
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        failed = next((m for m in every if m is not None), None)
        if failed is not None:
            out = {**out, **failed}
    if not out["restoring"] and not out["error"]:
        if local_rank() == 0:
            clear_staging(staging_root(cfg))  # an earlier run's staged copy must not come back
        dist.barrier()
    return out


def plan_record_conflict(staged: Mapping | None, durable: Mapping | None, durable_step: int | None) -> str | None:
    """Why a staged copy's plan record contradicts the durable checkpoint's (None: it does
    not, or either has none)."""
    if not staged or not durable or durable_step is None:
        return None
    vs, vd = int(staged.get("version", -1)), int(durable.get("version", -1))
    if vs < vd:
        return f"its plan version {vs} is older than the durable checkpoint's {vd}"
    if vs == vd and (staged.get("digest"), staged.get("since")) != (durable.get("digest"), durable.get("since")):
        return (f"its plan version {vs} (since step {staged.get('since')}) names another plan than the durable checkpoint's "
                f"version {vd} (since step {durable.get('since')})")
    if vs > vd and int(staged.get("since", -1)) <= durable_step:
        return (f"its plan version {vs} dates from step {staged.get('since')}, but the durable checkpoint of step "
                f"{durable_step} still has version {vd}")
    return None


def seal_state(manifest, key: str | None) -> str:
    """``ok`` when the manifest's seal is the one made under ``key`` (the staging id), else
    ``missing``, ``mismatch`` or ``unchecked`` (no key)."""
    from nereus.store.records import SEAL, manifest_seal

    have = (manifest.state or {}).get(SEAL)
    if key is None:
        return "unchecked"
    if not have:
        return "missing"
    return "ok" if have == manifest_seal(manifest, key) else "mismatch"


def summarize(manifest, seal: str | None = None) -> dict:
    """What ``check_staged`` reads of a staged manifest (JSON-able: it crosses ranks);
    ``seal``: the key it must be sealed under (the staging id)."""
    plan = manifest.plan or {}
    state = manifest.state or {}
    layouts = []
    for e in manifest.emus:
        sc = plan.get(e.model, {}).get(e.stage) if isinstance(plan.get(e.model), dict) else None
        saved = (e.config.dp, e.config.tp, e.config.pp)
        planned = None if not isinstance(sc, dict) else (sc.get("dp", 1), sc.get("tp", 1), sc.get("pp", 1))
        layouts.append([f"{e.model}.{e.stage}", list(saved), None if planned is None else list(planned)])
    return {"step": manifest.step, "data": manifest.data, "plan": manifest.plan, "staged": state.get("staged", {}),
            "plan_record": state.get("plan_record"), "layouts": layouts, "node": state.get("node"),
            "seal": seal_state(manifest, seal)}


def check_staged(view: dict | None, *, durable_step: int | None, run_dir: str, durable_state: Mapping | None = None,
                 lineage: str | None = None) -> str | None:
    """Why a staged copy must not be restored (None: it may be, its bytes still to verify).

    ``view``: ``summarize`` of the newest staged manifest, or ``{"error": ...}``/None.
    ``durable_state``: the durable checkpoint's ``{"lineage", "plan_record"}``. ``lineage``:
    the launch's (a restart), None on a launch's first start (then the durable checkpoint's
    lineage is the one to match, where it has one)."""
    if view is None:
        return "no staged copy"
    if "error" in view:
        return view["error"]
    tag = view.get("staged") or {}
    if tag.get("run") != os.path.abspath(run_dir):
        return f"it belongs to run {tag.get('run')!r}, not {os.path.abspath(run_dir)!r}"
    if view.get("seal") != "ok":
        return f"its seal does not match this run's (staging id {staging_id(run_dir)}): {view.get('seal', 'missing')}"
    durable_state = durable_state or {}
    want = lineage or durable_state.get("lineage")
    if want and tag.get("lineage") != want:
        whose = "this launch's" if lineage else "the durable checkpoint's"
        return f"it was staged by another launch (lineage {tag.get('lineage')!r}, {whose} is {want!r})"
    if durable_step is not None and view["step"] < durable_step:
        return f"its step {view['step']} is older than the durable checkpoint's {durable_step}"
    record = view.get("plan_record") or {}
    if view.get("plan") is None or record.get("digest") != plan_digest(view["plan"]):
        return "its plan record does not match the plan its manifest names (digest differs)"
    if tag.get("lineage") == durable_state.get("lineage"):
        why = plan_record_conflict(record, durable_state.get("plan_record"), durable_step)
        if why:
            return why
    for stage, saved, planned in view["layouts"]:
        if planned != saved:
            return f"{stage}'s data is in dp·tp·pp {saved}, but its plan record says {planned}"
    return None


def staged_steps(view: dict) -> dict[int, dict]:
    """A rank's readable staged summaries by step (``local_view``'s newest and older ones)."""
    seen = [view.get("staged"), *view.get("staged_older", ())]
    return {v["step"]: v for v in seen if v is not None and "error" not in v}


def _same_copy(v: dict) -> dict:
    """What every node's part of one staged step must share (not its data dir or its node)."""
    return {k: x for k, x in v.items() if k not in ("data", "node")}


def choose_staged(views: list[dict], *, durable_step: int | None, run_dir: str, durable_state: Mapping | None,
                  lineage: str | None) -> tuple[dict | None, list[str]]:
    """The newest staged step every rank may restore from its own node (its summary, as rank
    0 sees it; None: none) and why newer or other copies were passed over (pure)."""
    reasons: list[str] = []
    world = len(views)
    broken = [(r, v["staged"]["error"]) for r, v in enumerate(views) if v.get("staged") and "error" in v["staged"]]
    if broken:
        return None, [f"staged copy refused on rank {broken[0][0]}: {broken[0][1]}"]
    steps = [staged_steps(v) for v in views]
    if not any(steps):
        return None, []
    missing = [r for r, held in enumerate(steps) if not held]
    if missing:
        return None, [f"staged copy not used: rank {missing[0]} sees none on its node (a new machine, or its memory was cleared)"]
    common = sorted(set.intersection(*(set(held) for held in steps)), reverse=True)
    if not common:
        return None, ["staged copy not used: the nodes hold no staged step in common ("
                      + ", ".join(f"rank {r}: {sorted(held)}" for r, held in enumerate(steps)) + ")"]
    for step in common:
        mine = [held[step] for held in steps]
        differ = next((r for r, v in enumerate(mine) if _same_copy(v) != _same_copy(mine[0])), None)
        if differ is not None:
            reasons.append(f"staged step {step} refused: rank {differ}'s node holds another copy of it than rank 0's")
            continue
        elsewhere = next((r for r, v in enumerate(mine)
                          if not v.get("node") or v["node"].get("world") != world or r not in v["node"].get("ranks", ())), None)
        if elsewhere is not None:
            node = mine[elsewhere].get("node")
            held = "no node record" if not node else f"ranks {node.get('ranks')} of a world of {node.get('world')}"
            reasons.append(f"staged step {step} refused: rank {elsewhere}'s node staged it for {held}, not for rank "
                           f"{elsewhere} of {world}")
            continue
        why = check_staged(mine[0], durable_step=durable_step, run_dir=run_dir, durable_state=durable_state, lineage=lineage)
        if why is None:
            return mine[0], reasons
        reasons.append(f"staged copy of step {step} refused: {why}")
    return None, reasons


def choose_sources(views: list[dict], *, run_dir: str, staged_root: str, durable_root: str, lineage: str | None = None
                   ) -> tuple[list[Source], list[str]]:
    """Every rank's view (``local_view``) -> the sources to try, newest valid first, and the
    reasons a source was passed over. Pure: every rank derives the same list."""
    reasons: list[str] = []
    sources: list[Source] = []
    durable = {k: views[0].get(k) for k in ("durable", "durable_plan", "durable_state", "durable_error")}
    bad = [(r, v.get("durable_error")) for r, v in enumerate(views) if v.get("durable_error")]
    differ = [r for r, v in enumerate(views) if v.get("durable") != durable["durable"]]
    durable_step = durable["durable"]
    if bad:
        reasons.append(f"{DURABLE_REFUSED} on rank {bad[0][0]}: {bad[0][1]}")
        durable_step = None
    elif differ:
        reasons.append(f"{DURABLE_REFUSED}: rank {differ[0]} sees step {views[differ[0]].get('durable')}, rank 0 step "
                       f"{durable['durable']} (the run dir must be the same filesystem on every node)")
        durable_step = None
    if bad or differ:
        if any(v.get("staged") is not None for v in views):
            reasons.append("staged copy not used: the durable checkpoint it must be checked against is unreadable")
    else:
        staged, passed = choose_staged(views, durable_step=durable_step, run_dir=run_dir,
                                       durable_state=durable["durable_state"], lineage=lineage)
        reasons += passed
        if staged is not None:
            sources.append(Source(kind="staged", root=staged_root, step=staged["step"], plan=staged["plan"]))
    if durable_step is not None:
        sources.append(Source(kind="durable", root=durable_root, step=durable_step, plan=durable["durable_plan"]))
    return sources, reasons


def local_view(staged_root: str, durable_root: str, seal: str | None = None) -> dict:
    """This rank's view: the newest staged manifest it sees on its node (``summarize``, its
    seal checked under ``seal``, the staging id; a staging dir ``check_staging_dir`` refuses is
    an error, never read), the
    older committed ones (``staged_older``, newest first: a step every node holds may be
    older than one node's newest), the durable step, plan and job-state record
    (``durable_state``: lineage, plan record). A newest manifest that cannot be read becomes a
    reason (``error`` / ``durable_error``), never an exception; an older one is left out."""
    from nereus.store.checkpoint import CheckpointStore

    view: dict = {"staged": None, "staged_older": [], "durable": None, "durable_plan": None, "durable_state": None,
                  "durable_error": None}
    refused = check_staging_dir(staged_root)
    if refused:
        view["staged"] = {"error": refused}
    elif os.path.isdir(staged_root):
        try:
            store = CheckpointStore(staged_root)
            steps = store.steps()
            if steps:
                view["staged"] = summarize(store.manifest(steps[-1]), seal)
            for step in reversed(steps[:-1]):
                try:
                    view["staged_older"].append(summarize(store.manifest(step), seal))
                except Exception:  # noqa: BLE001 - retired meanwhile or unreadable: not a candidate
                    pass
        except Exception as e:  # noqa: BLE001 - an unreadable copy is refused, never fatal
            view["staged"] = {"error": f"its manifest cannot be read ({type(e).__name__}: {e})"}
    if os.path.isdir(os.path.join(durable_root, "meta")) or "://" in durable_root:
        try:
            store = CheckpointStore(durable_root)
            steps = store.steps()
            if steps:
                manifest = store.manifest(steps[-1])
                state = manifest.state or {}
                view["durable"], view["durable_plan"] = steps[-1], manifest.plan
                view["durable_state"] = {"lineage": state.get("lineage"), "plan_record": state.get("plan_record")}
        except Exception as e:  # noqa: BLE001 - refused on every rank with its reason (choose_sources), never fatal
            view.update(durable=None, durable_plan=None, durable_state=None,
                        durable_error=f"its manifest cannot be read ({type(e).__name__}: {e})")
    return view


def agree_sources(cfg, durable_root: str, *, lineage: str | None = None) -> tuple[list[Source], list[str]]:
    """``choose_sources`` over every rank's ``local_view`` (one object collective)."""
    root = staging_root(cfg)
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, local_view(root, durable_root, staging_id(cfg.run_dir)))
    sources, reasons = choose_sources(views, run_dir=cfg.run_dir, staged_root=root, durable_root=durable_root,
                                      lineage=lineage)
    if any(v["staged"] is not None for v in views) and not any(s.kind == "staged" for s in sources):
        _discard(root)  # refused: later staging must not meet its steps (a create-only commit of the same step fails)
    return sources, reasons


def _discard(root: str) -> None:
    """Every node's staged copy removed, by its local rank 0, while no rank reads it (collective)."""
    dist.barrier()
    if local_rank() == 0:
        clear_staging(root)
    dist.barrier()


def restore_newest(trainer, sources: list[Source], reasons: list[str]) -> tuple[int, dict]:
    """Load the first source that every rank loads whole (collective). Returns the step and
    the restore record; RuntimeError when none loads (the job stops: no restart loop)."""
    t0 = time.perf_counter()
    for src in sources:
        error = None
        try:
            step = trainer.restore(src.root, step=src.step if src.kind == "staged" else None)
            if step != src.step:
                error = f"its newest step is now {step}, not {src.step}"
        except Exception as e:  # noqa: BLE001 - agreed on below; a bad source is refused, never fatal
            error = f"{type(e).__name__}: {e}"
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if not bad:
            if src.kind == "staged" and local_rank() == 0:
                retire_after(src.root, src.step)
            return src.step, {"source": src.kind, "step": src.step, "restore_s": time.perf_counter() - t0, "refused": reasons}
        rank, why = bad[0]
        reasons.append(f"{src.kind} step {src.step} refused on rank {rank}: {why}")
        if trainer.rank == 0:
            print(f"nereus: {reasons[-1]}", file=sys.stderr, flush=True)
        if src.kind == "staged":
            _discard(src.root)
    raise RuntimeError("no committed state could be restored: " + "; ".join(reasons))


def retire_after(root: str, step: int) -> None:
    """A node's staged steps newer than the restored ``step`` (one node's newest that another
    node lacked) and its unfinished writes go: the run stages those steps again, and a
    create-only commit of a step already there would fail."""
    from nereus.store.checkpoint import CheckpointStore

    store = CheckpointStore(root)
    for newer in [s for s in store.steps() if s > step]:
        store.delete(newer)
    store.clean_orphans(older_than=0)


def log_restore(run_dir: str, record: dict) -> None:
    """Rank 0: one line per restore in ``RUN_DIR/restores.jsonl``, reasons on stderr."""
    for reason in record.get("refused", []):
        print(f"nereus: {reason}", file=sys.stderr, flush=True)
    print(f"nereus: restored step {record['step']} from the {record['source']} copy in {record['restore_s']:.2f}s",
          file=sys.stderr, flush=True)
    with open(os.path.join(run_dir, "restores.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
