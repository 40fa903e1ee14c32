"""``nereus report RUN_DIR``: plots and a Markdown summary of a finished or running job.

Reads what the job writes (``metrics.jsonl``; with the controller also ``predictions.jsonl``
and ``transitions.jsonl``) and writes, under ``RUN_DIR/report/``:

- ``reward.png``      reward (and task reward) and KL per step;
- ``stages.png``      seconds per step of every measured model-stage;
- ``plan.png``        the plan timeline: each model-stage's layout per step, transitions marked;
- ``predicted.png``   predicted vs measured step seconds, and each transition's predicted vs
                      measured seconds;
- ``memory.png``      every rank's measured peak per step against the budget (and the model's
                      prediction where the controller logged one);
- ``report.md``       a summary table and the plots.

Records that are not whole (a line a running job is still writing, a damaged one) are left
out, and ``report.md`` names them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable


def read_jsonl(path: str, required: tuple[str, ...] = ("step",), skipped: list | None = None, *, alternative=None) -> list[dict]:
    """The records of a JSONL file that are JSON objects holding every ``required`` key, or
    else accepted by ``alternative(record)`` ([] when absent). Others — a line torn by a
    running writer, a damaged one — are left out and, with ``skipped``, appended there as
    ``path:line``."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and (all(k in record for k in required) or (alternative is not None and alternative(record))):
                out.append(record)
            elif skipped is not None:
                skipped.append(f"{os.path.basename(path)}:{number}")
    return out


def make_report(run_dir: str, *, budget_gib: float | None = None) -> str:
    """Write the plots and ``report.md`` (module docstring); returns the report's path. The
    budget drawn is ``budget_gib``, else the run's ``config.json``'s ``device_memory_gib``."""
    run = _read_run(run_dir, budget_gib)
    out = os.path.join(run_dir, "report")
    os.makedirs(out, exist_ok=True)
    plots = _Plots(out, run["moves"])
    _plot_reward(plots, run)
    _plot_stages(plots, run)
    _plot_plan(plots, run)
    if run["predictions"]:
        _plot_predicted(plots, run)
    _plot_memory(plots, run)
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write(_markdown(run_dir, run["metrics"], run["predictions"], run["events"], run["moves"], run["skipped"], run["validation"]))
    return path


