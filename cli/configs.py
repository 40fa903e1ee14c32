"""`nereus configs`: the job configs shipped in the package ``nereus.configs``, and the config reference.

The configs are package data, found through ``importlib.resources`` so that they resolve
in a source checkout (configs/) and in an installed wheel alike. A package installed from
a wheel is a plain folder, so its files are real paths that the loader can open.

``nereus configs --reference`` prints every config key with its type, default and meaning as
Markdown, generated from the dataclasses (``trainer/config/reference.py``); ``docs/config.md``
is that output, kept equal to it by ``tests/cli/test_config_reference.py``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Optional

import typer


def shipped_configs() -> dict[str, Path]:
    """Name (file stem) → absolute path of every shipped config, sorted by name."""
    root = Path(resources.files("nereus.configs")).resolve()
    return {path.stem: path for path in sorted(root.glob("*.yaml"))}


def shipped_config(name: str) -> Path:
    """The shipped config ``name`` (``tiny_grpo`` or ``tiny_grpo.yaml``); FileNotFoundError
    naming the shipped ones if there is none."""
    shipped = shipped_configs()
    path = shipped.get(name.removesuffix(".yaml"))
    if path is None:
        raise FileNotFoundError(f"unknown config {name!r}; shipped configs: {', '.join(shipped)}")
    return path


def resolve_config(arg: str) -> Path:
    """A config file as given, or, when no such file exists and ``arg`` is a bare name
    (no directory part), the shipped config of that name."""
    path = Path(arg)
    if path.is_file():
        return path
    shipped = shipped_configs()
    if path.name == arg and arg.removesuffix(".yaml") in shipped:
        return shipped[arg.removesuffix(".yaml")]
    raise FileNotFoundError(f"config {arg!r}: no such file, and not a shipped config (shipped: {', '.join(shipped)})")


def first_comment(path: Path) -> str:
    """The text of the file's first ``#`` comment line ('' if it has none)."""
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return ""


def configs(
    path: Optional[str] = typer.Option(None, "--path", metavar="NAME", help="Print the absolute path of one shipped config."),
    reference: bool = typer.Option(
        False, "--reference", help="Print the reference of every config key (type, default, meaning) as Markdown: docs/config.md."
    ),
) -> None:
    """List the shipped job configs (name and first comment line), print one's path, or print the config reference."""
    if reference:
        from nereus.trainer.config.reference import render_markdown  # deferred: the schema imports torch

        typer.echo(render_markdown(), nl=False)
        return
    if path is not None:
        try:
            typer.echo(shipped_config(path))
        except FileNotFoundError as e:
            typer.echo(f"nereus configs: error: {e}", err=True)
            raise typer.Exit(2) from None
        return
    shipped = shipped_configs()
    width = max(map(len, shipped), default=0)
    for name, file in shipped.items():
        typer.echo(f"{name:<{width}}  {first_comment(file)}")
