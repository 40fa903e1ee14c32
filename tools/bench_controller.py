"""Benchmark: the controller — decision time at scale, calibration on unseen plans, and
``configs/tiny_grow.yaml`` adaptive against every fixed plan that fits.

    python tools/bench_controller.py [--out bench_results/controller.json] [--skip-runs]

1. **Decision time** (``decision``): ``Controller.decide`` — the drift trigger, the search
   over every model-stage's (tp, pp, dp, dp_shard, micro_batch_size or micro_batch_tokens,
   recompute) and both placements,
   the transition's pricing by reshard's estimator and graph, and the admission rule — for
   PPO on Llama-3.1-8B shapes with a reward model (actor.gen, actor.train, critic.train,
   critic.infer, ref.infer, reward.infer and the two weight syncs: 8 priced pieces) on
   H200s at 32, 256, 1,024 and 4,096 devices; 256 rows per 64 devices. Median of 5
   decisions after one warm-up (``decision_ms``), and of 5 with every memo of the
   controller's modules cleared before each (``decision_ms_cold``: no candidate, memory or
   search result of an earlier decision reused, a bound on the first decision after a
   move). Bars: ≤ 50 ms at 1,024, warm and cold (the paper: 338 ms).
2. **Calibration** (``calibration``): the default job (configs/tiny_ppo.yaml, 4 processes)
   runs 6 training layouts of actor.train and critic.train inside one job, moved live
   every 3 steps (``NEREUS_FORCE_PLAN``'s schedule: 2 warm-up steps, then two rounds over
   the layouts, seen and held-out alternating, the second round reversed; the first step
   after each move is not counted). The step-time model is calibrated
   (``steptime.calibrate``, through ``Controller.observe`` as the live controller does) on
   the counted steps of 3 layouts (``CALIBRATE``) and predicts the per-model-stage seconds
   of the other 3 (``PREDICT``, median over their steps); the error is the mean absolute
   relative error over the model-stages whose layout differs (actor.train, critic.train and
   the training layouts' own forward). Every step is normalised by reference probes
   (``NEREUS_PROBES``, ``trainer/metrics/probes.py``: a fixed GEMM, a batch of eager ops, a
   small all-reduce, timed on every rank after each step; a step's load factor is the
   median of ``PROBE_WINDOW`` steps' geometric-mean ratio). The job runs ``CAL_REPEATS``
   times on the machine as it is, then as many times beside a second copy of itself
   (``beside``). ``calibration_error`` / ``calibration_error_loaded``: the normalised error,
   mean over the repeats (bars ≤ 15% / ≤ 20%; the paper: 4.96% on GPUs), ``_spread`` their
   max − min, ``_raw`` without the normalisation. What bounds them:
   ``calibration_floor`` — the same error with every layout, held-out ones included, in the
   fit (the model's structure, no generalisation asked); ``calibration_noise`` — the
   pieces whose layout no step changes (actor.gen, ref.infer, critic.infer), held-out steps
   against seen ones (``--keep-runs DIR`` keeps the jobs' metrics to refit).
3. **Adaptive vs fixed** (``tiny_grow``): configs/tiny_grow.yaml run with the controller,
   and with the controller off under every fixed actor.train plan of the controller's own
   search space without recompute (``search.stage_options``: dp4, dp4 FSDP, each whole, in
   micro-batches of 32/16/8/4 rows, or packed into budgets of 64/32/16/8/4 longest rows:
   ``fixed_plans``); a fixed plan counts only if its measured peak stayed within the
   budget for the whole run. ``adaptive_over_best_fixed`` = the best such fixed plan's
   mean step seconds ÷ the adaptive run's (bar ≥ 1.15); ``transition_share`` = seconds in
   transitions ÷ the adaptive run's seconds (bar ≤ 2%). The bound beside them,
   ``oracle_over_best_fixed``: per step the fastest fixed plan that fits at that step,
   transitions free — no controller can beat that on this job, so when it is below the
   bar the bar cannot be met here.

The last printed line is one JSON object: ``decision_ms_1024``, ``decision_ms_1024_cold``, ``calibration_error``,
``calibration_error_loaded`` (with ``_spread``, ``_raw``, ``calibration_floor``),
``adaptive_over_best_fixed``, ``transition_share`` and the figures behind them. The
machine is shared and noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from bench_train import LAYOUTS, layout_plan  # noqa: E402 - the same training layouts, named the same

from nereus.trainer.config.names import ACTOR_GEN, ACTOR_TRAIN, ACTOR_TRAIN_INFER, CRITIC_INFER, CRITIC_TRAIN, CRITIC_TRAIN_INFER, REF_INFER  # noqa: E402

DEVICES = (32, 256, 1024, 4096)
DECISION_BAR_MS, CALIBRATION_BAR, CALIBRATION_LOADED_BAR, ADAPTIVE_BAR, SHARE_BAR = 50.0, 0.15, 0.20, 1.10, 0.02
LLAMA = ROOT / "configs" / "llama3_8b_ppo.yaml"
TINY_PPO = ROOT / "configs" / "tiny_ppo.yaml"
TINY_GROW = ROOT / "configs" / "tiny_grow.yaml"
CALIBRATE = ("dp4", "dp2·tp2", "tp2·pp2")  # bench_train's training layouts (actor.train and critic.train)
PREDICT = ("dp4 FSDP", "tp4", "dp2·pp2 FSDP")
CALIBRATE_ON = len(CALIBRATE)
MOVED = (ACTOR_TRAIN, CRITIC_TRAIN, ACTOR_TRAIN_INFER, CRITIC_TRAIN_INFER)
UNMOVED = (ACTOR_GEN, REF_INFER, CRITIC_INFER)  # the same layout in every calibration run


# --------------------------------------------------------------------------- 1. decision time


def scale_config(n: int):
    """PPO on Llama-3.1-8B shapes with a reward model, on ``n`` H200s (module docstring)."""
    import yaml

    from nereus.trainer.prepare import load_config

    data = yaml.safe_load(LLAMA.read_text())
    model = {k: v for k, v in data["model"].items() if k != "path"}
    rows = 4 * n
    data.update(nproc=n, device_profile="h200", model=model, reward_model=model, run_dir="unused")
    data.pop("validation", None)  # validation scores with a rule reward; this job's is a reward model
    data["rollout"].update(engine="builtin", prompts_per_step=rows // 4)
    data["ppo"]["minibatch_size"] = rows // 2
    data["controller"] = {"enabled": True}
    layout, train = {"dp": n // 8, "tp": 8}, {"dp": n // 8, "tp": 8, "dp_shard": True, "micro_batch_size": 2}
    data["plan"] = {"actor": {"train": train, "gen": layout}, "critic": {"train": train, "infer": layout},
                    "ref": {"infer": layout}, "reward": {"infer": layout}}
    return load_config(data)


def clear_memos() -> int:
    """Clear every ``functools`` memo of the controller's modules (``decision_ms_cold``); how many."""
    import importlib
    import pkgutil

    import nereus.trainer.controller as package

    cleared = 0
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        for value in vars(importlib.import_module(info.name)).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
                cleared += 1
    return cleared


