"""Kill matrix: SIGKILL (or SIGSTOP) at a random moment inside each phase of a job, then check it.

    python tools/bench_faults.py [--trials 5] [--phases step,save,stage,transition,resume,hang]
                                 [--targets job,worker,launcher] [--seed 0] [--out bench_results/faults.json]

As torchelastic tests its restarts and Orbax/DCP test that a save is atomic, but end to end:
the job is ``nereus train`` on tiny_grpo's task, 2 CPU processes (actor.train FSDP over dp2,
generation and the reference in tp2), 8 steps, durable checkpoints at steps 3 and 6 and the
last, staging on (``--max-restarts 3``), ``elastic.collective_timeout_s`` 30 (its floor), and
one live transition of actor.train (dp2·FSDP -> tp2, moving parameters and AdamW state
between the ranks) after step 4 (``NEREUS_FORCE_PLAN``: the controller's own moves depend on
what it measures, and a state-moving one cannot be had on cue). A kill lands at a random step
of the phase's (``cue``): a worker's from step 1 on (its restart restores nothing when nothing
is committed yet), the whole job's or its launcher's from step 3 on, once a staged copy is
committed (``nereus resume`` restores the newest durable checkpoint or the node's newer staged
copy, or the staged copy alone before the first durable one); a job killed earlier has nothing
to resume and is started again.

Landing a kill inside a phase: every worker marks the edges of its phases
(``NEREUS_PHASE_LOG``, ``trainer/elastic/phases.py``: step, save, stage, transition,
restore); the bench follows the file, waits for the chosen phase's start on a random rank,
sleeps a random part of the first 80 % of that phase's duration on that rank in an unkilled
run of the same job (the phase's median there), and
kills: the whole job (``killpg``: launcher, its resource tracker, workers; then
``nereus resume RUN --max-restarts 3``), that one worker (its agent restarts the group), or
(``launcher``, in the step and stage phases) the launcher process alone: its run-dir lock
is freed while its workers may still run, so ``nereus resume`` is started at once and again
every 0.5 s while it is refused (the workers hold ``RUN_DIR/.lock.workers``); ``overlap``
counts the old workers still alive when the resumed job's restore began (bar 0: the new run
never shares the run dir, nor its staging, with them).
``resume``: a first kill mid-step, then the second inside the restore that follows it.
``hang``: one worker SIGSTOPped mid-step (it neither dies nor answers): its peers' collectives
time out, the agent stops the group and restarts it. A trial is "landed" when the phase's end
was not marked before the signal.

Per trial: the job completed to its last step (``completed``); ``dup``: steps logged more
than once in metrics.jsonl; ``lost``: the newest step committed when the signal hit (durable
or staged, read from the stores right after, and again once the signalled job's workers are
all gone: a survivor may commit after the signal) minus the step the job restored (> 0: a
committed step lost); ``recomputed``: the newest step logged by then minus the restored step
(bar <= 1 with staging on); ``diff``: the largest |difference| of any actor
parameter in the final checkpoint against the unkilled run's (the same plans at the same
steps: 0 expected; the layout-invariance band of tests/trainer/runtime/test_layout_invariance.py,
float32 reduction order, otherwise; a completed job not compared fails the bar); ``shm``:
files of the job left in /dev/shm afterwards (its staging dir, its launchers' semaphores
``sem.nereus-<run id>.<key>-*`` and sentinels ``nereus-<run id>.<key>.launcher[.tmp]``);
``detect_s`` (hang): SIGSTOP -> the restarted workers' first mark (their restore, or step 1
when nothing was committed) (bar: collective_timeout_s + 30). A trial that went wrong
(``error``: the fault missed its phase, the signalled workers never went, no restore was
recorded) fails ``trial_errors``.

A trial whose signal missed its phase (it ended first) is done again, at most ``TRIES`` times
in all (``trials_redone``); every attempt counts for every other bar.

Prints a table per phase, writes ``--out``, and ends with one JSON line: trials,
trials_landed, trials_redone, trial_errors, weights_compared, jobs_completed, steps_duplicated,
committed_steps_lost, max_steps_recomputed, hang_detect_s, final_weights_max_diff,
shm_leaked_files, launcher_kill_overlap, launcher_resumes_refused.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny_grpo.yaml"
STEPS, DURABLE, TRANSITION_AFTER, TIMEOUT_S, RESTARTS = 8, 3, 4, 30, 3
PLAN = ["nproc=2", "plan.actor.train.dp=2", "plan.actor.gen.dp=1", "plan.actor.gen.tp=2", "plan.ref.infer.dp=1",
        "plan.ref.infer.tp=2"]
FORCE = json.dumps({"actor": {"train": {"dp": 1, "tp": 2}}})
PHASES = ("step", "save", "stage", "transition", "resume", "hang")
TARGETS = ("job", "worker", "launcher")
LAUNCHER_PHASES = ("step", "stage")
"""The phases the ``launcher`` target (SIGKILL of the launcher process alone) runs in: a step,
and a staging write in flight (the background thread that once outlived its worker)."""
REFUSED = "is still written by workers of a job whose launcher is gone"
CLI = [sys.executable, "-c", "from nereus.cli.app import main; main()"]


def sets(staging_dir: str) -> list[str]:
    return [*PLAN, f"steps={STEPS}", f"checkpoint_every={DURABLE}", "rollout.prompts_per_step=8", "grpo.minibatch_size=32",
            "logging.trackers=[]", f"elastic.collective_timeout_s={TIMEOUT_S}", f"elastic.staging_dir={staging_dir}"]


class Job:
    """One trial's run dir, staging dir, phase log and the launches on them."""

    def __init__(self, base: Path, name: str) -> None:
        self.dir = base / name
        self.run = self.dir / "run"
        self.staging = f"/dev/shm/nereus-bench-{uuid.uuid4().hex[:10]}"  # the base: the run stages in nereus-<staging id> there
        self.phases = self.dir / "phases.jsonl"
        self.dir.mkdir(parents=True)
        self.env = {**os.environ, "NEREUS_PHASE_LOG": str(self.phases), "NEREUS_FORCE_PLAN": f"{TRANSITION_AFTER}:{FORCE}"}
        self.launches = 0
        self._seen = 0
        self.marks: list[dict] = []

    def start(self, resume: bool = False) -> subprocess.Popen:
        self.launches += 1
        log = open(self.dir / f"launch{self.launches}.log", "w")
        if resume:
            cmd = [*CLI, "resume", str(self.run), "--max-restarts", str(RESTARTS)]
        else:
            cmd = [*CLI, "train", str(CONFIG), "--run-dir", str(self.run), "--max-restarts", str(RESTARTS),
                   *[a for s in sets(self.staging) for a in ("--set", s)]]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        log.close()
        return proc

    def read(self) -> list[dict]:
        """Phase marks so far (the file grows while the job runs)."""
        if self.phases.exists():
            with open(self.phases) as f:
                f.seek(self._seen)
                chunk = f.read()
            whole = chunk[: chunk.rfind("\n") + 1]
            self._seen += len(whole.encode())
            self.marks += [json.loads(line) for line in whole.splitlines() if line]
        return self.marks

    def wait_mark(self, ok, proc: subprocess.Popen, deadline: float) -> dict | None:
        while time.monotonic() < deadline and proc.poll() is None:
            for m in self.read():
                if ok(m):
                    return m
            time.sleep(0.002)
        return None

    def last_log(self) -> str:
        return (self.dir / f"launch{self.launches}.log").read_text(errors="replace")

    def log_text(self) -> str:
        return "".join((self.dir / f"launch{i}.log").read_text(errors="replace") for i in range(1, self.launches + 1))


