"""`nereus simulate`: the controller on a cluster and a trace, in the simulated world, against the best static plan, the paper's fixed plan, a Viterbi oracle and a greedy (no processes)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import typer

SHIPPED = Path(__file__).resolve().parents[1] / "configs" / "simulate"


def _shipped(kind: str, arg: str) -> str:
    """A file as given, else the shipped ``configs/simulate/<kind>/<arg>.yaml``."""
    if os.path.isfile(arg):
        return arg
    path = SHIPPED / kind / f"{arg.removesuffix('.yaml')}.yaml"
    if path.is_file():
        return str(path)
    known = ", ".join(sorted(p.stem for p in (SHIPPED / kind).glob("*.yaml")))
    raise FileNotFoundError(f"{kind[:-1]} {arg!r} is neither a file nor a shipped one ({known})")


def simulate(
    cluster: str = typer.Option("mi250x_1024", help="Cluster YAML, or a shipped one (configs/simulate/clusters)."),
    job: str = typer.Option("llama3_8b_ppo", help="Job YAML, or a shipped one (configs/simulate/jobs)."),
    trace: str = typer.Option("drift", help="Trace spec YAML or a JSONL trace file, or a shipped spec (configs/simulate/traces)."),
    from_run: Optional[str] = typer.Option(None, "--from-run", help="Replay a real run's recorded lengths (RUN_DIR of nereus train) on its own world."),
    steps: Optional[int] = typer.Option(None, help="Simulate only the first STEPS steps of the trace."),
    world: Optional[str] = typer.Option(None, help="World parameters: a shipped name (configs/simulate/worlds) or a file (default: the cluster's)."),
    policies: str = typer.Option("best_static,initial_fixed,oracle,greedy,adaptive", help="Comma-separated policies to compare."),
    out: Optional[str] = typer.Option(None, help="Output folder: summary.md, summary.json, PNG plots, the adaptive run's logs (nereus report OUT/adaptive)."),
    plots: bool = typer.Option(True, help="Write the PNG plots (with --out)."),
    as_json: bool = typer.Option(False, "--json", help="Print the JSON summary instead of the Markdown one."),
) -> None:
    """Simulate JOB on CLUSTER through TRACE under every policy: the live controller's own
    models, search and admission, in a world of its own it calibrates against, beside the
    best static plan in hindsight, the paper's fixed plan and a Viterbi oracle. Prints per
    policy its run time and speedup over best_static, every transition, waits."""
    from nereus.trainer.simulate.inputs import SimulateError, load_cluster, load_job
    from nereus.trainer.simulate.outputs import plots as write_plots
    from nereus.trainer.simulate.outputs import summary_json, summary_markdown
    from nereus.trainer.simulate.replay import compare, compare_markdown, replay
    from nereus.trainer.simulate.run import simulate as run_simulation
    from nereus.trainer.simulate.traces import generate, load_trace_spec, read_jsonl

    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    run_dir = os.path.join(out, "runs") if out else None
    try:
        comparison = None
        if from_run is not None:
            result, lines = replay(from_run, policies=chosen, out_run_dir=run_dir, world=world)
            comparison = compare(result, lines)
        else:
            c, j = load_cluster(_shipped("clusters", cluster)), load_job(_shipped("jobs", job))
            if world is not None:
                c = dataclasses.replace(c, world=world)
            if steps is not None and steps < 1:
                raise SimulateError(f"--steps {steps}: simulate at least 1 step")
            if trace.endswith(".jsonl"):
                steps_in, name = read_jsonl(trace, cap=j.response.max), os.path.basename(trace)
            else:
                spec = load_trace_spec(_shipped("traces", trace))
                steps_in, name = generate(spec, rows=j.rows, cap=j.response.max, devices=c.devices, per_node=c.per_node), spec.name
            if steps is not None:
                steps_in = steps_in[:steps]
            result = run_simulation(c, j, steps_in, trace_name=name, policies=chosen, run_dir=run_dir)
    except (SimulateError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    summary = summary_json(result)
    text = summary_markdown(result)
    if comparison is not None:
        summary["live"] = comparison
        text += "\n" + compare_markdown(comparison)
    if out:
        os.makedirs(out, exist_ok=True)
        Path(out, "summary.json").write_text(json.dumps(summary, indent=1))
        if plots:
            paths = write_plots(result, out)
            text += "\n" + "\n".join(f"![{Path(p).stem}]({Path(p).name})" for p in paths) + "\n"
        Path(out, "summary.md").write_text(text)
    typer.echo(json.dumps(summary, indent=1) if as_json else text)
