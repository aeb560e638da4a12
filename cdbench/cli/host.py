"""``cdbench host``: this machine's identity and CPU benchmark score, and the other hosts recorded beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from cdbench._env import cache_dir
from cdbench.cli.support import console, fail, user_errors
from cdbench.harness.costs.host import HostError, recorded_hosts, this_host, time_scale


def host(
    store: Annotated[Path | None, typer.Option(
        "--store", help="folder holding hosts/<id>.json (default: <cache>/spec_costs)")] = None,
    rerun: Annotated[bool, typer.Option("--rerun", help="benchmark this host again and overwrite its record")] = False,
) -> None:
    """Show this host's id and CPU score (benchmarked once, about 1 s, then recorded) and every recorded host.

    Scores are in reference units, higher is faster; one host's seconds are priced for another by their ratio.

    Examples:
      cdbench host
      cdbench host --store runs/spec_costs --rerun
    """
    folder = store if store is not None else cache_dir() / "spec_costs"
    try:
        with user_errors():
            here = this_host(folder, rerun=rerun)
            hosts = recorded_hosts(folder)
            table = Table(title=f"hosts recorded in {folder / 'hosts'}")
            for column in ("id", "name", "arch", "score", "benchmark", "measured", "time vs this host"):
                table.add_column(column, justify="right" if column in ("score", "time vs this host") else "left")
            for h in hosts:
                table.add_row(h.id + (" (this)" if h.id == here.id else ""), h.name, h.arch, f"{h.score:.3f}",
                              f"v{h.benchmark_version}", h.measured, f"x{time_scale(here, h):.3f}")
    except HostError as exc:
        raise fail(str(exc)) from None
    for field, value in here.model_dump().items():
        console.print(f"{field}: {value}", highlight=False)
    console.print(table)
    console.print("time vs this host: multiply seconds measured here by it to price them on that host.",
                  highlight=False)