def metrics(run: Path) -> list[dict]:
    out = []
    if (run / "metrics.jsonl").exists():
        for line in (run / "metrics.jsonl").read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def committed(job: Job) -> int | None:
    """The newest step committed now, durable or staged (read through the stores)."""
    from nereus.store.checkpoint import CheckpointStore

    steps = []
    for root in (str(job.run / "checkpoints"), staged_dir(job)):
        if os.path.isdir(os.path.join(root, "meta")):
            try:
                steps += CheckpointStore(root).steps()
            except Exception:  # noqa: BLE001 - a store being written: read what is committed, else nothing
                pass
    return max(steps) if steps else None


def final_actor(run: Path) -> tuple[int, dict]:
    """The final durable checkpoint's actor parameters, whole, read from its box files."""
    import torch

    from nereus.reshard.layout import DTYPES
    from nereus.store.checkpoint import CheckpointStore, qualify

    store = CheckpointStore(str(run / "checkpoints"))
    m = store.manifest()
    shapes = {t.name: (t.shape, t.dtype) for e in m.emus for t in qualify(e).tensors}
    out: dict = {}
    for f in m.files:
        if not f.tensor.startswith("actor/") or "/optim/" in f.tensor:
            continue
        shape, dtype = shapes[f.tensor]
        full = out.setdefault(f.tensor, torch.zeros(shape, dtype=DTYPES[dtype]))
        raw = (Path(store.path) / m.data / f.path).read_bytes()
        box = torch.frombuffer(bytearray(raw), dtype=DTYPES[f.dtype]).reshape(f.lengths)
        full[tuple(slice(o, o + n) for o, n in zip(f.offsets, f.lengths))] = box
    return m.step, out


