"""`nereus convert`: offline conversion between HF safetensors and Nereus checkpoints."""

from __future__ import annotations

import typer


def convert(
    src: str = typer.Argument(..., help="An HF safetensors directory or a Nereus checkpoint (detected)."),
    dst: str = typer.Argument(..., help="Destination: a directory or fsspec URL (HF output: local directory)."),
    to: str = typer.Option("hf", "--to", help="'hf', or a layout like 'tp=2,pp=2' (dp, tp, pp; degrees not named are 1)."),
    dtype: str = typer.Option(None, "--dtype", help="Cast floating tensors to bf16, fp16 or fp32."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a checkpoint (or an HF export) already at DST."),
    model: str = typer.Option(None, "--model", help="The model to convert from a checkpoint of several (e.g. actor, critic)."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Convert SRC to DST without a process group, tensor by tensor (memory ~2x the largest tensor)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from nereus.reshard.errors import ReshardError
    from nereus.store.convert import convert as run
    from nereus.store.errors import StoreError

    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), transient=True, disable=not progress)
    task = bar.add_task(f"{src} -> {dst}", total=None)
    try:
        with bar:
            summary = run(src, dst, to=to, dtype=dtype, overwrite=overwrite, model=model,
                          on_total=lambda n: bar.update(task, total=n), progress=lambda n: bar.advance(task, n))
    except (StoreError, ReshardError, OSError) as e:
        typer.echo(f"nereus convert: error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"converted {summary.source} -> {summary.destination}: {summary.tensors} tensors, "
        f"{summary.nbytes / 2**20:.1f} MiB in {summary.seconds:.2f} s ({summary.gbps:.2f} GB/s) -> {dst}"
    )
