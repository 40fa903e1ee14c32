"""`nereus inspect`: a checkpoint's manifest, EMUs and layouts, as a table or JSON."""

from __future__ import annotations

import json

import typer


def inspect(
    path: str = typer.Argument(..., help="A Nereus checkpoint root (directory or fsspec URL)."),
    step: int = typer.Option(None, "--step", help="Checkpoint step (default: the latest)."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Show the committed checkpoints at PATH and one manifest: EMUs and tensor layouts."""
    from nereus.reshard.errors import ReshardError
    from nereus.store.errors import StoreError
    from nereus.store.inspect import describe, manifest_json

    try:
        text = json.dumps(manifest_json(path, step), indent=2, sort_keys=True) if as_json else describe(path, step)
    except (StoreError, ReshardError, OSError) as e:
        typer.echo(f"nereus inspect: error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(text)