def staged_dir(job: Job) -> str:
    """The run's own staging dir: ``nereus-<staging id>`` in the job's staging base."""
    from nereus.trainer.elastic.run_token import staging_id

    return os.path.join(job.staging, f"nereus-{staging_id(str(job.run))}")


def shm_left(job: Job, shm: str = "/dev/shm") -> list[str]:
    """The job's files in ``shm``: its launchers' semaphores, sentinels and temporary sentinels
    (``launch_files``), and its staging dir."""
    from nereus.launch import launch_files
    from nereus.trainer.elastic.run_token import run_id

    left = launch_files(run_id(str(job.run)), shm)
    return left + ([staged_dir(job)] if os.path.lexists(staged_dir(job)) else [])


def durations(marks: list[dict]) -> dict[str, float]:
    """Median duration of each phase on each rank, keyed ``phase/rank`` (an unkilled run's marks)."""
    started, took = {}, {}
    for m in marks:
        key = (m["phase"], m["rank"], m["step"])
        if m["edge"] == "start":
            started[key] = m["t"]
        elif key in started:
            took.setdefault(f"{m['phase']}/{m['rank']}", []).append(m["t"] - started.pop(key))
    return {name: statistics.median(v) for name, v in sorted(took.items())}


def finish(job: Job, proc: subprocess.Popen, deadline: float) -> int:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return -1


