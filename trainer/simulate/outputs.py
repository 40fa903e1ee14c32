"""What a simulation writes: a JSON summary, a Markdown summary and PNG plots (matplotlib Agg).

- ``summary_json(result)``: per policy the mean step latency, the run time and its parts
  (steps, transitions, restarts, waits), every transition with its predicted and real cost
  and its share of the run, decision times, waits and restarts, and the per-step seconds;
  ``over_best_static``, ``over_initial_fixed`` and ``over_oracle`` (per policy, that baseline's run
  time ÷ the policy's: 1.10 is 10% faster);
- ``summary_markdown(result)``: the same as tables, the waits said in words;
- ``plots(result, out)``: ``latency.png`` (seconds per step per policy), ``plan.png`` (the
  adaptive plan's layout per model-stage over the steps, transitions marked) and
  ``devices.png`` (devices available, and used by each policy).
"""

from __future__ import annotations

import dataclasses
import math
import os

from .run import PolicyResult, SimResult


def _finite(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def policy_json(p: PolicyResult) -> dict:
    ms = p.decision_ms
    return {
        "mean_latency_s": _finite(p.mean_latency), "run_seconds": p.run_seconds, "step_seconds": p.step_seconds,
        "transition_seconds": p.transition_seconds, "transition_share": p.transition_share, "restart_seconds": p.restart_seconds,
        "wait_seconds": p.wait_seconds, "wall_seconds": p.wall_seconds, "steps_run": len(p.ran), "waited_steps": len(p.waits), "restarts": p.restarts,
        "controller_errors": p.errors,
        "transitions": [{**dataclasses.asdict(m), "share": m.seconds / p.run_seconds if p.run_seconds else 0.0} for m in p.moves if m.kind != "restart"],
        # restarts into a new world (no live move fit): booked in restart_seconds, not transition_seconds
        "restart_moves": [{**dataclasses.asdict(m), "share": m.seconds / p.run_seconds if p.run_seconds else 0.0} for m in p.moves if m.kind == "restart"],
        "decision_ms": {"count": len(ms), "mean": sum(ms) / len(ms) if ms else None, "max": max(ms) if ms else None},
        "waits": _wait_spans(p), "per_step_s": [s["seconds"] for s in p.steps],
    }


def _wait_spans(p: PolicyResult) -> list[dict]:
    """Consecutive waited steps as spans (first, last, devices, why)."""
    spans: list[dict] = []
    for w in p.waits:
        if spans and spans[-1]["last"] == w["step"] - 1 and spans[-1]["why"] == w["why"]:
            spans[-1]["last"] = w["step"]
        else:
            spans.append({"first": w["step"], "last": w["step"], "devices": w["devices"], "why": w["why"]})
    return spans


def summary_json(r: SimResult) -> dict:
    out = {
        "cluster": dataclasses.asdict(r.cluster) | {"devices": r.cluster.devices},
        "job": {k: v for k, v in dataclasses.asdict(r.job).items() if k != "truth"},
        "trace": {"name": r.trace_name, "steps": len(r.trace), "devices_min": min(t.devices for t in r.trace),
                  "devices_max": max(t.devices for t in r.trace), "response_max_first": r.trace[0].response_max,
                  "response_max_last": r.trace[-1].response_max, "response_mean_first": r.trace[0].response_mean,
                  "response_mean_last": r.trace[-1].response_mean},
        "initial_plan": r.initial_plan, "sim_seconds": r.sim_seconds, "truth": r.truth,
        "policies": {name: policy_json(p) for name, p in r.results.items()},
    }
    runs = {name: p.run_seconds for name, p in r.results.items()}
    for base in ("best_static", "initial_fixed", "oracle"):
        if base in runs:  # X_over_Y: Y's run time ÷ X's (a speedup: 1.10, X is 10% faster)
            out[f"over_{base}"] = {n: _finite(runs[base] / m) if m else None for n, m in runs.items()}
    return out


def summary_markdown(r: SimResult) -> str:
    s = summary_json(r)
    t = s["trace"]
    lines = [
        f"# Simulation: {r.job.name} on {r.cluster.devices} × {r.cluster.device} ({r.cluster.name}), trace {r.trace_name}",
        "",
        f"{t['steps']} steps; devices {t['devices_min']}–{t['devices_max']}; longest response {t['response_max_first']} → "
        f"{t['response_max_last']} tokens, mean {t['response_mean_first']:.0f} → {t['response_mean_last']:.0f}. "
        f"Simulated in {r.sim_seconds:.1f} s (" + ", ".join(f"{n} {p.wall_seconds:.1f} s" for n, p in r.results.items())
        + f", the baselines {r.truth.get('baselines_wall_seconds', 0.0):.1f} s). Initial plan: {r.initial_plan}.",
        "",
        "| policy | mean step s | over best_static | oracle over it | run s | transitions | transition s | share of run | restarts | waited steps | decisions (mean ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, p in s["policies"].items():
        vf = s.get("over_best_static", {}).get(name)
        vo = s.get("over_oracle", {}).get(name)
        vo = None if not vo else 1 / vo
        dm = p["decision_ms"]
        lines.append(
            f"| {name} | {_num(p['mean_latency_s'])} | {'' if vf is None else f'{vf:.3f}×'} | {'' if vo is None else f'{vo:.3f}×'} | "
            f"{p['run_seconds']:.0f} | {len(p['transitions'])} | {p['transition_seconds']:.2f} | {p['transition_share']:.3%} | "
            f"{len(p['restarts'])} | {p['waited_steps']} | {dm['count']} ({_num(dm['mean'])}) |")
    for name in ("adaptive", "controller_greedy"):
        moves = sorted(s["policies"][name]["transitions"] + s["policies"][name]["restart_moves"], key=lambda m: m["step"]) if name in s["policies"] else []
        if moves:
            lines += ["", f"## Transitions of {name}", "", "| step | trigger | kind | devices | predicted s | real s | share | new plan |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for m in moves:
                lines.append(f"| {m['step']} | {m['trigger']} | {m['kind']} | {m['devices']} | {_num(m['predicted_s'])} | {m['seconds']:.3g} | "
                             f"{m['share']:.4%} | {m['new']} |")
    errors = [(n, e) for n, p in s["policies"].items() for e in p["controller_errors"]]
    if errors:
        lines += ["", "## Controller errors (logged, the plan kept)", ""]
        lines += [f"- {name} at step {e['step']}: {e['error']}" for name, e in errors]
    waits = [(n, w) for n, p in s["policies"].items() for w in p["waits"]]
    if waits:
        lines += ["", "## Waits", ""]
        for name, w in waits:
            lines.append(f"- {name} waited at steps {w['first']}–{w['last']} ({w['devices']} devices): {w['why']}")
    lines += ["", "The world (hidden from the controller) and the baselines' candidates: "
              + ", ".join(f"{k}={v}" for k, v in r.truth.items()) + "."]
    return "\n".join(lines) + "\n"


def _num(x) -> str:
    return "" if x is None else f"{x:.4g}"


def plots(r: SimResult, out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, p in r.results.items():
        xs = [s["step"] for s in p.steps if s["seconds"] is not None]
        ax.plot(xs, [s["seconds"] for s in p.steps if s["seconds"] is not None], label=f"{name} (mean {p.mean_latency:.4g} s)", lw=1)
    ax.set(xlabel="step", ylabel="step latency (s)", title="latency per step")
    ax.legend()
    paths.append(_save(fig, out, "latency.png"))

    name = "adaptive" if "adaptive" in r.results else next(iter(r.results))
    p = r.results[name]
    fig, ax = plt.subplots(figsize=(9, 4))
    stages = sorted({part.split("=")[0] for s in p.steps if s["plan"] for part in s["plan"].split(" ")})
    for i, stage in enumerate(stages):
        seen: dict[str, int] = {}
        xs, ys = [], []
        for s in p.steps:
            if s["plan"]:
                layout = dict(part.split("=", 1) for part in s["plan"].split(" ")).get(stage, "")
                xs.append(s["step"])
                ys.append(i + 0.8 * seen.setdefault(layout, len(seen)) / max(1, 8))
        ax.step(xs, ys, where="post", label=stage)
    for m in p.moves:
        ax.axvline(m.step, color="grey", lw=0.5, ls=":")
    ax.set(xlabel="step", ylabel="model-stage (offset: layout)", title=f"plan timeline ({name}; dotted: transitions)")
    ax.set_yticks(range(len(stages)), stages)
    paths.append(_save(fig, out, "plan.png"))

    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot([t.step for t in r.trace], [t.devices for t in r.trace], label="available", color="black", lw=2)
    for name, p in r.results.items():
        ax.plot([s["step"] for s in p.steps], [s["devices"] if s["seconds"] is not None else 0 for s in p.steps], label=name, lw=1)
    ax.set(xlabel="step", ylabel="devices", title="devices available and used")
    ax.legend()
    paths.append(_save(fig, out, "devices.png"))
    return paths


def _save(fig, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