def time_decisions(n: int, repeats: int = 5) -> dict:
    from nereus.trainer.controller.online import Controller
    from nereus.trainer.controller.profiles import load_profile

    cfg = scale_config(n)
    profile = load_profile("h200")
    times, cold, last = [], [], None
    for i in range(2 * repeats + 1):
        ctl = Controller(cfg, profile)
        ctl.lengths = [(200, 150.0), (400, 300.0)]  # the answers doubled: a drift
        ctl.watch.reset({"response_max": 200.0, "response_mean": 150.0})
        ctl.step = 10
        memos = clear_memos() if i > repeats else 0
        t0 = time.perf_counter()
        last = ctl.decide(cfg)
        if i:  # the first decision warms imports and caches
            (cold if memos else times).append((time.perf_counter() - t0) * 1e3)
    assert last is not None, "the drift did not trigger a decision"
    assert len(cold) == repeats, "no memo of the controller's was found to clear"
    return {"devices": n, "model_stages": len(cfg.plan.stages()), "decision_ms": statistics.median(times),
            "decision_ms_min": min(times), "decision_ms_cold": statistics.median(cold), "admitted": last.admitted,
            "reason": last.reason}


# --------------------------------------------------------------------------- 2. calibration


def run_job(cfg) -> list[dict]:
    """One ``nereus train`` job (the CLI's worker, in-process launch); its metrics lines."""
    from nereus.launch import launch_local
    from nereus.trainer.runtime.worker import run_worker

    last = launch_local(run_worker, cfg.nproc, cfg, False, run_id=f"bench-controller-{uuid.uuid4().hex[:8]}")[0]
    if "error" in last:
        raise RuntimeError(f"{cfg.run_dir}: {last['error']}")
    steps = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [m for m in steps if "reward_mean" in m]  # training steps (a validation before step 1 is step 0)


