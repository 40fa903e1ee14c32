"""Benchmark: recovery of an elastic run after a worker's death, and the cost of staging.

    python tools/bench_elastic.py [--steps 12] [--kill-at 6] [--hidden 384] [--layers 4] [--out bench_results/elastic.json]

Job: tiny_grpo's task on 2 CPU processes (gloo), a Llama-shaped float32 actor of
``--hidden`` × ``--layers`` (AdamW state: params, fp32 masters, two moments), 8 prompts × 4
samples per step, durable checkpoints only at the end.

1. ``baseline``: the job with staging off (``elastic.staging=never``).
2. ``elastic``: the same job with ``--max-restarts 2`` and staging on; when the metrics
   show step ``--kill-at`` and the staged copy of an earlier step committed, one worker
   gets SIGKILL. The agent restarts both workers; they restore the staged copy and finish.
   Recovery (wall clock, from the kill; the bench polls the agent's children every 5 ms):
   ``detect+stop`` (the agent notices the death and the survivor is gone),
   ``rendezvous+spawn`` (the new worker processes exist), ``start`` (interpreter, imports,
   process group), ``re-plan`` (the sources agreed, the plan for
   the world), ``build`` (model-stages built in it), ``restore`` (state loaded and
   verified), ``first step`` (the first step after the restore completes);
   ``recovery_s`` is their sum: death -> first completed step.
3. ``restore``: on 2 fresh processes in the elastic run's plan (after one untimed warm-up
   of each), ``Trainer.restore`` from a copy in ``/dev/shm`` and from the durable
   checkpoint (the run dir on local disk). A finished run removes its staged copies, so the
   ``/dev/shm`` copy is the run's final checkpoint copied there: the staged copies' format
   and read path, the same step as the durable one — cold (its files dropped from the page cache
   first with ``POSIX_FADV_DONTNEED``, as after a node restart) and cached — alternated,
   median of ``--repeats`` each, the slowest rank's time; ``staged_over_durable`` = cold
   durable s / staged s (``staged_over_durable_cached`` in the JSON: the cached one).

Staging share: the staging's part of the critical path of a step (host copy + waiting for
the previous write) over the step with it, mean over the steps with a staging record;
``ab_share`` is the median step-time difference against the baseline (it includes the
background write's competition for the 2 cores: noisy on a shared machine).

Bars (issue 12): staged restore >= 3x faster than durable; staging <= 5% of the step.
The last printed line is one JSON object: staged_over_durable, recovery_s, staging_share.
"""

from __future__ import annotations

import argparse
import json
import os
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
PLAN = ["nproc=2", "plan.actor.train.dp=2", "plan.actor.gen.dp=1", "plan.actor.gen.tp=2", "plan.ref.infer.dp=1", "plan.ref.infer.tp=2"]


def job_sets(args, staging: str, shm: str) -> list[str]:
    heads = 4  # TP 2 divides them and their 2 KV heads
    return [*PLAN, f"steps={args.steps}", "checkpoint_every=0", "rollout.prompts_per_step=8", "grpo.minibatch_size=32",
            "logging.trackers=[]", f"model.hidden_size={args.hidden}", f"model.intermediate_size={3 * args.hidden}",
            f"model.num_layers={args.layers}", f"model.num_heads={heads}", f"model.num_kv_heads={heads // 2}",
            f"elastic.staging={staging}", f"elastic.staging_dir={shm}", "elastic.collective_timeout_s=60"]


def command(run_dir: Path, sets: list[str], restarts: int) -> list[str]:
    return [sys.executable, "-c", "from nereus.cli.app import main; main()", "train", str(CONFIG), "--run-dir", str(run_dir),
            "--max-restarts", str(restarts), *[a for s in sets for a in ("--set", s)]]


def metrics(run_dir: Path) -> list[dict]:
    out = []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def workers(parent: int) -> list[int]:
    children: list[int] = []
    for task in os.listdir(f"/proc/{parent}/task"):
        try:
            children += map(int, open(f"/proc/{parent}/task/{task}/children").read().split())
        except OSError:
            pass
    out = []
    for pid in sorted(set(children)):
        try:
            if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read():
                out.append(pid)
        except OSError:  # it exited between the listing and the read
            pass
    return out


def watch_restart(parent: int, old: list[int], deadline: float) -> dict:
    """Poll the agent's children after the kill: when the survivor is gone (the agent noticed
    the death and stopped the group) and when the new workers exist (rendezvous, spawn)."""
    out = {}
    while time.monotonic() < deadline and "respawned" not in out:
        now = workers(parent)
        if "stopped" not in out and not set(old) & set(now):
            out["stopped"] = time.time()
        if "stopped" in out and len(set(now) - set(old)) >= len(old):
            out["respawned"] = time.time()
        time.sleep(0.005)
    return out


