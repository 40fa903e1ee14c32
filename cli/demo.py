"""`nereus demo`: reshard a live actor state through an RL job's layouts on 4 processes."""

from __future__ import annotations

import json
import uuid

import typer


def demo(
    checksums: bool = typer.Option(True, help="Verify a crc32 of every message and staged box."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON instead of a table."),
) -> None:
    """Reshard a Llama-shaped actor (weights + AdamW state) through TP/PP/DP layouts on 4
    local gloo processes, checking every element after each transition."""
    from nereus.launch import launch_local
    from nereus.reshard.demo import format_rows, run_worker

    results = launch_local(run_worker, 4, *_args(checksums), run_id=f"nereus-demo-{uuid.uuid4().hex[:8]}")
    rows = results[0]
    typer.echo(json.dumps(rows, indent=2) if as_json else format_rows(rows))
    if not all(r["exact"] for r in rows):
        raise typer.Exit(1)


def _args(checksums: bool) -> tuple:
    from nereus.reshard.demo import DEMO_SPEC

    return DEMO_SPEC, checksums