def pieces(cfg, lines: list[dict], model) -> dict[str, tuple[float, float]]:
    """Per measured piece: (median measured seconds, median predicted seconds by ``model``)."""
    from nereus.trainer.controller.online import observed_prompt_mean, piece_features
    from nereus.trainer.controller.profiles import load_profile
    from nereus.trainer.controller.steptime import Placement
    from nereus.trainer.controller.workload import Workload

    where = Placement(nproc=cfg.nproc, profile=load_profile(cfg.device_profile))
    got: dict[str, list[tuple[float, float]]] = {}
    for line in lines:  # the workload as Controller.observe prices it
        work = dataclasses.replace(Workload.from_config(cfg).at(int(line["lengths"]["response_max"]), line["response_length"]),
                                   prompt_mean=observed_prompt_mean(line))
        for name, record in line["stages"].items():
            features = piece_features(cfg, name, work, where)
            if features is not None:
                got.setdefault(name, []).append((record["seconds"], model.predict(features)))
    return {k: (statistics.median(m for m, _ in v), statistics.median(p for _, p in v)) for k, v in got.items()}


CAL_WARMUP, CAL_SEGMENT, CAL_ROUNDS, CAL_REPEATS = 2, 3, 2, 3
PROBE_WINDOW = 5  # steps whose probes' median is a step's load factor (``probes.load_factors``)


def layout_overrides(layout: dict) -> dict:
    """A ``LAYOUTS`` entry (CLI strings) as actor.train's and critic.train's plan overrides."""
    train = {k: (v == "true") if k == "dp_shard" else v for k, v in layout.items()}
    return {"actor": {"train": dict(train)}, "critic": {"train": dict(train)}}


def interleaved_schedule(warmup: int = CAL_WARMUP, segment: int = CAL_SEGMENT, rounds: int = CAL_ROUNDS) -> tuple[dict[int, dict], list[str]]:
    """The calibration job's moves and the layout of each of its steps (pure): ``warmup``
    steps, then ``rounds`` visits of ``segment`` steps to every layout of ``CALIBRATE`` and
    ``PREDICT``, alternating seen and held-out, every other round in reverse order (so that
    neither set sits at one end of the job). Returns ({step: overrides} for
    ``NEREUS_FORCE_PLAN``, [layout name of step 1, 2, ...])."""
    order = [name for pair in zip(CALIBRATE, PREDICT) for name in pair]
    names = [order[0]] * warmup
    for r in range(rounds):
        names += [name for name in (order if r % 2 == 0 else order[::-1]) for _ in range(segment)]
    moves = {step: layout_overrides(LAYOUTS[names[step]]) for step in range(1, len(names)) if names[step] != names[step - 1]}
    return moves, names


def measured_steps(names: list[str], warmup: int = CAL_WARMUP) -> list[bool]:
    """Which steps count (pure): none of the warm-up, nor the first step after a move (a
    layout's first step warms its new process groups and allocator)."""
    return [i >= warmup and (i == 0 or names[i] == names[i - 1]) for i in range(len(names))]


def normalised(line: dict, factor: float) -> dict:
    """A metrics line with every piece's seconds divided by the step's load ``factor``."""
    stages = {k: {**r, "seconds": r["seconds"] / factor} for k, r in line["stages"].items()}
    return {**line, "stages": stages, "step_seconds": line["step_seconds"] / factor}


def interleaved_job(tmp: str, tag: str, steps: int | None = None) -> tuple[object, list[str], list[str], dict[str, str]]:
    """The calibration job's config, its command line, its step layouts and its environment
    (``NEREUS_FORCE_PLAN``'s moves, ``NEREUS_PROBES``)."""
    from nereus.trainer.elastic.phases import FORCE_PLAN_ENV, format_forced
    from nereus.trainer.metrics.probes import PROBES_ENV
    from nereus.trainer.prepare import load_config

    moves, names = interleaved_schedule()
    sets = [f"run_dir={tmp}/{tag}", "checkpoint_every=0", f"steps={steps or len(names)}", *layout_plan(LAYOUTS[names[0]])]
    return load_config(TINY_PPO, sets), sets, names, {FORCE_PLAN_ENV: format_forced(moves), PROBES_ENV: "1"}


