"""The ``cdbench`` command line: the typer app and its command table.

Each command lives in its own module of this package and never imports this
one; the table below registers them (in this order in ``--help``).
"""

from __future__ import annotations

import typer

import cdbench
from cdbench.cli import (
    calibrate,
    campaign,
    compare,
    fidelity,
    fit_predictor,
    gate,
    host,
    kernels,
    measure_specs,
    pack,
    profile,
    profile_gap,
    published,
    report,
    run,
    sweep,
)

app = typer.Typer(
    name="cdbench",
    help="Simulate and benchmark constrained-decoding schedulers and grammar backends.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # user mistakes are one line (cli.support); bugs keep a plain traceback
)


def version() -> None:
    """Print the cdbench version. Example: cdbench version"""
    typer.echo(cdbench.__version__)


COMMANDS = {
    "run": run.run_command,
    "compare": compare.compare,
    "sweep": sweep.sweep,
    "report": report.report,
    "gate": gate.gate,
    "fidelity": fidelity.fidelity,
    "pack": pack.pack,
    "profile": profile.profile,
    "profile-gap": profile_gap.profile_gap_command,
    "measure-specs": measure_specs.measure_specs,
    "fit-predictor": fit_predictor.fit_predictor,
    "kernels": kernels.kernels_command,
    "calibrate": calibrate.calibrate,
    "host": host.host,
    "version": version,
}
for name, command in COMMANDS.items():
    app.command(name)(command)
app.add_typer(campaign.app, name="campaign")
app.add_typer(published.app, name="published")
