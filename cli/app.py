"""The `nereus` command: a thin Typer app.

Each command lives in its own small module under cli/ as a plain function and is
registered here, one line each, so this file stays a table of contents::

    from nereus.cli.demo import demo
    app.command()(demo)

Commands parse and validate their arguments, then call library code; no logic here.
"""

from __future__ import annotations

import typer

import nereus

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Nereus: adaptive-parallelism runtime for RL post-training of LLMs.",
)


@app.callback()
def _root() -> None:
    """Nereus: adaptive-parallelism runtime for RL post-training of LLMs."""
    # An explicit callback keeps Typer in group mode (`nereus version`) even while
    # only one command is registered; without it a lone command becomes the app.


@app.command()
def version() -> None:
    """Print the nereus and torch versions."""
    import torch  # deferred: keeps `nereus --help` fast

    typer.echo(f"nereus {nereus.__version__}")
    typer.echo(f"torch {torch.__version__}")


# Register further commands below, one line each.
from nereus.cli.demo import demo  # noqa: E402
from nereus.cli.train import train  # noqa: E402

app.command()(train)
from nereus.cli.resume import resume  # noqa: E402

app.command()(resume)
app.command()(demo)
from nereus.cli.convert import convert  # noqa: E402

app.command()(convert)
from nereus.cli.inspect import inspect  # noqa: E402

app.command()(inspect)
from nereus.cli.configs import configs  # noqa: E402

app.command()(configs)
from nereus.cli.plan import plan  # noqa: E402

app.command()(plan)
from nereus.cli.report import report  # noqa: E402

app.command()(report)
from nereus.cli.simulate import simulate  # noqa: E402

app.command()(simulate)


def main() -> None:
    """Console-script entry point (`nereus`)."""
    app()


if __name__ == "__main__":
    main()