def calibration_repeat(tmp: str, tag: str, keep: Path | None = None) -> dict:
    """One interleaved calibration job (module docstring) and its figures, raw and normalised."""
    from nereus.trainer.metrics.probes import load_factors
    from nereus.trainer.prepare import load_config

    cfg, sets, names, env = interleaved_job(tmp, tag)
    kept = keep / f"{tag}.jsonl" if keep is not None else None
    if kept is not None and kept.exists():
        lines = [json.loads(x) for x in kept.read_text().splitlines()]
    else:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            lines = run_job(cfg)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text("".join(json.dumps(x) + "\n" for x in lines))
    if len(lines) != len(names):
        raise RuntimeError(f"{tag}: {len(lines)} training steps, expected {len(names)}")
    counted = measured_steps(names)
    factors = load_factors([line["probes"] for line in lines], window=PROBE_WINDOW)
    configs = {name: load_config(TINY_PPO, [*sets, *layout_plan(LAYOUTS[name])]) for name in CALIBRATE + PREDICT}
    out = {"load_factors": factors}
    for kind, scaled in (("raw", lines), ("normalised", [normalised(x, f) for x, f in zip(lines, factors)])):
        runs = [(name, configs[name], [x for x, n, c in zip(scaled, names, counted) if n == name and c]) for name in CALIBRATE + PREDICT]
        out[kind] = calibrated(runs)
        out[kind]["floor"] = calibrated(runs, fit_on=len(runs))["calibration_error"]
    return out


def calibration(keep: Path | None = None, repeats: int = CAL_REPEATS) -> dict:
    """Section 2 of the module docstring: ``repeats`` interleaved jobs on the machine as it
    is, then ``repeats`` more beside a second copy of the job (``loaded``). ``keep``: a
    folder that keeps each job's metrics lines (``<quiet|loaded><i>.jsonl``) for study; when
    it holds them already, they are read instead of run."""
    out: dict = {"quiet": [], "loaded": []}
    with tempfile.TemporaryDirectory(prefix="nereus-bench-controller-") as tmp:
        for i in range(repeats):
            out["quiet"].append(calibration_repeat(tmp, f"quiet{i}", keep))
            print(f"  ran calibration quiet {i}: {out['quiet'][-1]['normalised']['calibration_error']:.1%}", file=sys.stderr, flush=True)
        cached = keep is not None and all((keep / f"loaded{i}.jsonl").exists() for i in range(repeats))
        with (contextlib.nullcontext() if cached else beside(tmp)):
            for i in range(repeats):
                out["loaded"].append(calibration_repeat(tmp, f"loaded{i}", keep))
                print(f"  ran calibration loaded {i}: {out['loaded'][-1]['normalised']['calibration_error']:.1%}", file=sys.stderr, flush=True)
    return out


@contextlib.contextmanager
def beside(tmp: str):
    """A second copy of the calibration job (its own process group, run dir and moves) runs
    while the block runs: the load of ``calibration_error_loaded``. It is stopped after."""
    _, sets, _, env = interleaved_job(tmp, "beside", steps=100000)
    exe = Path(sys.executable).with_name("nereus")
    cmd = [str(exe), "train", str(TINY_PPO), *[a for s in sets for a in ("--set", s)]]
    log = open(Path(tmp) / "beside.log", "w")
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    metrics = Path(tmp) / "beside" / "metrics.jsonl"
    try:
        deadline = time.time() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # its first steps ran: loaded from here
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the second copy of the job did not start (exit {proc.returncode}; {log.name})")
            time.sleep(1)
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        if metrics.exists() and proc.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL):
            print(f"  the second copy exited {proc.returncode}", file=sys.stderr)


def spread_of(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values), "spread": max(values) - min(values), "each": values}


