"""The simulation loop: every policy through the same trace, on the same hidden truth.

Per trace step, for each policy (``policies.py``): a change of the devices first
(``resize``: the world trigger, or DP scaled, or the oracle's new world); a world no plan
runs on makes the policy wait — the step does not run, and the time passes at the
policy's last step's pace. Then the step runs on the policy's plan: the truth
(``truth.py``) gives its pieces' seconds and every rank's peak, as the step loop's metrics;
a peak over the device's memory, or a failure in the trace, costs a restart
(``truth.restart_seconds``) and the step again. Then the policy reacts (``after``: the
controller observes and decides), and an admitted move costs the truth's transition.

    run time = Σ step seconds + Σ transitions + Σ restarts (+ the redone steps) + Σ waits
    mean step latency = the mean of the steps' seconds that ran
    transition share = Σ transitions / run time

The initial plan: the job's, or (``plan: auto``) the controller's search for the longest
step the job allows (what a static run must survive) on the first world of the trace that
has one. Every policy starts from it; the oracle replaces it at once.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass, field

from ..config import ConfigError, JobConfig
from .inputs import Cluster, JobInput, SimulateError, write_profile
from .policies import POLICIES, Move, Policy, label, worlds
from .traces import TraceStep
from .truth import Truth


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
    truth: dict


def initial_config(cluster: Cluster, job: JobInput, trace: list[TraceStep], profile_path: str) -> JobConfig:
    """The config every policy starts from (module docstring)."""
    profile = cluster.profile()
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
                return job.job_config(n, steps=len(trace), profile_path=profile_path, memory_gib=profile.memory_gib)
            except ConfigError as e:
                errors.append((n, str(e)))
                if "does not exist" in str(e) or "unknown key" in str(e) or job.plan != "auto":
                    raise SimulateError(f"job {job.name!r} on {n} devices of {cluster.device}: {e}") from None
    n, why = max(errors, key=lambda e: e[0]) if errors else (0, "the trace has no devices")
    raise SimulateError(f"job {job.name!r} ({job.model}) cannot be placed on {cluster.device} devices "
                        f"({profile.memory_gib:g} GiB each) at any world of the trace, the largest tried {n}: {why}")


def simulate(cluster: Cluster, job: JobInput, trace: list[TraceStep], *, trace_name: str = "trace",
             policies: tuple[str, ...] = ("fixed", "adaptive", "greedy", "oracle"), run_dir: str | None = None,
             work_dir: str | None = None, cfg: JobConfig | None = None) -> SimResult:
    """Run every policy through ``trace`` (module docstring). ``run_dir``: the adaptive
    controller writes its logs there (predictions.jsonl, transitions.jsonl) and the loop the
    step metrics, as a live run (``nereus report`` reads it). ``cfg``: this job config as
    it is (a real run's, ``replay.py``) instead of the job input's."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SimulateError(f"unknown policy {unknown[0]!r}; known: {', '.join(POLICIES)}")
    start = time.perf_counter()
    check_trace(trace, job, strict=cfg is None)  # a real run's (replay): its own steps and cap
    profile = cluster.profile()
    trace = [dataclasses.replace(t, devices=min(t.devices, cluster.devices)) for t in trace]
    with tempfile.TemporaryDirectory(prefix="nereus-sim-") as tmp:
        profile_path = write_profile(profile, os.path.join(work_dir or tmp, "device_profile.yaml"))
        given = cfg is not None  # a real run's config: its records give the prompts' lengths
        if cfg is None:
            cfg = initial_config(cluster, job, trace, profile_path)
        truth = Truth(job.truth, profile, prompt_mean=None if given else job.prompt.mean)
        active: dict[str, Policy] = {}
        for name in policies:
            kwargs = {"run_dir": os.path.join(run_dir, name)} if run_dir and name == "adaptive" else {}
            active[name] = POLICIES[name](cfg, truth, **kwargs)
        results = {name: PolicyResult(name=name) for name in policies}
        metrics_logs = _open_logs(run_dir, cfg) if run_dir and "adaptive" in policies else None
        seen = {name: cfg.nproc for name in policies}
        truth_seconds = 0.0
        try:
            for t in trace:
                running = []
                for name, policy in active.items():
                    t0 = time.perf_counter()
                    if _prepare(policy, results[name], t, seen):
                        running.append(name)
                    results[name].wall_seconds += time.perf_counter() - t0
                t0 = time.perf_counter()
                steps = truth.step_many([active[n].cfg for n in running], t, peaks=[active[n].reads_memory for n in running])
                truth_seconds += time.perf_counter() - t0
                for name, (metrics, seconds, oom) in zip(running, steps):
                    ran_on, t0 = active[name].cfg, time.perf_counter()
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
    truth_info = {"wall_seconds": truth_seconds, "efficiency": dict(truth.model.coef), "noise": job.truth.noise, "memory_slack": job.truth.memory_slack,
                  "memory_offset_gib": job.truth.memory_offset_gib, "transition_factor": job.truth.transition_factor}
    return SimResult(cluster=cluster, job=job, trace_name=trace_name, trace=trace, initial_plan=label(cfg.plan), initial_cfg=cfg, results=results,
                     sim_seconds=time.perf_counter() - start, truth=truth_info)


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
        out.restart_seconds += job.truth.restart_seconds + seconds
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
