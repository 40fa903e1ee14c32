"""``nereus simulate --from-run RUN_DIR``: a real run's recorded lengths, simulated on its own world,
and the simulated pieces against the measured ones (the simulator's validation on this machine).

The run's resolved config (``config.json``) is the job, its device profile and ``nproc`` the
cluster (one node, its world: the device's parameter file, e.g. ``configs/simulate/worlds/cpu.yaml``),
its ``metrics.jsonl`` the trace (``traces.from_run``). ``compare(result, lines)`` sets the
world's seconds per piece of the run's own plan (noise-free) beside what the run measured:

    error(piece) = |Σ_steps simulated − Σ_steps measured| / Σ_steps measured
    live_error   = the mean of error(piece) over the pieces both have
    step_error   = the mean over steps of |simulated step − measured step| / measured step

(the loop's bookkeeping — advantages, the finiteness check — is not planned and is reported
apart as ``unplanned_share``). The world is not fitted to this machine: the error is the
world's own.
"""

from __future__ import annotations

import os

from ..config import ConfigError
from ..prepare import load_config
from .inputs import Cluster, JobInput, SimulateError, WorldInput, load_world
from .run import SimResult, simulate
from .traces import from_run, run_records


def replay(run_dir: str, *, policies: tuple[str, ...] = ("adaptive",), out_run_dir: str | None = None,
           world: str | None = None) -> tuple[SimResult, list[dict]]:
    data, lines = run_records(run_dir)
    try:
        cfg = load_config({**data, "run_dir": data.get("run_dir", run_dir)})
    except ConfigError as e:
        raise SimulateError(f"--from-run {run_dir}: its config.json does not load: {e}") from None
    trace = from_run(run_dir)
    cluster = Cluster(name=f"the machine of {os.path.basename(os.path.normpath(run_dir))}", device=cfg.device_profile,
                      devices_per_node=cfg.nproc, nodes=1, world=world)
    job = JobInput(name=os.path.basename(os.path.normpath(run_dir)), world=WorldInput(noise=False))
    result = simulate(cluster, job, trace, trace_name=f"from-run {run_dir}", policies=policies, run_dir=out_run_dir, cfg=cfg)
    return result, lines


def compare(result: SimResult, lines: list[dict]) -> dict:
    """The fixed policy's simulated pieces against the run's measured ones (module docstring)."""
    by_step = {int(m["step"]): m for m in lines}
    cfg = result.initial_cfg
    truth = load_world(result.cluster, result.job, noise=False, prompt_mean=None)
    sims: dict[str, float] = {}
    meas: dict[str, float] = {}
    step_errors, unplanned, total = [], 0.0, 0.0
    for t in result.trace:
        m = by_step.get(t.step)
        if m is None:
            continue
        metrics, _, _ = truth.step(cfg, t, peaks=False)
        sim_step = meas_step = 0.0
        for name, rec in m["stages"].items():
            total += rec["seconds"]
            if name not in metrics["stages"]:
                unplanned += rec["seconds"]
                continue
            s = metrics["stages"][name]["seconds"]
            sims[name] = sims.get(name, 0.0) + s
            meas[name] = meas.get(name, 0.0) + rec["seconds"]
            sim_step += s
            meas_step += rec["seconds"]
        if meas_step > 0:
            step_errors.append(abs(sim_step - meas_step) / meas_step)
    pieces = {name: {"simulated_s": sims[name], "measured_s": meas[name], "error": abs(sims[name] - meas[name]) / meas[name]}
              for name in sorted(meas) if meas[name] > 0}
    if not pieces:
        raise SimulateError("the run's records share no measured piece with the simulation")
    return {"pieces": pieces, "live_error": sum(p["error"] for p in pieces.values()) / len(pieces),
            "step_error": sum(step_errors) / len(step_errors) if step_errors else None,
            "unplanned_share": unplanned / total if total else 0.0, "steps": len(step_errors)}


def compare_markdown(c: dict) -> str:
    lines = ["## Simulated vs measured (the run's own plan)", "", "| piece | simulated s | measured s | error |", "| --- | --- | --- | --- |"]
    for name, p in c["pieces"].items():
        lines.append(f"| {name} | {p['simulated_s']:.4g} | {p['measured_s']:.4g} | {p['error']:.1%} |")
    step = "" if c["step_error"] is None else f"{c['step_error']:.1%}"
    lines += ["", f"Mean error per piece (live_error): {c['live_error']:.1%}; per step: {step} over {c['steps']} steps; "
              f"the loop's unplanned bookkeeping: {c['unplanned_share']:.1%} of the measured time."]
    return "\n".join(lines) + "\n"