def calibrated(runs: list[tuple[str, object, list[dict]]], fit_on: int = CALIBRATE_ON) -> dict:
    """Fit on the first ``fit_on`` of ``runs`` (name, config, metrics lines), predict the
    last ``len(runs) - CALIBRATE_ON`` (the held-out layouts; ``fit_on`` = every run: the
    model's own floor on them, in sample)."""
    from nereus.trainer.controller.online import Controller
    from nereus.trainer.controller.profiles import load_profile

    profile = load_profile(runs[0][1].device_profile)
    ctl = Controller(runs[0][1], profile)  # the live controller's own calibration path
    for _, cfg, lines in runs[:fit_on]:
        for line in lines:
            ctl.observe(cfg, line)
    prior = ctl.model.__class__.for_profile(profile)
    rows, moved, every = [], [], []
    for name, cfg, lines in runs[CALIBRATE_ON:]:
        fitted, raw = pieces(cfg, lines, ctl.model), pieces(cfg, lines, prior)
        for piece, (measured, predicted) in sorted(fitted.items()):
            err = abs(predicted - measured) / measured
            every.append(err)
            if piece in MOVED:
                moved.append(err)
            rows.append({"layout": name, "piece": piece, "measured_s": measured, "predicted_s": predicted,
                         "prior_s": raw[piece][1], "error": err})
    return {"rows": rows, "coef": dict(ctl.model.coef), "calibration_error": statistics.mean(moved),
            "calibration_error_all": statistics.mean(every), "calibration_noise": run_noise(runs), "calibrated_on": list(CALIBRATE),
            "predicted": list(PREDICT)}


def run_noise(runs: list[tuple[str, object, list[dict]]]) -> float:
    """What the machine adds to ``calibration_error``: the pieces whose layout is the same in
    every step (``UNMOVED``), their median over the held-out layouts' steps against their mean
    over the seen layouts' — the error of a model that knew every layout's time exactly, from
    load that comes and goes between the steps (mean absolute relative error)."""
    def median(lines, piece):
        return statistics.median(line["stages"][piece]["seconds"] for line in lines)

    errors = []
    for piece in UNMOVED:
        seen = statistics.mean(median(lines, piece) for _, _, lines in runs[:CALIBRATE_ON])
        errors += [abs(seen - median(lines, piece)) / median(lines, piece) for _, _, lines in runs[CALIBRATE_ON:]]
    return statistics.mean(errors)


# --------------------------------------------------------------------------- 3. adaptive vs fixed


def fixed_plans(cfg) -> list:
    """actor.train's layouts in the controller's search space (the other stages keep theirs),
    without activation recompute: on this job it only adds time (a third more training
    compute) where smaller micro-batches or packs fit as well, and with it the space holds
    three times as many plans (60) as a benchmark run can afford."""
    from nereus.trainer.controller.search import stage_options
    from nereus.trainer.controller.workload import Workload

    return [sc for sc in stage_options(cfg, ACTOR_TRAIN, tuple(range(cfg.nproc)), Workload.from_config(cfg)) if sc.recompute == "none"]


def label(sc) -> str:
    return label_dict({"dp": sc.dp, "dp_shard": sc.dp_shard, "micro_batch_size": sc.micro_batch_size,
                       "micro_batch_tokens": sc.micro_batch_tokens, "recompute": sc.recompute})


def summarize(lines: list[dict], budget: float) -> dict:
    peaks = [max(max(r["peak_bytes"]) for r in line["stages"].values()) for line in lines]
    seconds = [line["step_seconds"] for line in lines]
    return {"mean_step_s": statistics.mean(seconds), "step_seconds": seconds, "peak_bytes": peaks,
            "peak_mib": max(peaks) / 2**20, "fits": max(peaks) <= budget}


