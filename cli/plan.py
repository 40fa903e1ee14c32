"""`nereus plan`: the best plans for a job and a world, offline (no processes)."""

from __future__ import annotations

import json
from typing import List, Optional

import typer


def plan(
    config: str = typer.Argument(..., help="Job config: a YAML file or a shipped config's name (`nereus configs`)."),
    set_: List[str] = typer.Option([], "--set", help="Override a config key: --set device_memory_gib=80 (repeatable)."),
    nproc: Optional[int] = typer.Option(None, help="Ranks to plan for (default: the config's nproc)."),
    top: int = typer.Option(5, help="How many plans to show."),
    as_json: bool = typer.Option(False, "--json", help="Print the plans as JSON."),
) -> None:
    """Search the plans of CONFIG's job on NPROC ranks: the best and its runners-up, each with
    its predicted step seconds per model-stage and peak memory per rank against the budget
    (the controller's models with the device profile's priors)."""
    from nereus.cli.configs import resolve_config
    from nereus.trainer.config import ConfigError
    from nereus.trainer.controller.report import plan_json, plan_table
    from nereus.trainer.prepare import run_search

    overrides = list(set_) + ([f"nproc={nproc}"] if nproc is not None else [])
    try:
        cfg, result, current, skipped = run_search(resolve_config(config), overrides, top=top)
    except (ConfigError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(plan_json(cfg, result, current, skipped), indent=2) if as_json else plan_table(cfg, result, current, skipped))
