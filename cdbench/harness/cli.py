"""The ``cdbench`` command line. Each subcommand lives in its own module and is registered here."""

from __future__ import annotations

import typer

import cdbench

app = typer.Typer(
    name="cdbench",
    help="Simulate and benchmark constrained-decoding schedulers and grammar backends.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def version() -> None:
    """Print the cdbench version. Example: cdbench version"""
    typer.echo(cdbench.__version__)
import cdbench.harness.profile_cli  # noqa: E402,F401  (registers "profile")