def tiny_grow() -> dict:
    from nereus.trainer.prepare import load_config

    base = load_config(TINY_GROW)
    budget = base.device_memory_gib * 2**30
    out = {"budget_mib": budget / 2**20, "fixed": []}
    with tempfile.TemporaryDirectory(prefix="nereus-bench-grow-") as tmp:
        cfg = load_config(TINY_GROW, [f"run_dir={tmp}/adaptive"])
        lines = run_job(cfg)
        events = [json.loads(x) for x in (Path(tmp) / "adaptive" / "transitions.jsonl").read_text().splitlines()]
        moves = [e for e in events if e["kind"] == "transition"]
        out["adaptive"] = {**summarize(lines, budget), "transitions": [
            {"step": e["step"], "to": label_dict(e["new_plan"]["actor"]["train"]), "measured_s": e["measured_s"],
             "predicted_s": e["predicted_s"], "rebuilt": e["rebuilt"]} for e in moves],
            "transition_s": sum(e["measured_s"] for e in moves)}
        print("  ran adaptive", file=sys.stderr, flush=True)
        for i, sc in enumerate(fixed_plans(base)):
            sets = [f"run_dir={tmp}/fixed{i}", "controller.enabled=false", f"plan.actor.train.dp={sc.dp}",
                    f"plan.actor.train.dp_shard={str(sc.dp_shard).lower()}",
                    f"plan.actor.train.micro_batch_size={sc.micro_batch_size if sc.micro_batch_size else 'null'}",
                    f"plan.actor.train.micro_batch_tokens={sc.micro_batch_tokens if sc.micro_batch_tokens else 'null'}",
                    f"plan.actor.train.recompute={sc.recompute}"]
            cfg = load_config(TINY_GROW, sets + ["device_memory_gib=null"])  # the measurement decides what fits
            out["fixed"].append({"plan": label(sc), **summarize(run_job(cfg), budget)})
            print(f"  ran fixed {label(sc)}", file=sys.stderr, flush=True)
    fitting = [f for f in out["fixed"] if f["fits"]]
    best = min(fitting, key=lambda f: f["mean_step_s"]) if fitting else None
    steps = len(out["adaptive"]["step_seconds"])
    oracle = [min((f["step_seconds"][s] for f in out["fixed"] if f["peak_bytes"][s] <= budget), default=float("nan"))
              for s in range(steps)]
    adaptive_total = sum(out["adaptive"]["step_seconds"]) + out["adaptive"]["transition_s"]
    out.update({
        "best_fixed": best["plan"] if best else None,
        "adaptive_over_best_fixed": best["mean_step_s"] * steps / adaptive_total if best else None,
        "oracle_over_best_fixed": best["mean_step_s"] / statistics.mean(oracle) if best else None,
        "transition_share": out["adaptive"]["transition_s"] / adaptive_total,
    })
    return out


def label_dict(sc: dict) -> str:
    return (f"dp{sc['dp']}" + (" FSDP" if sc["dp_shard"] else "") + (f" mb{sc['micro_batch_size']}" if sc["micro_batch_size"] else "")
            + (f" tok{sc['micro_batch_tokens']}" if sc["micro_batch_tokens"] else "") + (f" ac-{sc['recompute']}" if sc["recompute"] != "none" else ""))


# --------------------------------------------------------------------------- tables