def kill_group(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        proc.wait(timeout=60)


def reference(base: Path) -> dict:
    job = Job(base, "reference")
    t0 = time.monotonic()
    rc = finish(job, job.start(), time.monotonic() + 600)
    if rc != 0:
        raise SystemExit(f"the unkilled reference run failed (exit {rc}):\n{job.log_text()[-3000:]}")
    step, actor = final_actor(job.run)
    out = {"durations": durations(job.read()), "actor": actor, "step": step, "wall_s": time.monotonic() - t0,
           "shm": shm_left(job)}
    shutil.rmtree(job.staging, ignore_errors=True)  # the staging base the bench made (the run cleared its own dir)
    return out


RESUMABLE = 3
"""From step 3's start on a committed state exists (step 1's staged copy commits before step 2's
staging starts), so `nereus resume` has one to restore after a whole job is killed (a job killed
earlier is started again, not resumed), and a restart has one to restore (the ``resume`` phase
kills inside that restore)."""


def cue(phase: str, target: str, rng: random.Random) -> tuple[str, int | None]:
    """The phase whose start is waited for and at which step: any step of the job where that
    phase runs and the target can come back from (a worker's restart also from nothing)."""
    low = RESUMABLE if target != "worker" or phase == "resume" else 1
    if phase in ("step", "hang", "resume"):
        return "step", rng.randint(low, STEPS)
    if phase == "save":
        return "save", rng.choice([DURABLE, 2 * DURABLE, STEPS])
    if phase == "stage":
        return "stage", rng.randint(max(1, low - 1), STEPS - 1)  # no staging after the last step
    return "transition", TRANSITION_AFTER


def strike(job: Job, proc: subprocess.Popen, mark: dict, window: float, target: str, rng: random.Random,
           sig=signal.SIGKILL, deadline: float | None = None) -> dict:
    """Sleep a random part of ``window`` after ``mark``, then signal the job or its worker.
    ``logged`` and ``committed`` are read again once the job's workers of the time are gone
    (``deadline`` bounds the wait; the ``launcher`` target reads them in ``resume_after_launcher``):
    a survivor may still log a step or commit a staged copy after the signal, and a step committed
    then and not restored is lost too."""
    time.sleep(max(0.0, mark["t"] + rng.uniform(0.0, window) - time.time()))
    workers = running({m["pid"] for m in job.read()} | children(proc.pid))  # a worker yet to mark too
    before = metrics(job.run)
    if target == "job":
        kill_group(proc)
    elif target == "launcher":  # the launcher process alone: its workers and resource tracker are not signalled
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    else:
        os.kill(mark["pid"], sig)
    t = time.time()
    ended = any(m["phase"] == mark["phase"] and m["step"] == mark["step"] and m["pid"] == mark["pid"] and m["edge"] == "end"
                and m["t"] < t for m in job.read())
    hit = {"t": t, "landed": not ended, "logged": newest_logged(before), "committed": committed(job), "workers": workers}
    if target != "launcher":
        hit["gone"] = wait_gone(workers, deadline if deadline is not None else time.monotonic() + TIMEOUT_S + 60)
        hit = settled(hit, newest_logged(metrics(job.run)), committed(job))
    return hit


def newest_logged(rows: list[dict]) -> int:
    return max((r["step"] for r in rows), default=0)


def settled(hit: dict, logged: int, committed_now: int | None) -> dict:
    """``hit`` with what was logged and committed read again once the signalled workers are
    gone: the newest of either reading (pure)."""
    seen = [c for c in (hit["committed"], committed_now) if c is not None]
    return {**hit, "logged": max(hit["logged"], logged), "committed": max(seen) if seen else None}


def start_time(pid: int) -> str | None:
    """A running process's start time (``/proc/PID/stat``), which tells it from a later process
    given its pid; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def children(pid: int) -> set[int]:
    """The workers ``pid`` (a launcher) spawned: its children that run multiprocessing's
    ``spawn_main`` — not its resource tracker, which lives as long as the launcher."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                if parent == pid:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if b"spawn_main" in f.read():
                            out.add(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def running(pids) -> dict[int, str]:
    """Those of ``pids`` that run, with their start times."""
    return {p: s for p in pids if (s := start_time(p)) is not None}


def wait_gone(procs: dict[int, str], deadline: float) -> bool:
    """Wait until none of ``procs`` (``running``'s) runs, or ``deadline``; whether they went."""
    while any(start_time(p) == s for p, s in procs.items()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def resume_after_launcher(job: Job, old: dict[int, str], hit: dict, deadline: float) -> tuple[subprocess.Popen, dict]:
    """After the launcher alone was SIGKILLed: ``nereus resume`` at once, again every 0.5 s
    while it is refused because the dead launcher's workers still run. ``overlap``: how many
    of those workers (``running``'s) were alive when the resumed job's first restore began (bar
    0: the new run never shares the run dir with them); ``orphans_s``: kill -> the last of them
    gone, when ``logged`` and ``committed`` are read again (``settled``)."""
    refused, gone_s, late = 0, None, {}
    while True:
        proc = job.start(resume=True)
        while proc.poll() is None and time.monotonic() < deadline:
            alive = [p for p, s in old.items() if start_time(p) == s]
            if not alive and gone_s is None:
                gone_s = time.time() - hit["t"]
                late = {k: v for k, v in settled(hit, newest_logged(metrics(job.run)), committed(job)).items()
                        if k in ("logged", "committed")}
            if any(m["pid"] not in old and m["phase"] == "restore" for m in job.read()):
                return proc, {"refused": refused, "overlap": len(alive), "orphans_s": gone_s, **late}
            time.sleep(0.005)
        if proc.poll() == 2 and REFUSED in job.last_log() and time.monotonic() < deadline:
            refused += 1
            time.sleep(0.5)
            continue
        return proc, {"refused": refused, "overlap": None, "orphans_s": gone_s, **late}


def trial(base: Path, ref: dict, phase: str, target: str, index: int, rng: random.Random, attempt: int = 0) -> dict:
    name = f"{phase}-{target}-{index}" + (f"-again{attempt}" if attempt else "")  # a trial done again: a run dir of its own
    job = Job(base, name)
    t0 = time.monotonic()
    deadline = t0 + 480
    proc = job.start()
    out: dict = {"phase": phase, "target": target, "trial": index}
    wait_phase, at = cue(phase, target, rng)
    rank = rng.randrange(2)
    mark = job.wait_mark(lambda m: m["phase"] == wait_phase and m["edge"] == "start" and m["rank"] == rank
                         and (at is None or m["step"] == at), proc, deadline)
    if mark is None:
        out["error"] = f"never saw {wait_phase} start at step {at}"
    else:
        window = 0.8 * ref["durations"].get(f"{wait_phase}/{rank}", 0.05)
        if phase == "hang":
            hit = strike(job, proc, mark, window, "worker", rng, signal.SIGSTOP, deadline)
            old = set(hit["workers"])  # marked before the signal, or the launcher's workers then
            back = job.wait_mark(lambda m: m["pid"] not in old, proc, deadline)  # its restore, or step 1 from nothing
            out["detect_s"] = (back["t"] - hit["t"]) if back else None
            if back is None:
                os.kill(mark["pid"], signal.SIGCONT)
        else:
            old = running({m["pid"] for m in job.read()} | children(proc.pid))  # the launcher target's workers
            hit = strike(job, proc, mark, window, target, rng, deadline=deadline)
            if phase == "resume":  # the second kill, inside the restore the first one caused
                seen = {m["pid"] for m in job.read()}
                proc = job.start(resume=True) if target == "job" else proc
                again = job.wait_mark(lambda m: m["phase"] == "restore" and m["edge"] == "start" and m["pid"] not in seen
                                      and m["rank"] == rank, proc, deadline)
                if again is None:
                    out["error"] = "never saw the restore start"
                else:
                    second = strike(job, proc, again, 0.8 * ref.get("restore_s", 0.3), target, rng, deadline=deadline)
                    hit = {**hit, "landed": second["landed"]}
        out.update(landed=hit["landed"], logged=hit["logged"], committed=hit["committed"])
        if hit.get("gone") is False:
            out["error"] = "the signalled job's workers did not go"
        if target == "job" and phase != "hang":
            proc = job.start(resume=True)
        elif target == "launcher":
            proc, after = resume_after_launcher(job, old, hit, deadline)
            out.update(after)
    rc = finish(job, proc, deadline)
    rows = metrics(job.run)
    steps = [r["step"] for r in rows]
    restores = [json.loads(line) for line in (job.run / "restores.jsonl").read_text().splitlines()] \
        if (job.run / "restores.jsonl").exists() else []
    restored = min((r["step"] for r in restores), default=None) if restores else None
    out.update(rc=rc, completed=rc == 0 and steps[-1:] == [STEPS], dup=len(steps) - len(set(steps)),
               missing=sorted(set(range(1, STEPS + 1)) - set(steps)), restores=[(r["source"], r["step"]) for r in restores])
    if "committed" in out and restored is None and "error" not in out:
        out["error"] = "no restore was recorded"
    if "committed" in out and restored is not None:
        out["lost"] = max(0, (out["committed"] or 0) - restored)
        out["recomputed"] = max(0, out["logged"] - restored)
        if "restore_s" in restores[0]:
            ref["restore_s"] = max(0.05, float(restores[0]["restore_s"]))  # the next resume trial's window
    if out["completed"]:
        step, actor = final_actor(job.run)
        out["diff"] = max(float((actor[k] - ref["actor"][k]).abs().max()) for k in ref["actor"]) if step == ref["step"] else None
    out["shm"] = shm_left(job)
    out["wall_s"] = time.monotonic() - t0
    if not out["completed"]:
        out["log_tail"] = job.log_text()[-2500:]
    shutil.rmtree(job.staging, ignore_errors=True)
    return out


def table(results: list[dict]) -> None:
    cols = ("target", "trial", "landed", "completed", "dup", "lost", "recomputed", "diff", "shm", "detect_s", "overlap",
            "restores", "wall_s")
    for phase in PHASES:
        rows = [r for r in results if r["phase"] == phase]
        if not rows:
            continue
        print(f"\n{phase}")
        print("  " + "  ".join(f"{c:>10}" for c in cols))
        for r in rows:
            cells = []
            for c in cols:
                v = r.get(c)
                v = len(v) if c == "shm" else v
                cells.append(f"{v:>10.3g}" if isinstance(v, float) else f"{str(v):>10}")
            print("  " + "  ".join(cells) + (f"  error: {r['error']}" if "error" in r else ""))


TRIES = 3
"""Attempts per trial: one whose signal came after its phase ended (its window is drawn from the
unkilled run's median duration) is done again, at most this many times in all."""
WEIGHTS_BAND = 1e-5
"""The float32 layout-invariance band (docs/correctness.md): a killed run's end weights against the unkilled one."""


def summary(results: list[dict]) -> dict:
    """The last line's figures over every trial (pure)."""
    diffs = [r["diff"] for r in results if r.get("diff") is not None]
    detects = [r["detect_s"] for r in results if r.get("detect_s") is not None]
    hangs = [r for r in results if r["phase"] == "hang"]
    launched = [r for r in results if r["target"] == "launcher" and "error" not in r]
    return {
        "trials": len(results),
        "trials_landed": sum(bool(r.get("landed")) for r in results),
        "trials_redone": sum(bool(r.get("redone")) for r in results),
        "trial_errors": sum("error" in r for r in results),
        "weights_compared": len(diffs),
        "jobs_completed": sum(r["completed"] for r in results),
        "steps_duplicated": sum(r["dup"] for r in results),
        "committed_steps_lost": sum(r.get("lost", 0) for r in results),
        "max_steps_recomputed": max((r.get("recomputed", 0) for r in results), default=0),
        "hang_detect_s": (max(detects) if len(detects) == len(hangs) else None) if hangs else None,
        "final_weights_max_diff": max(diffs) if diffs else None,
        "shm_leaked_files": sum(len(r["shm"]) for r in results),
        # the launcher alone SIGKILLed: its workers alive when the resumed job's restore began (bar 0; None: no such trial
        # or one never resumed), and how often a resume was refused while they ran
        "launcher_kill_overlap": (None if any(r.get("overlap") is None for r in launched) else
                                  sum(r["overlap"] for r in launched)) if launched else None,
        "launcher_resumes_refused": sum(r.get("refused", 0) for r in launched),
    }


def bars(out: dict, results: list[dict]) -> dict[str, bool]:
    """Each bar of ``summary``'s figures, passed or not (pure). None is never a pass: a hang
    never detected, a completed job whose end weights were not compared, a trial that went
    wrong (``error``: a fault that missed its phase, workers that never went, no restore)."""
    return {"steps_duplicated": out["steps_duplicated"] == 0, "committed_steps_lost": out["committed_steps_lost"] == 0,
            "max_steps_recomputed": out["max_steps_recomputed"] <= 1, "shm_leaked_files": out["shm_leaked_files"] == 0,
            "jobs_completed": out["jobs_completed"] == out["trials"],
            # a fault that missed its phase is no trial of it: done again (checked by every other bar all the same)
            "trials_landed": out["trials_landed"] + out["trials_redone"] == out["trials"],
            "trial_errors": out["trial_errors"] == 0,
            "final_weights_max_diff": out["final_weights_max_diff"] is not None and out["final_weights_max_diff"] <= WEIGHTS_BAND
            and out["weights_compared"] == out["jobs_completed"],
            "hang_detect_s": not any(r["phase"] == "hang" for r in results)
            or (out["hang_detect_s"] is not None and out["hang_detect_s"] <= TIMEOUT_S + 30),
            "launcher_kill_overlap": not any(r["target"] == "launcher" for r in results) or out["launcher_kill_overlap"] == 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="trials per phase and target")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {','.join(PHASES)}")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"job (the whole process group), worker (one worker), launcher (the launcher process alone; "
                             f"phases {','.join(LAUNCHER_PHASES)} only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench_results" / "faults.json"))
    args = parser.parse_args()
    phases = [p for p in args.phases.split(",") if p]
    targets = [t for t in args.targets.split(",") if t]
    bad = [p for p in phases if p not in PHASES] + [t for t in targets if t not in TARGETS]
    if bad or args.trials < 1:
        raise SystemExit(f"error: unknown phase or target {bad}, or --trials < 1 (phases: {PHASES}; targets: {TARGETS})")
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="nereus-faults-"))
    t0 = time.monotonic()
    ref = reference(base)
    print(f"reference: {ref['wall_s']:.1f}s, phase medians (phase/rank): "
          + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in sorted(ref["durations"].items())), flush=True)
    results = []
    for phase in phases:
        for target in (["worker"] if phase == "hang" else [t for t in targets if t != "launcher" or phase in LAUNCHER_PHASES]):
            for i in range(args.trials):
                for attempt in range(TRIES):  # a fault that missed its phase is no trial of it: done again
                    r = trial(base, ref, phase, target, i, rng, attempt)
                    r["redone"] = r.get("landed") is False and "error" not in r and attempt < TRIES - 1
                    results.append(r)
                    print(f"  {phase:>10} {target:>6} #{i}: completed={r['completed']} landed={r.get('landed')} "
                          f"dup={r['dup']} lost={r.get('lost')} recomputed={r.get('recomputed')} diff={r.get('diff')} "
                          f"shm={len(r['shm'])} detect_s={r.get('detect_s')} ({r['wall_s']:.0f}s)"
                          + (f" error={r['error']}" if "error" in r else "") + (" (missed: again)" if r["redone"] else ""),
                          flush=True)
                    if not r["redone"]:
                        break
    table(results)
    out = summary(results)
    passed = bars(out, results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": out, "bars": passed, "collective_timeout_s": TIMEOUT_S,
                                          "wall_s": time.monotonic() - t0, "trials": results,
                                          "reference": {"durations": ref["durations"], "wall_s": ref["wall_s"]}}, indent=1))
    verdicts = ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in passed.items())
    print(f"\nbars: {verdicts}; {time.monotonic() - t0:.0f}s; {args.out}")
    shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