def _read_run(run_dir: str, budget_gib: float | None) -> dict:
    """The run's records: steps (``metrics``), validations, predictions, transition events
    (``moves``: the measured transitions), the lines skipped, and the memory budget."""
    skipped: list[str] = []
    # a step's record (with its validation, if one ran), or the validation before step 1
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"), ("step", "reward_mean", "kl", "step_seconds"), skipped,
                         alternative=lambda r: "step" in r and "val/reward_mean" in r)
    metrics = [r for r in records if "reward_mean" in r]
    validation = [r for r in records if "val/reward_mean" in r]
    if budget_gib is None and os.path.exists(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as f:
            try:
                budget_gib = json.load(f).get("device_memory_gib")
            except (ValueError, AttributeError):
                raise ValueError(f"{run_dir}/config.json is not a job config (pass --budget)") from None
    if not metrics:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl with a complete step (is it a `nereus train` run directory?)")
    predictions = read_jsonl(os.path.join(run_dir, "predictions.jsonl"),
                             ("step", "step_measured_s", "step_predicted_s", "error", "memory"), skipped)
    events = read_jsonl(os.path.join(run_dir, "transitions.jsonl"), ("step", "kind"), skipped)
    moves = [e for e in events if e["kind"] == "transition" and "measured_s" in e]
    return {"metrics": metrics, "validation": validation, "predictions": predictions, "events": events, "moves": moves,
            "skipped": skipped, "budget_gib": budget_gib, "steps": [m["step"] for m in metrics]}


class _Plots:
    """Figures into ``out`` (matplotlib's Agg backend), each with the run's transitions marked."""

    def __init__(self, out: str, moves: list[dict]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.out, self.moves, self.plt = out, moves, plt

    def figure(self, **kw):
        return self.plt.subplots(**kw)

    def mark(self, ax) -> None:
        for e in self.moves:
            ax.axvline(e["step"] + 0.5, color="tab:red", alpha=0.4, linestyle="--")

    def save(self, fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(os.path.join(self.out, name), dpi=90)
        self.plt.close(fig)


def _plot_reward(plots: _Plots, run: dict) -> None:
    metrics, validation, steps = run["metrics"], run["validation"], run["steps"]
    fig, ax = plots.figure(figsize=(8, 3.5))
    ax.plot(steps, [m["reward_mean"] for m in metrics], label="reward")
    if "task_reward_mean" in metrics[0]:
        ax.plot(steps, [m.get("task_reward_mean") for m in metrics], label="task reward")
    if validation:
        vs = [v["step"] for v in validation]
        ax.plot(vs, [v["val/reward_mean"] for v in validation], marker="o", label="validation reward")
        ax.plot(vs, [v.get("val/acc") for v in validation], marker="s", linestyle="--", label="validation accuracy")
    ax2 = ax.twinx()
    ax2.plot(steps, [m["kl"] for m in metrics], color="tab:gray", alpha=0.6, label="KL")
    ax.set_xlabel("step"), ax.set_ylabel("reward"), ax2.set_ylabel("KL")
    ax.legend(loc="upper left"), plots.mark(ax)
    plots.save(fig, "reward.png")


def _plot_stages(plots: _Plots, run: dict) -> None:
    metrics, steps = run["metrics"], run["steps"]
    names = sorted({n for m in metrics for n in m.get("stages", {})})
    fig, ax = plots.figure(figsize=(8, 3.5))
    for name in names:
        ax.plot(steps, [m.get("stages", {}).get(name, {}).get("seconds") for m in metrics], label=name)
    ax.set_xlabel("step"), ax.set_ylabel("seconds"), plots.mark(ax)
    ax.legend(fontsize=7, ncol=2)
    plots.save(fig, "stages.png")


def _plot_plan(plots: _Plots, run: dict) -> None:
    """The plan timeline: one bar per model-stage, a segment per layout it ran in."""
    metrics, steps = run["metrics"], run["steps"]
    keys = sorted({k for m in metrics for k in m.get("plan", {})})
    fig, ax = plots.figure(figsize=(8, 0.5 + 0.45 * max(len(keys), 1)))
    for row, key in enumerate(keys):
        labels = [m.get("plan", {}).get(key, "") for m in metrics]
        start = 0
        for i in range(1, len(labels) + 1):
            if i == len(labels) or labels[i] != labels[start]:
                ax.barh(row, steps[i - 1] - steps[start] + 1, left=steps[start] - 0.5, alpha=0.5)
                ax.text(steps[start] - 0.3, row, labels[start], va="center", fontsize=7)
                start = i
    ax.set_yticks(range(len(keys)), keys), ax.set_xlabel("step"), plots.mark(ax)
    plots.save(fig, "plan.png")


def _plot_predicted(plots: _Plots, run: dict) -> None:
    predictions, moves = run["predictions"], run["moves"]
    fig, (a, b) = plots.figure(ncols=2, figsize=(10, 3.5))
    ps = [p["step"] for p in predictions]
    a.plot(ps, [p["step_measured_s"] for p in predictions], label="measured")
    a.plot(ps, [p["step_predicted_s"] for p in predictions], label="predicted (before the step)")
    a.set_xlabel("step"), a.set_ylabel("seconds of the model-stages"), a.legend(), plots.mark(a)
    if moves:
        xs = range(len(moves))
        b.bar([x - 0.2 for x in xs], [e.get("predicted_s") or 0 for e in moves], width=0.4, label="predicted")
        b.bar([x + 0.2 for x in xs], [e["measured_s"] for e in moves], width=0.4, label="measured")
        b.set_xticks(list(xs), [f"step {e['step']}" for e in moves], fontsize=7)
        b.set_ylabel("transition seconds"), b.legend()
    else:
        b.text(0.5, 0.5, "no transition", ha="center")
    plots.save(fig, "predicted.png")


def _plot_memory(plots: _Plots, run: dict) -> None:
    metrics, predictions, steps, budget_gib = run["metrics"], run["predictions"], run["steps"], run["budget_gib"]
    fig, ax = plots.figure(figsize=(8, 3.5))
    world = max((len(r["peak_bytes"]) for m in metrics for r in m.get("stages", {}).values()), default=0)
    for rank in range(world):
        ax.plot(steps, [max((r["peak_bytes"][rank] for r in m.get("stages", {}).values()), default=0) / 2**30 for m in metrics],
                label=f"rank {rank} measured", alpha=0.7)
    if predictions:
        ax.plot([p["step"] for p in predictions], [max(p["memory"]["predicted_bytes"]) / 2**30 for p in predictions],
                color="black", linestyle=":", label="model (largest rank)")
    if budget_gib:
        ax.axhline(budget_gib, color="tab:red", label="budget")
    ax.set_xlabel("step"), ax.set_ylabel("GiB"), ax.legend(fontsize=7), plots.mark(ax)
    plots.save(fig, "memory.png")


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _markdown(run_dir, metrics, predictions, events, moves, skipped, validation=()) -> str:
    total = sum(m["step_seconds"] for m in metrics)
    moved = sum(e["measured_s"] for e in moves)
    decisions = [e for e in events if e["kind"] == "decision"]
    rows = [
        ("steps", f"{metrics[0]['step']}–{metrics[-1]['step']}"),
        ("mean step seconds", f"{_mean(m['step_seconds'] for m in metrics):.3f}"),
        ("reward, first 5 → last 10 steps", f"{_mean(m['reward_mean'] for m in metrics[:5]):.3f} → {_mean(m['reward_mean'] for m in metrics[-10:]):.3f}"),
        ("decisions (admitted)", f"{len(decisions)} ({sum(1 for d in decisions if d.get('admitted'))})"),
        ("transitions, seconds (share of the run)", f"{len(moves)}, {moved:.2f} s ({moved / total:.2%})" if total else "0"),
    ]
    if validation:
        first, last = validation[0], validation[-1]
        rows.append((f"validation reward / accuracy, step {first['step']} → {last['step']}",
                     f"{first['val/reward_mean']:.3f} / {first.get('val/acc', float('nan')):.3f} → "
                     f"{last['val/reward_mean']:.3f} / {last.get('val/acc', float('nan')):.3f}"))
    if skipped:
        rows.append(("records left out (torn or damaged)", ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")))
    if predictions:
        rows.append(("step-time model, mean error (last 10 steps)", f"{_mean(p['error'] for p in predictions[-10:]):.1%}"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    plots = "\n\n".join(f"![{name}]({name}.png)" for name in ("reward", "stages", "plan", "predicted", "memory")
                        if os.path.exists(os.path.join(run_dir, "report", f"{name}.png")))
    lines = [f"# Report of `{run_dir}`", "", "| | |", "| --- | --- |", table, "", plots, ""]
    if moves:
        lines += ["## Transitions", "", "| step | stages | predicted s | measured s | bytes |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {e['step']} | {', '.join(e.get('stages', []))} | {e.get('predicted_s') or 0:.3f} | {e['measured_s']:.3f} | {e.get('bytes', 0)} |"
                  for e in moves]
    return "\n".join(lines) + "\n"