def evict(root: Path) -> None:
    """Drop a checkpoint's files from the page cache (POSIX_FADV_DONTNEED: clean pages of our
    own files; no privilege): the next read comes from the disk, as after a node restart."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def plain_read(root: Path) -> float:
    """Seconds to read every file under ``root`` into one reused buffer (``readinto``): what
    a restore of it cannot go below."""
    files = [p for p in root.rglob("*") if p.is_file()]
    buf = bytearray(max(p.stat().st_size for p in files))
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            view, done = memoryview(buf), 0
            while (n := f.readinto(view[done:])):
                done += n
    return time.perf_counter() - t0


def run(run_dir: Path, sets: list[str], *, restarts: int = 0, kill_at: int | None = None, timeout: float = 900) -> dict:
    job = subprocess.Popen(command(run_dir, sets, restarts), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    killed = None
    try:
        deadline = time.monotonic() + timeout
        while kill_at is not None and killed is None and job.poll() is None and time.monotonic() < deadline:
            lines = metrics(run_dir)
            staged = lines[-1].get("staging", {}) if lines else {}
            if lines and lines[-1]["step"] >= kill_at and staged.get("write_s") is not None:
                old = workers(job.pid)
                os.kill(old[-1], signal.SIGKILL)
                killed = {"time": time.time(), "step": lines[-1]["step"]}
                killed.update(watch_restart(job.pid, old, deadline))
            time.sleep(0.01)
        out, _ = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    if job.returncode != 0:
        raise SystemExit(f"the job failed ({job.returncode}):\n{out[-4000:]}")
    return {"killed": killed, "metrics": metrics(run_dir), "output": out}


def _time_restores(staged_root: str, durable_root: str, config_path: str, repeats: int) -> dict:
    """One worker: build the trainer in the run's plan, time restores from both sources."""
    import torch.distributed as dist

    from nereus.trainer.prepare import load_config
    from nereus.trainer.runtime.step import Trainer
    from nereus.trainer.runtime.worker import join_process_group

    import torch

    join_process_group(torch.device("cpu"), 60)
    try:
        cfg = load_config(json.loads(Path(config_path).read_text()))
        trainer = Trainer(cfg, "cpu")
        times: dict[str, list[float]] = {"staged": [], "durable": [], "durable_warm": []}
        trainer.restore(staged_root), trainer.restore(durable_root)  # warm-up: first-time costs (imports, planning caches)
        for _ in range(repeats):
            for kind, root in (("staged", staged_root), ("durable", durable_root), ("durable_warm", durable_root)):
                if kind == "durable" and dist.get_rank() == 0:
                    evict(Path(durable_root))
                dist.barrier()
                t0 = time.perf_counter()
                trainer.restore(root)
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a restore lasts as long as its slowest rank
                times[kind].append(float(took))
        nbytes = sum(t.numel() * t.element_size() for s in trainer.trained_stages() for t in s.buffers().values())
        reads: dict[str, list[float]] = {"staged": [], "durable": []}
        if dist.get_rank() == 0:  # the bound: the bytes alone, read plainly (the other rank idle)
            for _ in range(repeats):
                reads["staged"].append(plain_read(Path(staged_root)))
                evict(Path(durable_root))
                reads["durable"].append(plain_read(Path(durable_root)))
        dist.barrier()
        return {**times, "bytes_per_rank": nbytes, "plain_read": reads}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench_results" / "elastic.json")
    args = parser.parse_args()
    if not 2 <= args.kill_at < args.steps:
        raise SystemExit(f"--kill-at must be in [2, --steps), got {args.kill_at}")
    work = Path(tempfile.mkdtemp(prefix="nereus-bench-elastic-"))
    shm = f"/dev/shm/nereus-bench-{uuid.uuid4().hex[:10]}"
    try:
        base = run(work / "baseline", job_sets(args, "never", shm + "-off"))
        elastic = run(work / "elastic", job_sets(args, "always", shm), restarts=2, kill_at=args.kill_at)
        from nereus.launch import launch_local

        shutil.copytree(work / "elastic" / "checkpoints", shm + "-final")  # the finished run removed its staged copies
        res = launch_local(_time_restores, 2, shm + "-final", str(work / "elastic" / "checkpoints"),
                           str(work / "elastic" / "config.json"), args.repeats, run_id=f"bench-{uuid.uuid4().hex[:6]}")[0]
        record = json.loads((work / "elastic" / "restores.jsonl").read_text().splitlines()[-1])
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(shm + "-off", ignore_errors=True)
        shutil.rmtree(shm + "-final", ignore_errors=True)
    report(args, base, elastic, res, record)
    shutil.rmtree(work, ignore_errors=True)


