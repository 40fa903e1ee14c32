"""`nereus report`: plots and a Markdown summary of a run directory."""

from __future__ import annotations

from typing import Optional

import typer


def report(
    run_dir: str = typer.Argument(..., help="A `nereus train` run directory (finished or running)."),
    budget: Optional[float] = typer.Option(None, help="Memory budget per rank to draw, GiB (default: the run's device_memory_gib)."),
) -> None:
    """Write RUN_DIR/report/: PNG plots (reward and KL, seconds per model-stage, the plan
    timeline, predicted vs measured step and transition times, memory per rank) and report.md."""
    from nereus.trainer.metrics.report import make_report

    try:
        path = make_report(run_dir, budget_gib=budget)
    except (OSError, ValueError) as e:  # a missing or damaged run directory
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(path)
