"""The ``cdbench`` command line. Each subcommand lives in its own module and is registered here."""

from __future__ import annotations

import typer

import cdbench

app = typer.Typer(
    name="cdbench",
    help="Simulate and benchmark constrained-decoding schedulers and grammar backends.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # user mistakes are one line (cli_support); bugs keep a plain traceback
)

# Importing a command module registers its command on ``app`` (in this order in --help).
import cdbench.harness.run_cli  # noqa: E402,F401  (registers "run")
import cdbench.harness.compare_cli  # noqa: E402,F401  (registers "compare")
import cdbench.harness.sweep_cli  # noqa: E402,F401  (registers "sweep")
import cdbench.harness.report_cli  # noqa: E402,F401  (registers "report")
import cdbench.harness.gate_cli  # noqa: E402,F401  (registers "gate")
import cdbench.harness.profile_cli  # noqa: E402,F401  (registers "profile")
app.command("kernels")(__import__("cdbench.kernels.bench", fromlist=["kernels_command"]).kernels_command)


@app.command()
def version() -> None:
    """Print the cdbench version. Example: cdbench version"""
    typer.echo(cdbench.__version__)