def report(args, base: dict, elastic: dict, res: dict, record: dict) -> None:
    kill = elastic["killed"]["time"]
    seen = elastic["killed"]
    splits = {
        "detect+stop": seen["stopped"] - kill,
        "rendezvous+spawn": seen["respawned"] - seen["stopped"],
        "start": record["joined"] - seen["respawned"],
        "re-plan": record["planned"] - record["joined"],
        "build": record["built"] - record["planned"],
        "restore": record["restored"] - record["built"],
        "first step": record["first_step_done"] - record["restored"],
    }
    recovery = record["first_step_done"] - kill
    staged_s, durable_s = statistics.median(res["staged"]), statistics.median(res["durable"])
    warm_s = statistics.median(res["durable_warm"])
    rows = [r for r in elastic["metrics"] if "staging" in r and "copy_s" in r["staging"]]
    blocking = [r["staging"]["copy_s"] + r["staging"]["wait_s"] for r in rows]
    steps = [r["step_seconds"] for r in rows]
    share = statistics.mean(b / (s + b) for b, s in zip(blocking, steps))
    writes = [r["staging"]["write_s"] for r in rows if r["staging"].get("write_s") is not None]
    base_steps = [r["step_seconds"] for r in base["metrics"][2:]]
    # medians: one step slowed by another job on the machine moves a mean by more than the staging does
    ab = statistics.median(s + b for s, b in zip(steps, blocking)) / statistics.median(base_steps) - 1 if base_steps else None
    print(f"job: {args.layers} layers × hidden {args.hidden}, 2 processes; state per rank {res['bytes_per_rank'] / 2**20:.1f} MiB; "
          f"killed at step {elastic['killed']['step']}, restored {record['source']} step {record['step']}")
    print(f"{'recovery piece':<18}{'seconds':>10}")
    for name, s in splits.items():
        print(f"{name:<18}{s:>10.3f}")
    print(f"{'death -> step':<18}{recovery:>10.3f}")
    print()
    print(f"{'restore from':<18}{'median s':>10}  runs")
    print(f"{'staged (/dev/shm)':<18}{staged_s:>10.4f}  {[round(x, 4) for x in res['staged']]}")
    print(f"{'durable (cold)':<18}{durable_s:>10.4f}  {[round(x, 4) for x in res['durable']]}")
    print(f"{'durable (cached)':<18}{warm_s:>10.4f}  {[round(x, 4) for x in res['durable_warm']]}")
    print(f"staged_over_durable {durable_s / staged_s:.2f} cold (bar >= 3); {warm_s / staged_s:.2f} with the durable files in the page cache")
    reads = res["plain_read"]
    read_s, read_d = statistics.median(reads["staged"]), statistics.median(reads["durable"])
    bound = (staged_s + read_d - read_s) / staged_s
    print(f"the disk's part: both ranks' files read plainly on one rank, staged {read_s:.4f} s, durable cold {read_d:.4f} s "
          f"({read_d / read_s:.1f}x); the staged restore plus the {read_d - read_s:.4f} s more the cold disk takes for "
          f"those bytes: {bound:.2f}x (the ratio a restore whose other work is the same on both sources reaches)")
    print()
    print(f"staging per step: copy {statistics.mean(r['staging']['copy_s'] for r in rows):.4f}s, "
          f"wait {statistics.mean(r['staging']['wait_s'] for r in rows):.4f}s, background write "
          f"{statistics.mean(writes) if writes else float('nan'):.4f}s; step median {statistics.median(steps):.3f}s "
          f"(baseline {statistics.median(base_steps):.3f}s)")
    print(f"staging_share {share:.4f} (bar <= 0.05); ab_share {ab:+.4f}")
    headline = {"staged_over_durable": durable_s / staged_s, "recovery_s": recovery, "staging_share": share}
    out = {"job": {"layers": args.layers, "hidden": args.hidden, "steps": args.steps, "nproc": 2,
                   "bytes_per_rank": res["bytes_per_rank"]},
           "killed_step": elastic["killed"]["step"], "restored": {k: record[k] for k in ("source", "step", "restore_s")},
           "recovery_split_s": splits, "staged_over_durable_cached": warm_s / staged_s,
           "restore_s": {"staged": res["staged"], "durable": res["durable"], "durable_cached": res["durable_warm"]},
           "plain_read_s": reads, "disk_bound_ratio": bound,
           "staging": {"copy_s": [r["staging"]["copy_s"] for r in rows], "wait_s": [r["staging"]["wait_s"] for r in rows],
                       "write_s": writes, "step_s": steps, "baseline_step_s": base_steps, "ab_share": ab},
           **headline}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
