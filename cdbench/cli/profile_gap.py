"""``cdbench profile-gap``: two sets of grammar profiles side by side (:mod:`cdbench.profile.gap`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cdbench.cli.support import user_errors
from cdbench.profile.gap import BACKENDS, profile_gap


def profile_gap_command(
    base: Annotated[Path, typer.Argument(help="Folder of profiles, <backend> or profile_<backend> .parquet or "
                                               ".json (e.g. a cdbench profile output).")],
    other: Annotated[Path, typer.Argument(help="Folder of the profiles set against them (e.g. in situ).")],
    backends: Annotated[str, typer.Option(help="Backends, comma-separated.")] = ",".join(BACKENDS),
) -> None:
    """Print, per backend and constraint kind, the fill and compile quantiles of two profile sets and the
    ratio other / base (markdown), with the sample counts; the pooled row covers every kind.

    Example: cdbench profile-gap runs/profile-demo cdbench/harness/costs/profiles --backends xgrammar,llguidance
    """
    with user_errors():
        text = profile_gap(base, other, tuple(b.strip() for b in backends.split(",") if b.strip()))
    typer.echo(text, nl=False)
