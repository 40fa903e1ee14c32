"""Benchmark: the controller — decision time at scale, calibration on unseen plans, and
``configs/tiny_wall.yaml`` adaptive against the fixed plans that fit and the per-step oracle.

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
   move: it also recomputes what is the same for every plan of the job, each layout's
   shards say), and the first decision in each plan of a chain of up to 5 admitted moves,
   the memos as the earlier decisions left them (``decision_ms_after_move``: what a live
   job's first decision after a move costs). Bars: ≤ 50 ms at 1,024, warm and cold (the
   paper: 338 ms).
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
3. **Adaptive vs fixed** (``tiny_wall``): configs/tiny_wall.yaml, GRPO whose answers grow
   4 → 160 tokens into a memory wall. The fixed plans are actor.train's retunes in the
   controller's own search space (``fixed_plans``: whole, or micro-batches of 4/2/1 rows,
   each without, with selective and with full recompute: 12). They run interleaved inside
   one job with the controller off (``oracle_job``: a pass over the 12 every 12 steps,
   each pass starting 2 plans further on, 6 passes over the curriculum stretched to 72
   steps, then one pass at the longest answers; ``NEREUS_FORCE_PLAN``), so every plan meets
   the same load. Per plan, the
   seconds of the pieces its plan changes (actor.train and its own forward) are fitted
   on 1, L, L² (``robust_fit``: refitted without the steps 3 robust σ off), the other
   pieces once over all steps, its peak interpolated in L; at each of the 40 steps of the
   real run the oracle takes the fastest plan whose peak fits the budget (moves free) and
   the best fixed plan is the fastest over the run of those that fit every step
   (``oracle_over_fixed``). ``cpu_oracle_over_best_fixed``: mean over ``ORACLE_REPEATS``
   jobs (bar ≥ 1.15), ``cpu_oracle_spread`` their max − min. Then the best fixed plan and
   the controller run the real 40-step job one after the other, ``PAIRED_REPEATS``
   times: ``adaptive_over_best_fixed`` = the fixed run's seconds ÷ the adaptive run's,
   transitions included, mean over the pairs (bar ≥ 1.10, issue 29; ``adaptive_fits``:
   every measured peak within the budget); ``transition_share`` = seconds in transitions
   ÷ the adaptive runs' seconds (bar ≤ 2%). The fixed plans keep every other stage and
   actor.train's layout, so a controller that moves to another layout (fewer ranks for
   every stage, say) can beat them without adapting: each pair then runs a third job, the
   plan the controller ended in fixed from the first step with the controller off
   (``hindsight``); ``adaptive_over_hindsight_static`` = its seconds ÷ the adaptive
   run's, what the moves themselves bought.

The last printed line is one JSON object: ``decision_ms_1024``, ``decision_ms_1024_cold``, ``calibration_error``,
``calibration_error_loaded`` (with ``_spread``, ``_raw``, ``calibration_floor``),
``cpu_oracle_over_best_fixed`` (with ``cpu_oracle_spread``), ``adaptive_over_best_fixed``,
``adaptive_over_hindsight_static``, ``transition_share`` and the figures behind them. The
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
DECISION_BAR_MS, CALIBRATION_BAR, CALIBRATION_LOADED_BAR, ORACLE_BAR, ADAPTIVE_BAR, SHARE_BAR = 50.0, 0.15, 0.20, 1.15, 1.10, 0.02
LLAMA = ROOT / "configs" / "llama3_8b_ppo.yaml"
TINY_PPO = ROOT / "configs" / "tiny_ppo.yaml"
TINY_WALL = ROOT / "configs" / "tiny_wall.yaml"
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
    from nereus.trainer.config import PlanConfig, build_tree
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
    moved = []  # the first decision in each plan a chain of admitted moves runs through, the memos as the job left them
    running = cfg
    for _ in range(repeats):
        ctl = Controller(running, profile)
        ctl.lengths = [(200, 150.0), (400, 300.0)]
        ctl.watch.reset({"response_max": 200.0, "response_mean": 150.0})
        ctl.step = 10
        t0 = time.perf_counter()
        decision = ctl.decide(running)
        moved.append((time.perf_counter() - t0) * 1e3)
        if decision is None or not decision.admitted:
            break
        running = dataclasses.replace(running, plan=build_tree(PlanConfig, decision.new_plan, "plan."))
    return {"devices": n, "model_stages": len(cfg.plan.stages()), "decision_ms": statistics.median(times),
            "decision_ms_min": min(times), "decision_ms_cold": statistics.median(cold), "admitted": last.admitted,
            "decision_ms_after_move": statistics.median(moved[1:]) if len(moved) > 1 else None, "moves_chained": len(moved) - 1,
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
        with environment(env):
            lines = run_job(cfg)
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

ORACLE_CYCLES, ORACLE_REPEATS, PAIRED_REPEATS = 6, 3, 2


def fixed_plans(cfg) -> list:
    """actor.train's plans in the controller's search space (``search.stage_options``; the
    job keeps it to data parallelism) that keep its starting layout: every micro-batch size
    and recompute, retuned in place (no state moves, so they interleave inside one job).
    Their FSDP twins are left out: on this CPU each is slower than its plain twin and no
    leaner (tiny_wall at 160 tokens: FSDP with 2-row micro-batches and full recompute 132 MiB
    and twice the seconds of the plain one's 116–122 MiB), so neither the oracle nor the best
    fixed plan would take one, and the cycle would take twice as long."""
    from nereus.trainer.controller.search import stage_options
    from nereus.trainer.controller.workload import Workload

    start = cfg.plan.actor.train
    layout = (start.dp, start.tp, start.pp, start.dp_shard)
    return [sc for sc in stage_options(cfg, ACTOR_TRAIN, tuple(range(cfg.nproc)), Workload.from_config(cfg))
            if (sc.dp, sc.tp, sc.pp, sc.dp_shard) == layout]


def retune(sc) -> dict:
    """A fixed plan as ``NEREUS_FORCE_PLAN`` overrides of actor.train."""
    return {"actor": {"train": {"micro_batch_size": sc.micro_batch_size, "micro_batch_tokens": sc.micro_batch_tokens,
                                "recompute": sc.recompute}}}


PLAN_PIECES = (ACTOR_TRAIN, ACTOR_TRAIN_INFER)  # the pieces of a step actor.train's plan changes; the rest are common


def cycle_order(plans: int, cycles: int) -> list[int]:
    """Which plan each step of the oracle job runs (pure): ``cycles`` passes over the plans,
    each pass starting ``plans // cycles`` further on, so that every plan runs at as many
    places of a pass (and lengths of the curriculum) as there are passes."""
    shift = max(1, plans // max(cycles, 1))
    return [(i + c * shift) % plans for c in range(cycles) for i in range(plans)]


def oracle_order(plans: int) -> list[int]:
    """The oracle job's plan per step (pure): ``ORACLE_CYCLES`` passes over the growing
    answers (``cycle_order``), then one more at the longest, where the memory wall is: every
    plan's peak there is measured, not extrapolated."""
    return cycle_order(plans, ORACLE_CYCLES) + list(range(plans))


def step_peak(line: dict) -> int:
    """The step's largest measured peak, over every piece and rank."""
    return max(max(r["peak_bytes"]) for r in line["stages"].values())


def robust_fit(xs: list[float], ys: list[float], degree: int = 2):
    """Least squares of ``ys`` on the powers of ``xs`` up to ``degree`` (lower when few points),
    refitted without the points more than 3 robust σ (1.4826 · MAD of the residuals) off — a
    step another job's burst slowed (pure). Returns the polynomial's coefficients."""
    import numpy as np

    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    degree = min(degree, len(x) - 2) if len(x) > 2 else 0
    coef = np.polyfit(x, y, degree)
    resid = y - np.polyval(coef, x)
    sigma = 1.4826 * float(np.median(np.abs(resid - np.median(resid))))
    keep = np.abs(resid) <= 3 * sigma if sigma > 0 else np.ones(len(x), dtype=bool)
    return np.polyfit(x[keep], y[keep], degree) if degree + 1 < keep.sum() < len(x) else coef


def peak_at(points: list[tuple[float, float]], length: float) -> float:
    """A plan's peak at ``length`` from its measured (length, peak) points (pure): linear
    between the nearest points, extended by the end slope."""
    import numpy as np

    ls, peaks = (np.array(x, dtype=float) for x in zip(*sorted(points)))
    if len(ls) == 1:
        return float(peaks[0])
    i = int(np.clip(np.searchsorted(ls, length), 1, len(ls) - 1))
    slope = (peaks[i] - peaks[i - 1]) / (ls[i] - ls[i - 1]) if ls[i] > ls[i - 1] else 0.0
    return float(peaks[i - 1] + slope * (length - ls[i - 1]))


def oracle_over_fixed(points: dict[str, list[tuple[float, float, float]]], common: list[tuple[float, float]],
                      lengths: list[float], budget: float) -> dict:
    """The per-step oracle and the best fixed plan over a run whose longest answers are
    ``lengths`` (pure). ``points``: per plan, its measured (length, seconds of the pieces its
    plan changes, step peak); ``common``: every step's (length, seconds of the other
    pieces). A plan's step at a length is ``robust_fit`` of its own pieces plus that of the
    common ones, its peak ``peak_at``. The oracle takes the fastest plan that fits each step
    (moves free); the best fixed plan is the fastest over the run of those that fit every step."""
    import numpy as np

    shared = robust_fit(*zip(*common))
    at = {}
    for name, p in points.items():
        own = robust_fit([x[0] for x in p], [x[1] for x in p])
        at[name] = [(float(np.polyval(own, L) + np.polyval(shared, L)), peak_at([(x[0], x[2]) for x in p], L)) for L in lengths]
    steps = []
    for s, length in enumerate(lengths):
        fits = {name: v[s][0] for name, v in at.items() if v[s][1] <= budget}
        best = min(fits, key=fits.get) if fits else None
        steps.append({"length": length, "plan": best, "seconds": fits[best] if best else float("nan"), "fitting": len(fits)})
    whole = {name: sum(x[0] for x in v) for name, v in at.items() if all(x[1] <= budget for x in v)}
    fixed = min(whole, key=whole.get) if whole else None
    for s, step in enumerate(steps):  # what the best fixed plan pays at each step
        step["fixed_seconds"] = at[fixed][s][0] if fixed else float("nan")
    oracle = sum(x["seconds"] for x in steps)
    return {"steps": steps, "best_fixed": fixed, "best_fixed_s": whole.get(fixed), "oracle_s": oracle,
            "fixed_s": whole, "oracle_over_best_fixed": whole[fixed] / oracle if fixed else None}


def oracle_points(lines: list[dict], order: list[int], names: list[str]) -> tuple[dict, list]:
    """The oracle job's steps as ``oracle_over_fixed``'s points (per plan) and common pieces."""
    points: dict[str, list] = {name: [] for name in names}
    common = []
    for line, i in zip(lines, order):
        length = float(line["lengths"]["response_max"])
        own = sum(line["stages"][k]["seconds"] for k in PLAN_PIECES if k in line["stages"])
        points[names[i]].append((length, own, float(step_peak(line))))
        common.append((length, line["step_seconds"] - own))
    return points, common


def grow_lengths(cfg) -> list[float]:
    """The longest answer (tokens, <eos> included) of each step of ``cfg``'s curriculum."""
    from nereus.trainer.data.tasks import build_task

    return [float(build_task(cfg.task, s).response_len + 1) for s in range(cfg.steps)]


def oracle_job(tmp: str, tag: str, plans: list, keep: Path | None = None) -> list[dict]:
    """tiny_wall with the controller off, its actor.train cycling through ``plans`` every
    step (``oracle_order``; free retunes): ``ORACLE_CYCLES`` passes over the curriculum's
    lengths stretched to them, one more at the longest."""
    from nereus.trainer.elastic.phases import FORCE_PLAN_ENV, format_forced
    from nereus.trainer.prepare import load_config

    kept = keep / f"{tag}.jsonl" if keep is not None else None
    order = oracle_order(len(plans))
    if kept is not None and kept.exists():
        lines = [json.loads(x) for x in kept.read_text().splitlines()]
        if len(lines) == len(order):  # a kept job of another schedule is run again, not misread
            return lines
    moves = {s: retune(plans[order[s]]) for s in range(1, len(order)) if order[s] != order[s - 1]}
    first = plans[order[0]]
    sets = [f"run_dir={tmp}/{tag}", "controller.enabled=false", "device_memory_gib=null", f"steps={len(order)}",
            f"task.grow_steps={len(order) - len(plans) - 1}", f"plan.actor.train.recompute={first.recompute}",
            f"plan.actor.train.micro_batch_size={first.micro_batch_size or 'null'}"]
    with environment({FORCE_PLAN_ENV: format_forced(moves)}):
        lines = run_job(load_config(TINY_WALL, sets))
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def label(sc) -> str:
    return label_dict({"dp": sc.dp, "dp_shard": sc.dp_shard, "micro_batch_size": sc.micro_batch_size,
                       "micro_batch_tokens": sc.micro_batch_tokens, "recompute": sc.recompute})


def summarize(lines: list[dict], budget: float) -> dict:
    peaks = [step_peak(line) for line in lines]
    seconds = [line["step_seconds"] for line in lines]
    return {"mean_step_s": statistics.mean(seconds), "step_seconds": seconds, "peak_bytes": peaks,
            "peak_mib": max(peaks) / 2**20, "fits": max(peaks) <= budget}


def adaptive_run(tmp: str, tag: str, sets: list[str], budget: float) -> dict:
    """One run of tiny_wall (``sets`` applied): its summary, its transitions and their seconds."""
    from nereus.trainer.prepare import load_config

    lines = run_job(load_config(TINY_WALL, [f"run_dir={tmp}/{tag}", *sets]))
    path = Path(tmp) / tag / "transitions.jsonl"
    events = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    moves = [e for e in events if e["kind"] == "transition"]
    out = {**summarize(lines, budget), "transitions": [
        {"step": e["step"], "to": label_dict(e["new_plan"]["actor"]["train"]), "measured_s": e["measured_s"],
         "predicted_s": e["predicted_s"], "rebuilt": e["rebuilt"]} for e in moves],
        "transition_s": sum(e["measured_s"] for e in moves), "final_plan": moves[-1]["new_plan"] if moves else None}
    out["run_s"] = sum(out["step_seconds"]) + out["transition_s"]
    return out


def plan_sets(plan: dict) -> list[str]:
    """A whole plan (a transition's ``new_plan``) as ``--set`` overrides (pure)."""
    def value(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else json.dumps(v)

    return [f"plan.{model}.{stage}.{k}={value(v)}" for model, stages in sorted(plan.items()) if stages
            for stage, sc in sorted(stages.items()) if sc for k, v in sorted(sc.items())]


def tiny_wall(keep: Path | None = None) -> dict:
    """Section 3 of the module docstring."""
    from nereus.trainer.prepare import load_config

    base = load_config(TINY_WALL)
    budget = base.device_memory_gib * 2**30
    plans = fixed_plans(base)
    names = [label(sc) for sc in plans]
    lengths = grow_lengths(base)
    out: dict = {"budget_mib": budget / 2**20, "plans": names, "oracle_runs": [], "paired": []}
    with tempfile.TemporaryDirectory(prefix="nereus-bench-wall-") as tmp:
        for r in range(ORACLE_REPEATS):
            lines = oracle_job(tmp, f"oracle{r}", plans, keep)
            points, common = oracle_points(lines, oracle_order(len(plans)), names)
            got = oracle_over_fixed(points, common, lengths, budget)
            out["oracle_runs"].append({**got, "points": points, "common": common})
            print(f"  ran oracle job {r}: {got['oracle_over_best_fixed']}, best fixed {got['best_fixed']}", file=sys.stderr, flush=True)
        fixed = statistics.mode(run["best_fixed"] for run in out["oracle_runs"])
        sc = plans[names.index(fixed)]
        pinned = ["controller.enabled=false", "device_memory_gib=null", f"plan.actor.train.recompute={sc.recompute}",
                  f"plan.actor.train.micro_batch_size={sc.micro_batch_size or 'null'}"]
        for r in range(PAIRED_REPEATS):  # the best fixed plan and the controller, run after run
            pair = {"fixed": adaptive_run(tmp, f"fixed{r}", pinned, budget), "adaptive": adaptive_run(tmp, f"adaptive{r}", [], budget)}
            pair["adaptive_over_best_fixed"] = pair["fixed"]["run_s"] / pair["adaptive"]["run_s"]
            final = pair["adaptive"]["final_plan"]
            if final is not None:  # the plan the controller ended in, fixed from the first step: what its moves bought
                pair["hindsight"] = adaptive_run(tmp, f"hindsight{r}", ["controller.enabled=false", "device_memory_gib=null", *plan_sets(final)], budget)
                pair["adaptive_over_hindsight"] = pair["hindsight"]["run_s"] / pair["adaptive"]["run_s"]
            out["paired"].append(pair)
            print(f"  ran adaptive and {fixed}: {pair['adaptive_over_best_fixed']:.3f}", file=sys.stderr, flush=True)
    ratios = [run["oracle_over_best_fixed"] for run in out["oracle_runs"] if run["oracle_over_best_fixed"]]
    adaptive = [p["adaptive_over_best_fixed"] for p in out["paired"]]
    runs = [p["adaptive"] for p in out["paired"]]
    out.update({
        "best_fixed": fixed, "cpu_oracle_over_best_fixed": statistics.mean(ratios) if ratios else None,
        "cpu_oracle_spread": max(ratios) - min(ratios) if ratios else None, "cpu_oracle_each": ratios,
        "adaptive_over_best_fixed": statistics.mean(adaptive), "adaptive_spread": max(adaptive) - min(adaptive),
        "adaptive_fits": all(a["fits"] for a in runs), "fixed_fits": all(p["fixed"]["fits"] for p in out["paired"]),
        "transition_share": sum(a["transition_s"] for a in runs) / sum(a["run_s"] for a in runs),
    })
    hindsight = [p["adaptive_over_hindsight"] for p in out["paired"] if "adaptive_over_hindsight" in p]
    if hindsight:
        out.update(adaptive_over_hindsight_static=statistics.mean(hindsight),
                   hindsight_fits=all(p["hindsight"]["fits"] for p in out["paired"] if "hindsight" in p))
    return out


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """``values`` set in this process's environment (the spawned workers inherit it) while the block runs."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


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
    ap.add_argument("--only", choices=("decision", "calibration", "tiny_wall"), help="one section (the others: with the decision time)")
    ap.add_argument("--keep-runs", type=Path, help="keep (or reuse) the calibration and oracle jobs' metrics in this folder")
    args = ap.parse_args()
    args.skip_runs = args.skip_runs or args.only == "decision"

    decisions = [time_decisions(n) for n in DEVICES]
    print("\nDecision time (search + transition pricing + admission), PPO Llama-3.1-8B shapes, H200s\n")
    print(md(["devices", "model-stages", "decision ms (median)", "min", "cold (memos cleared)", "first after a move (moves)", "admitted"],
             [[d["devices"], d["model_stages"], f"{d['decision_ms']:.1f}", f"{d['decision_ms_min']:.1f}", f"{d['decision_ms_cold']:.1f}",
               f"{d['decision_ms_after_move']:.1f} ({d['moves_chained']})" if d["decision_ms_after_move"] is not None else "no move",
               d["admitted"]] for d in decisions]))
    at_1024 = next(d for d in decisions if d["devices"] == 1024)
    headline = {"decision_ms_1024": at_1024["decision_ms"], "decision_ms_1024_cold": at_1024["decision_ms_cold"],
                "decision_ms": {d["devices"]: round(d["decision_ms"], 2) for d in decisions},
                "decision_ms_cold": {d["devices"]: round(d["decision_ms_cold"], 2) for d in decisions},
                "decision_ms_1024_after_move": at_1024["decision_ms_after_move"]}
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
    if not args.skip_runs and args.only in (None, "tiny_wall"):
        grow = tiny_wall(keep=args.keep_runs)
        print(f"\n{TINY_WALL.name}: {len(grow['plans'])} fixed actor.train plans interleaved in one job, "
              f"{ORACLE_REPEATS} jobs; budget {grow['budget_mib']:.0f} MiB per rank\n")
        runs = grow["oracle_runs"]
        rows = [[name, *[f"{run['fixed_s'][name]:.1f}" if name in run["fixed_s"] else "over budget" for run in runs]]
                for name in grow["plans"]]
        rows.append(["per-step oracle", *[f"{run['oracle_s']:.1f}" for run in runs]])
        print(md(["actor.train plan", *[f"job {i}: run s" for i in range(len(runs))]], rows))
        print("\nThe oracle's plan along the run (job 0; steps: plan):\n")
        spans: list[list] = []
        for s, step in enumerate(runs[0]["steps"], start=1):
            if spans and spans[-1][2] == step["plan"]:
                spans[-1][1] = s
            else:
                spans.append([s, s, step["plan"]])
        def gain(a, b):  # the best fixed plan's seconds ÷ the oracle's over steps a..b
            part = runs[0]["steps"][a - 1:b]
            return sum(x["fixed_seconds"] for x in part) / sum(x["seconds"] for x in part)

        print(md(["steps", "longest answer", "plan", "plans that fit", "best fixed ÷ oracle"],
                 [[f"{a}–{b}", f"{runs[0]['steps'][a - 1]['length']:.0f}–{runs[0]['steps'][b - 1]['length']:.0f}", plan,
                   runs[0]["steps"][a - 1]["fitting"], f"{gain(a, b):.2f}"] for a, b, plan in spans]))
        print(f"\nThe best fixed plan ({grow['best_fixed']}), the controller, and the plan the controller ended in fixed from "
              "the first step (hindsight), run after run:\n")
        rows = []
        for i, pair in enumerate(grow["paired"]):
            for kind in ("fixed", "adaptive", "hindsight"):
                if kind not in pair:
                    continue
                a = pair[kind]
                rows.append([i, kind, f"{a['run_s']:.1f}", f"{a['peak_mib']:.0f}", a["fits"],
                             "; ".join(f"step {t['step']} → {t['to']} ({t['measured_s']:.3f} s)" for t in a["transitions"])])
        print(md(["pair", "run", "run s", "peak MiB", "within budget", "transitions"], rows))
        fitted = [run["fixed_s"][grow["best_fixed"]] for run in runs if grow["best_fixed"] in run["fixed_s"]]
        print(f"\n{grow['best_fixed']} over the run, from the oracle jobs' fits: {', '.join(f'{x:.1f}' for x in fitted)} s; "
              "its own runs: " + ", ".join(f"{p['fixed']['run_s']:.1f}" for p in grow["paired"]) + " s")
        result.update(tiny_wall=grow)
        headline.update({k: grow[k] for k in ("cpu_oracle_over_best_fixed", "cpu_oracle_spread", "cpu_oracle_each", "best_fixed",
                                              "adaptive_over_best_fixed", "adaptive_spread", "adaptive_fits", "transition_share",
                                              "adaptive_over_hindsight_static", "hindsight_fits") if k in grow})
        bars.update(cpu_oracle_over_best_fixed=(grow["cpu_oracle_over_best_fixed"] or 0) >= ORACLE_BAR,
                    adaptive_over_best_fixed=grow["adaptive_over_best_fixed"] >= ADAPTIVE_BAR and grow["adaptive_fits"],
                    transition_share=headline["transition_share"] <= SHARE_BAR)
    headline["bars_met"] = bars
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**result, **headline}, indent=2, default=str))
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
