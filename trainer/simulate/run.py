"""The simulation: the controller's policies through the step loop, the baselines priced in
hindsight, all on the same world (``world/``).

Per trace step, for each loop policy (``policies.py``: ``adaptive``, ``controller_greedy``):
a change of the devices first (``resize``: the world trigger); a world no plan runs on makes
the policy wait — the step does not run, and the time passes at the policy's last step's
pace. Then the step runs on the policy's plan: the world (``Ground.world``) gives the
pieces' measured seconds and every rank's peak, as the step loop's metrics; the step is
booked at the world's noise-free seconds (``Ground.exact``); a peak over the device's
memory, or a failure in the trace, costs a restart (``world.restart_seconds``) and the step
again. Then the policy reacts (``after``: the controller observes and decides), and an
admitted move costs the world's transition.

The baselines (``baselines.py``: ``best_static``, ``initial_fixed``, ``oracle``, ``greedy``)
are paths over the table of the candidate pool's world seconds (the adaptive policies'
plans added to it), booked the same way: a step no plan of the pool runs within the memory is
waited out at the pace of the path's last step that ran (0 s before any ran), and recorded
as a wait (``skipped_steps``/``skipped_at`` in the info; none runnable at all: a
SimulateError naming the trace); a step over the memory is a restart and the step again
(counted per policy in ``oom_steps``: a plan that never fits pays it at every step); a move
costs the cheaper of the world's transition and a restart (a restart booked under
restarts). The oracle is checked to bound every table baseline, and every loop policy whose
plans are in its set and whose waits are the table's: a SimulateError if not.

    run time = Σ step seconds + Σ transitions + Σ restarts (+ the redone steps) + Σ waits
    mean step latency = the mean of the steps' seconds that ran
    X_over_Y = Y's run time ÷ X's (the same steps: Y's mean time per step ÷ X's, transitions,
               restarts and waits counted); 1.10: X is 10% faster

The initial plan (every loop policy starts from it, and ``initial_fixed`` keeps it): the
job's, or (``plan: auto``) the controller's search at the job's declared prompt and response
means (``baselines.initial_plan``) on the first world of the trace that has a plan.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from ..config import ConfigError, JobConfig
from . import baselines as B
from .inputs import Cluster, JobInput, SimulateError, load_world, write_profile
from .policies import POLICIES, Ground, Move, Policy, label, worlds
from .traces import TraceStep

BASELINES = ("best_static", "initial_fixed", "oracle", "greedy")
DEFAULT = ("best_static", "initial_fixed", "oracle", "greedy", "adaptive")


@dataclass(kw_only=True)
class PolicyResult:
    name: str
    steps: list[dict] = field(default_factory=list)  # step, devices, seconds (None: waited), plan
    moves: list[Move] = field(default_factory=list)
    decision_ms: list[float] = field(default_factory=list)
    waits: list[dict] = field(default_factory=list)  # step, devices, why
    restarts: list[dict] = field(default_factory=list)  # step, why (an OOM, a failure, or a restart into a new world)
    step_seconds: float = 0.0
    transition_seconds: float = 0.0
    restart_seconds: float = 0.0
    wait_seconds: float = 0.0
    errors: list[dict] = field(default_factory=list)  # step, error: the controller failed (logged, the plan kept)
    plans: list[JobConfig] = field(default_factory=list)  # every config it ran a step on
    wall_seconds: float = 0.0  # this machine's time spent in the policy (its controller, its search), the truth's apart

    @property
    def ran(self) -> list[float]:
        return [s["seconds"] for s in self.steps if s["seconds"] is not None]

    @property
    def mean_latency(self) -> float:
        ran = self.ran
        return sum(ran) / len(ran) if ran else float("nan")

    @property
    def run_seconds(self) -> float:
        return self.step_seconds + self.transition_seconds + self.restart_seconds + self.wait_seconds

    @property
    def transition_share(self) -> float:
        return self.transition_seconds / self.run_seconds if self.run_seconds else 0.0


@dataclass(kw_only=True)
class SimResult:
    cluster: Cluster
    job: JobInput
    trace_name: str
    trace: list[TraceStep]
    initial_plan: str
    initial_cfg: JobConfig
    results: dict[str, PolicyResult]
    sim_seconds: float
    truth: dict  # the world: its parameters' name, seed, noise; the candidate pool and the oracle's set


def initial_config(cluster: Cluster, job: JobInput, trace: list[TraceStep], profile_path: str, memory_gib: float | None = None) -> JobConfig:
    """The config every policy starts from (module docstring)."""
    profile = cluster.profile()
    memory_gib = profile.memory_gib if memory_gib is None else memory_gib
    if not trace:
        raise SimulateError("the trace has no steps")
    if not any(t.devices for t in trace):
        raise SimulateError(f"the trace has no devices: every one of its {len(trace)} steps has 0 devices available")
    errors, tried = [], set()
    for t in trace:
        for n in worlds(min(t.devices, cluster.devices)):
            if n in tried:
                continue
            tried.add(n)
            try:
                cfg = job.job_config(n, steps=len(trace), profile_path=profile_path, memory_gib=memory_gib)
                if job.plan != "auto":
                    return cfg
                plan = B.initial_plan(cfg, profile, prompt_mean=job.prompt.mean, response_mean=job.response.mean)
                return dataclasses.replace(cfg, plan=plan)
            except ConfigError as e:
                errors.append((n, str(e)))
                if "does not exist" in str(e) or "unknown key" in str(e) or job.plan != "auto":
                    raise SimulateError(f"job {job.name!r} on {n} devices of {cluster.device}: {e}") from None
    n, why = max(errors, key=lambda e: e[0]) if errors else (0, "the trace has no devices")
    raise SimulateError(f"job {job.name!r} ({job.model}) cannot be placed on {cluster.device} devices "
                        f"({profile.memory_gib:g} GiB each) at any world of the trace, the largest tried {n}: {why}")


def simulate(cluster: Cluster, job: JobInput, trace: list[TraceStep], *, trace_name: str = "trace",
             policies: tuple[str, ...] = DEFAULT, run_dir: str | None = None,
             work_dir: str | None = None, cfg: JobConfig | None = None, oracle_set: int = B.ORACLE_SET,
             pool_top: int = 64, world=None) -> SimResult:
    """Run every policy through ``trace`` (module docstring). ``run_dir``: the adaptive
    controller writes its logs there (predictions.jsonl, transitions.jsonl) and the loop the
    step metrics, as a live run (``nereus report`` reads it). ``cfg``: this job config as
    it is (a real run's, ``replay.py``) instead of the job input's. ``world``: this World
    (noisy) instead of the cluster's."""
    known = (*BASELINES, *POLICIES)
    unknown = [p for p in policies if p not in known]
    if unknown:
        raise SimulateError(f"unknown policy {unknown[0]!r}; known: {', '.join(known)}")
    if oracle_set < 1:
        raise SimulateError(f"the oracle's candidate set must hold at least 1 plan, got {oracle_set}")
    start = time.perf_counter()
    check_trace(trace, job, strict=cfg is None)  # a real run's (replay): its own steps and cap
    profile = cluster.profile()
    if max(t.devices for t in trace) > cluster.devices:
        worst = max(trace, key=lambda t: t.devices)
        raise SimulateError(f"trace step {worst.step} asks for {worst.devices} devices; cluster {cluster.name!r} has {cluster.devices}")
    given = cfg is not None
    pm = None if given else job.prompt.mean
    noisy = world if world is not None else load_world(cluster, job, prompt_mean=pm)
    exact = type(noisy)(noisy.params, seed=noisy.seed, prompt_mean=noisy.prompt_mean, noise=False)
    ground = Ground(world=noisy, exact=exact, profile=profile, restart_seconds=job.world.restart_seconds)
    with tempfile.TemporaryDirectory(prefix="nereus-sim-") as tmp:
        profile_path = write_profile(profile, os.path.join(work_dir or tmp, "device_profile.yaml"))
        if cfg is None:
            cfg = initial_config(cluster, job, trace, profile_path, memory_gib=noisy.params.memory_gib)
        loop = [p for p in policies if p in POLICIES]
        results = run_loop(cfg, ground, trace, job, loop, run_dir) if loop else {}
        info = {"world": noisy.params.name, "seed": noisy.seed, "noise": noisy.noisy, "restart_seconds": job.world.restart_seconds}
        wanted = [p for p in policies if p in BASELINES]
        if wanted:
            t0 = time.perf_counter()
            table_results, tinfo = run_baselines(cfg, ground, trace, job, wanted, results, oracle_set=oracle_set, pool_top=pool_top,
                                                       trace_name=trace_name)
            results.update(table_results)
            info.update(tinfo, baselines_wall_seconds=time.perf_counter() - t0)
        results = {name: results[name] for name in policies}
        info["oom_steps"] = {name: oom_steps(p) for name, p in results.items()}  # per policy: steps over the memory, each redone
    return SimResult(cluster=cluster, job=job, trace_name=trace_name, trace=trace, initial_plan=label(cfg.plan), initial_cfg=cfg, results=results,
                     sim_seconds=time.perf_counter() - start, truth=info)


def run_loop(cfg: JobConfig, ground: Ground, trace: list[TraceStep], job: JobInput, names: list[str], run_dir: str | None) -> dict[str, PolicyResult]:
    """The loop policies through the trace (module docstring)."""
    active: dict[str, Policy] = {}
    for name in names:
        kwargs = {"run_dir": os.path.join(run_dir, name)} if run_dir and name == "adaptive" else {}
        active[name] = POLICIES[name](cfg, ground, **kwargs)
    results = {name: PolicyResult(name=name) for name in names}
    metrics_logs = _open_logs(run_dir, cfg) if run_dir and "adaptive" in names else None
    seen = {name: cfg.nproc for name in names}
    try:
        for t in trace:
            running = []
            for name, policy in active.items():
                t0 = time.perf_counter()
                if _prepare(policy, results[name], t, seen):
                    running.append(name)
                results[name].wall_seconds += time.perf_counter() - t0
            cfgs = [active[n].cfg for n in running]
            steps = ground.world.step_many(cfgs, t, peaks=[active[n].reads_memory for n in running])
            booked = ground.exact.step_many(cfgs, t, peaks=[False] * len(cfgs)) if ground.exact is not ground.world else steps
            for name, (metrics, _, _), (_, seconds, oom) in zip(running, steps, booked):
                ran_on, t0 = active[name].cfg, time.perf_counter()
                results[name].plans.append(ran_on)
                _account(active[name], results[name], t, metrics, seconds, oom, job)
                results[name].wall_seconds += time.perf_counter() - t0
                if metrics_logs is not None and name == "adaptive":
                    metrics_logs.write(_metrics_line(metrics, ran_on))
    finally:
        if metrics_logs is not None:
            metrics_logs.close()
    for name, policy in active.items():
        results[name].moves = list(policy.moves)
        results[name].decision_ms = list(policy.decision_ms)
        results[name].errors = list(policy.errors)
    return results


def run_baselines(cfg: JobConfig, ground: Ground, trace: list[TraceStep], job: JobInput, names: list[str], ran: dict[str, PolicyResult],
                  *, oracle_set: int, pool_top: int, trace_name: str = "trace") -> tuple[dict[str, PolicyResult], dict]:
    """The baselines over the candidate pool's table (``baselines.py``), refined on the world;
    the loop policies' plans join it (and the oracle's set) as they ran (pinned). The oracle
    must bound every table baseline and every loop policy whose plans are in its set and whose
    waits are the table's (a SimulateError otherwise: the bookings disagree)."""
    t0 = time.perf_counter()
    memory = ground.exact.params.memory_gib if cfg.device_memory_gib is None else cfg.device_memory_gib
    templates = B.pool(cfg, trace, ground.profile, prompt_mean=ground.exact.prompt_mean,
                       top=pool_top, memory_gib=memory)
    table = B.Table(exact=ground.exact, trace=trace, restart_seconds=job.world.restart_seconds, name=trace_name)
    (initial,) = table.add([cfg])
    table.add(templates)
    visited = []
    for r in ran.values():
        visited += table.add(r.plans, pinned=True)
    pool_size = len(table.templates)
    table.run_steps()  # a SimulateError naming the trace when no plan runs any step
    best = B.refine(table, [B.best_static(table), initial], prompt_mean=ground.exact.prompt_mean)
    pool_seconds = time.perf_counter() - t0
    runs, steps = table.runnable(), table.run_steps()  # the refined plans may run more steps
    must = [best, initial, *visited]
    ks = B.oracle_set(table, must, size=oracle_set)
    out: dict[str, PolicyResult] = {}
    paths: dict[str, B.Path] = {}
    for name in names:
        t1 = time.perf_counter()
        if name == "best_static":
            if best is None:
                out[name] = _unrun(name, trace, "no plan of the pool holds a replica on every runnable step")
                continue
            picks = [best] * len(steps)
        elif name == "initial_fixed":
            if not np.isfinite(table.raw[initial, steps]).all():
                out[name] = _unrun(name, trace, "the initial plan holds no replica on some step's devices")
                continue
            picks = [initial] * len(steps)
        elif name == "oracle":
            picks = B.viterbi(table, ks)
        else:
            picks = B.greedy(table, ks)
        paths[name] = path = B.path_of(table, name, picks)
        out[name] = _result(name, table, path, runs, time.perf_counter() - t1)
    if "oracle" in paths:
        bound = paths["oracle"].total
        skipped = {table.trace[s].step for s in np.flatnonzero(~runs)}
        for name, p in paths.items():  # every table baseline's plans are in the set: none beats the oracle
            if name != "oracle" and bound > p.total * (1 + 1e-9) + 1e-9:
                raise SimulateError(f"trace {trace_name!r}: the oracle ({bound:.6g} s) is slower than {name} ({p.total:.6g} s)")
        for name, r in ran.items():
            if {w["step"] for w in r.waits} == skipped and set(table.add(r.plans, pinned=True)) <= set(ks):
                if bound > r.run_seconds * (1 + 1e-9) + 1e-9:
                    raise SimulateError(f"trace {trace_name!r}: the oracle ({bound:.6g} s) is slower than {name} ({r.run_seconds:.6g} s)")
    info = {"pool": pool_size, "refined": len(table.templates) - pool_size, "oracle_set": len(ks), "oracle_set_cap": oracle_set, "pool_wall_seconds": pool_seconds,
            "loop_plans_in_set": len(set(visited)), "free_moves_seconds": B.free_moves(table),
            "best_static_plan": label(table.templates[best].plan) if best is not None else None,
            "best_static_devices": table.templates[best].nproc if best is not None else None,
            "skipped_steps": int((~runs).sum()), "skipped_at": _spans([table.trace[s].step for s in np.flatnonzero(~runs)])}
    return out, info


def oom_steps(r: PolicyResult) -> int:
    """The steps a policy ran over the device's memory (each booked as a restart and the step again)."""
    return sum(x["why"] == "out of memory" for x in r.restarts)


def _spans(steps: list[int]) -> str:
    """1, 2, 3, 7 → '1–3, 7' ('' for none)."""
    out: list[list[int]] = []
    for s in steps:
        if out and out[-1][1] == s - 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(f"{a}–{b}" if a != b else f"{a}" for a, b in out)


def _unrun(name: str, trace: list[TraceStep], why: str) -> PolicyResult:
    r = PolicyResult(name=name)
    r.waits = [{"step": t.step, "devices": t.devices, "why": why} for t in trace]
    r.steps = [{"step": t.step, "devices": t.devices, "seconds": None, "plan": None} for t in trace]
    r.step_seconds = float("nan")
    return r


def _result(name: str, table: B.Table, path: B.Path, runs: np.ndarray, wall: float) -> PolicyResult:
    r = PolicyResult(name=name, wall_seconds=wall)
    for s, t in enumerate(table.trace):
        k = path.picks[s]
        if k < 0 or not runs[s]:
            r.waits.append({"step": t.step, "devices": t.devices, "why": "no plan of the pool runs on these devices within the memory"})
            r.steps.append({"step": t.step, "devices": t.devices, "seconds": None, "plan": None})
            continue
        c = table.scaled[k][t.devices]
        r.steps.append({"step": t.step, "devices": c.nproc, "seconds": float(path.step_seconds[s]), "plan": label(c.plan)})
        r.plans.append(c)
    r.step_seconds = float(path.step_seconds.sum())
    r.restart_seconds = float(path.restart_seconds.sum())
    r.wait_seconds = float(path.wait_seconds.sum())
    oom = set(path.oom)
    for s in path.restarts:  # as the loop's _account names them
        r.restarts.append({"step": table.trace[s].step, "why": "out of memory" if s in oom else "failure"})
    for s, i, j, seconds, a_devices, kind in path.moves:
        t = table.trace[s]
        a, b = table.scaled[i][a_devices], table.scaled[j][t.devices]  # from the devices of the step before it that ran
        move = Move(step=t.step, kind=kind, trigger=name, seconds=seconds, predicted_s=None, nbytes=0,
                    old=label(a.plan), new=label(b.plan), devices=b.nproc)
        r.moves.append(move)
        if kind == "restart":  # cheaper than the live move: booked under restarts, as the loop's _book does
            r.restart_seconds += seconds
            r.restarts.append({"step": t.step, "why": f"restart on {b.nproc} devices ({name}): cheaper than the live move"})
        else:
            r.transition_seconds += seconds
    return r


def _prepare(policy: Policy, out: PolicyResult, t: TraceStep, seen: dict) -> bool:
    """A change of the devices and the oracle's choice before trace step ``t``; False when
    the policy waits this step out (recorded at its last step's pace)."""
    if t.devices != seen[policy.name] or policy.waiting:
        seen[policy.name] = t.devices
        _book(out, policy.resize(t))
    if not policy.waiting:
        policy.before(t)
    if not policy.waiting:
        return True
    pace = next((s["seconds"] for s in reversed(out.steps) if s["seconds"] is not None), 0.0)
    out.wait_seconds += pace
    out.waits.append({"step": t.step, "devices": t.devices, "why": policy.waiting})
    out.steps.append({"step": t.step, "devices": t.devices, "seconds": None, "plan": None})
    return False


def _account(policy: Policy, out: PolicyResult, t: TraceStep, metrics: dict, seconds: float, oom: bool, job: JobInput) -> None:
    """Book a step that ran, then let the policy react (an admitted move costs its transition)."""
    out.step_seconds += seconds
    if oom or t.failed:
        out.restart_seconds += job.world.restart_seconds + seconds
        out.restarts.append({"step": t.step, "why": "out of memory" if oom else "failure"})
    out.steps.append({"step": t.step, "devices": policy.cfg.nproc, "seconds": seconds, "plan": label(policy.cfg.plan)})
    _book(out, policy.after(t, metrics))


def _book(out: PolicyResult, move: Move | None) -> None:
    """A move's seconds: a restart (into a new world, ``nereus resume``'s path) is a restart, the rest transitions."""
    if move is None:
        return
    if move.kind == "restart":
        out.restart_seconds += move.seconds
        out.restarts.append({"step": move.step, "why": f"restart on {move.devices} devices ({move.trigger}): no live move fits the memory"})
    else:
        out.transition_seconds += move.seconds


def check_trace(trace: list[TraceStep], job: JobInput, *, strict: bool = True) -> None:
    """A trace the loop can run: steps, devices, steps numbered 1 … N (the controller plans
    ``steps = N`` and stops deciding at the last), responses within the job's ``response.max``."""
    if not trace:
        raise SimulateError("the trace has no steps (--steps 0, or an empty trace)")
    for i, t in enumerate(trace, 1):
        if not strict:
            break
        if t.step != i:
            raise SimulateError(f"trace step {i} is numbered {t.step}: steps must be numbered 1 … {len(trace)} without gaps")
        if t.response_max > job.response.max:
            raise SimulateError(f"trace step {t.step}: response_max {t.response_max} exceeds the job's response.max {job.response.max}")


def _open_logs(run_dir: str, cfg: JobConfig):
    import json

    from ..config import config_to_dict

    os.makedirs(os.path.join(run_dir, "adaptive"), exist_ok=True)
    with open(os.path.join(run_dir, "adaptive", "config.json"), "w") as f:
        json.dump({**config_to_dict(cfg), "run_dir": os.path.join(run_dir, "adaptive")}, f, indent=1)
    return open(os.path.join(run_dir, "adaptive", "metrics.jsonl"), "w")


def _metrics_line(metrics: dict, cfg: JobConfig) -> str:
    import json

    line = {**metrics, "reward_mean": float("nan"), "kl": float("nan"),  # a simulation learns nothing (nereus report plots NaN)
            "plan": {k: "·".join(sc.label_parts()) for k, sc in cfg.plan.stages().items()},
            "stages": {k: {**v, "peak_bytes": v["peak_bytes"][:64]} for k, v in metrics["stages"].items()}}
    return json.dumps(line) + "\n"
