"""`nereus resume`: continue a stopped or crashed job on any number of processes."""

from __future__ import annotations

from typing import List, Optional

import typer


def resume(
    run_dir: str = typer.Argument(..., help="The run directory of a `nereus train` job (its config.json and checkpoints)."),
    nproc: Optional[int] = typer.Option(None, help="Worker processes to continue on (default: the run's nproc)."),
    set_: List[str] = typer.Option([], "--set", help="Override a config key: --set steps=200, --set plan.actor.train.tp=2 (repeatable)."),
    nnodes: str = typer.Option("1", "--nnodes", help="Nodes: N or MIN:MAX (elastic)."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="Restarts of the workers after one dies; they restore the newest valid state."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT where the nodes' agents meet (several nodes)."),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help="The job's rendezvous id, the same on every node (several nodes)."),
) -> None:
    """Continue RUN_DIR's job from its latest committed checkpoint (or the node's newer staged copy, checked) on NPROC processes: in the
    checkpoint's plan where it runs on NPROC ranks, else in the plan the controller chooses
    for them (or the one --set plan... gives); the state loads into the new layouts."""
    from nereus.cli.train import check_launch, hold_run_dir, preflight, run_job
    from nereus.trainer.config import ConfigError
    from nereus.trainer.elastic.resume import resume_config

    check_launch(nnodes, max_restarts, rdzv_endpoint, rdzv_id)

    with hold_run_dir(run_dir, nnodes) as locked:  # before the run dir is read: one job per run dir
        try:
            cfg, how = resume_config(run_dir, nproc=nproc, overrides=list(set_))
        except (ConfigError, FileNotFoundError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        preflight(cfg, max_restarts)
        typer.echo(f"resuming {run_dir} on {cfg.nproc} processes in {how}")
        run_job(cfg, resume=True, nnodes=nnodes, max_restarts=max_restarts, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                locked=locked)
