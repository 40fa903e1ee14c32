"""What the elastic tests share: the small jobs they run, and reading and killing processes."""

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY_GRPO = os.path.join(ROOT, "configs", "tiny_grpo.yaml")
SMALL = ["rollout.prompts_per_step=8", "grpo.minibatch_size=32", "logging.trackers=[]"]
TWO = ["nproc=2", "plan.actor.train.dp=2", "plan.actor.gen.dp=1", "plan.actor.gen.tp=2", "plan.ref.infer.dp=1", "plan.ref.infer.tp=2"]
ONE = ["nproc=1", "plan.actor.train.dp=1", "plan.actor.train.dp_shard=false", "plan.actor.gen.dp=1", "plan.actor.gen.tp=1",
       "plan.ref.infer.dp=1", "plan.ref.infer.tp=1"]
KEYS = ("actor/loss", "reward_mean", "kl", "actor/grad_norm", "response_length")


def read_metrics(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    return out


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie its parent has yet to reap)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def retire_newest(root: str, at_least: int) -> None:
    """Delete ``root``'s newest committed checkpoint when its step is >= ``at_least`` (manifest
    first, then data: what retention does to the oldest)."""
    from nereus.store.checkpoint import CheckpointStore
    from nereus.store.records import checkpoint_key

    store = CheckpointStore(root)
    steps = store.steps()
    if steps and steps[-1] >= at_least:
        entry = store.meta.get(checkpoint_key(steps[-1]))
        store.meta.put(entry.key, None, expect=entry.generation)
        store.remove_data(entry.value["data"])


def worker_pids(parent: int) -> list[int]:
    """The agent's worker processes among ``parent``'s children (multiprocessing spawn
    children; not its resource tracker), in start order: local rank order."""
    children = []
    for task in os.listdir(f"/proc/{parent}/task"):
        try:
            children += map(int, open(f"/proc/{parent}/task/{task}/children").read().split())
        except OSError:
            pass
    workers = []
    for pid in sorted(set(children)):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            workers.append(pid)
    return workers


def _launcher(run_dir, endpoint: str, steps: int, staging_dir: str, log, via: str, *, nnodes: str = "1:2",
              sets: tuple = (*ONE, "checkpoint_every=1")) -> subprocess.Popen:
    """One node's launch of `nereus train` on ``--nnodes`` — its own launcher (``via``
    "nereus") or torchrun with the ``nereus`` rendezvous backend ("torchrun") — one worker,
    its own session, its output to the file ``log`` (a pipe nobody reads could fill and
    stall it). ``staging_dir``: the node's own (two nodes never share a /dev/shm)."""
    sets = [*SMALL, *sets, f"steps={steps}", "elastic.collective_timeout_s=30", "elastic.last_call_s=2"]
    train = ["train", TINY_GRPO, "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    if via == "nereus":
        cmd = [sys.executable, "-c", "from nereus.cli.app import main; main()", *train, "--nnodes", nnodes, "--max-restarts", "3",
               "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3",
               "--rdzv-backend", "nereus", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
               "--rdzv-conf", "last_call_timeout=2", "--monitor-interval", "0.1", "-m", "nereus.cli.app", *train]
    env = {**os.environ, "NEREUS_STAGING_DIR": staging_dir}  # the job's config is rank 0's: a node's own path is in its env
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts each worker in a session of its own)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = list(map(int, open(f"/proc/{parent}/task/{task}/children").read().split()))
            except OSError:
                continue
            out += children
            todo += children
    return out


def kill_node(job: subprocess.Popen) -> None:
    """SIGKILL a node: its launcher, its session and every process below it."""
    below = descendants(job.pid)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone already
    job.wait(timeout=30)


def _wait_for(run_dir, ok, deadline: float, what: str) -> list[dict]:
    while time.monotonic() < deadline:
        lines = read_metrics(run_dir)
        if ok(lines):
            return lines
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; metrics: {[(r['step'], len(r['peak_memory_bytes'])) for r in read_metrics(run_dir)]}")