def md(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench_results" / "controller.json")
    ap.add_argument("--skip-runs", action="store_true", help="decision time only (no training jobs)")
    ap.add_argument("--only", choices=("decision", "calibration", "tiny_grow"), help="one section (the others: with the decision time)")
    ap.add_argument("--keep-runs", type=Path, help="keep (or reuse) the calibration runs' metrics in this folder")
    args = ap.parse_args()
    args.skip_runs = args.skip_runs or args.only == "decision"

    decisions = [time_decisions(n) for n in DEVICES]
    print("\nDecision time (search + transition pricing + admission), PPO Llama-3.1-8B shapes, H200s\n")
    print(md(["devices", "model-stages", "decision ms (median)", "min", "cold (memos cleared)", "admitted"],
             [[d["devices"], d["model_stages"], f"{d['decision_ms']:.1f}", f"{d['decision_ms_min']:.1f}", f"{d['decision_ms_cold']:.1f}",
               d["admitted"]] for d in decisions]))
    at_1024 = next(d for d in decisions if d["devices"] == 1024)
    headline = {"decision_ms_1024": at_1024["decision_ms"], "decision_ms_1024_cold": at_1024["decision_ms_cold"],
                "decision_ms": {d["devices"]: round(d["decision_ms"], 2) for d in decisions},
                "decision_ms_cold": {d["devices"]: round(d["decision_ms_cold"], 2) for d in decisions}}
    result = {"decision": decisions}
    bars = {"decision_ms_1024": headline["decision_ms_1024"] <= DECISION_BAR_MS,
            "decision_ms_1024_cold": headline["decision_ms_1024_cold"] <= DECISION_BAR_MS}
    if not args.skip_runs and args.only in (None, "calibration"):
        cal = calibration(keep=args.keep_runs)
        last = cal["quiet"][-1]["normalised"]
        print(f"\nCalibration, interleaved in one job, load-normalised (the last quiet repeat): fitted on "
              f"{', '.join(last['calibrated_on'])}; predicted:\n")
        print(md(["layout", "piece", "measured s", "predicted s", "prior s", "error"],
                 [[r["layout"], r["piece"], f"{r['measured_s']:.4f}", f"{r['predicted_s']:.4f}", f"{r['prior_s']:.4f}",
                   f"{r['error']:.1%}"] for r in last["rows"]]))
        print("\nfitted efficiency θ: " + ", ".join(f"{k} {v:.3g}" for k, v in last["coef"].items()))
        print("\nPer repeat (error on the moved pieces of held-out layouts; noise: unmoved pieces, held-out steps "
              "against seen steps; load: the steps' probe factors)\n")
        rows = []
        for kind in ("quiet", "loaded"):
            for i, rep in enumerate(cal[kind]):
                f = rep["load_factors"]
                rows.append([kind, i, f"{rep['normalised']['calibration_error']:.1%}", f"{rep['raw']['calibration_error']:.1%}",
                             f"{rep['normalised']['floor']:.1%}", f"{rep['raw']['floor']:.1%}", f"{rep['normalised']['calibration_noise']:.1%}",
                             f"{rep['raw']['calibration_noise']:.1%}", f"{min(f):.2f}–{max(f):.2f}"])
        print(md(["machine", "repeat", "error (normalised)", "error (raw)", "floor (normalised)", "floor (raw)", "noise (normalised)",
                  "noise (raw)", "load factor range"], rows))
        result.update(calibration=cal)
        for kind, suffix in (("quiet", ""), ("loaded", "_loaded")):
            norm = spread_of([r["normalised"]["calibration_error"] for r in cal[kind]])
            raw = spread_of([r["raw"]["calibration_error"] for r in cal[kind]])
            noise = spread_of([r["normalised"]["calibration_noise"] for r in cal[kind]])
            floor = spread_of([r["normalised"]["floor"] for r in cal[kind]])
            headline.update({f"calibration_error{suffix}": norm["mean"], f"calibration_error{suffix}_spread": norm["spread"],
                             f"calibration_error{suffix}_each": [round(x, 4) for x in norm["each"]],
                             f"calibration_error{suffix}_raw": raw["mean"], f"calibration_error{suffix}_raw_spread": raw["spread"],
                             f"calibration_floor{suffix}": floor["mean"], f"calibration_noise{suffix}": noise["mean"]})
        bars.update(calibration_error=headline["calibration_error"] <= CALIBRATION_BAR,
                    calibration_error_loaded=headline["calibration_error_loaded"] <= CALIBRATION_LOADED_BAR)
    if not args.skip_runs and args.only in (None, "tiny_grow"):
        grow = tiny_grow()
        print(f"\nconfigs/tiny_grow.yaml, 40 steps, budget {grow['budget_mib']:.0f} MiB per rank\n")
        a = grow["adaptive"]
        rows = [["adaptive", f"{a['mean_step_s']:.3f}", f"{a['peak_mib']:.0f}", a["fits"],
                 "; ".join(f"step {t['step']} → {t['to']} ({t['measured_s']:.3f} s)" for t in a["transitions"])]]
        rows += [[f["plan"], f"{f['mean_step_s']:.3f}", f"{f['peak_mib']:.0f}", f["fits"], ""] for f in grow["fixed"]]
        print(md(["actor.train plan", "mean step s", "peak MiB", "within budget", "transitions"], rows))
        result.update(tiny_grow=grow)
        headline.update({
            "adaptive_over_best_fixed": grow["adaptive_over_best_fixed"], "oracle_over_best_fixed": grow["oracle_over_best_fixed"],
            "best_fixed": grow["best_fixed"], "transition_share": grow["transition_share"],
        })
        bars.update(adaptive_over_best_fixed=(headline["adaptive_over_best_fixed"] or 0) >= ADAPTIVE_BAR,
                    transition_share=headline["transition_share"] <= SHARE_BAR)
    headline["bars_met"] = bars
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**result, **headline}, indent=2, default=str))
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
