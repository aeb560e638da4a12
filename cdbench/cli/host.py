"""``cdbench host``: this machine's identity and CPU benchmark score, and the other hosts recorded beside it;
with ``--probe-specs``, a spec-cost probe of a recorded host's stored specs (:mod:`cdbench.harness.costs.spec_probe`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from cdbench._env import cache_dir
from cdbench.cli.support import console, fail, progress_bar, user_errors
from cdbench.harness.costs.host import HostError, recorded_hosts, this_host, time_scale
from cdbench.harness.costs.spec_probe import PROBE_PREFIX, PROBE_SPECS, SpecProbeError


def host(
    store: Annotated[Path | None, typer.Option(
        "--store", help="folder holding hosts/<id>.json (default: <cache>/spec_costs)")] = None,
    rerun: Annotated[bool, typer.Option("--rerun", help="benchmark this host again and overwrite its record")] = False,
    probe_specs: Annotated[str | None, typer.Option(
        "--probe-specs", help="a host id whose stored specs to compile here: writes a probe (--out) that "
        "costs.spec_host_scale=probe:<file> prices with")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="the probe file to write (with --probe-specs)")] = None,
    trace: Annotated[list[Path] | None, typer.Option(
        "--trace", help="a workload trace of a run that measured the probed specs (repeatable): their stored texts "
        "in it are walked again, for a fill scale (without one, fills scale by the score ratio)")] = None,
    backend: Annotated[str, typer.Option(help="the probed specs' backend")] = "xgrammar",
    vocab: Annotated[str, typer.Option(help="the probed specs' vocabulary")] = "qwen3.6",
    specs: Annotated[int, typer.Option(min=4, help="specs the probe compiles, spanning the stored compile "
                                       "times")] = PROBE_SPECS,
    workers: Annotated[int | None, typer.Option(
        min=1, help="worker processes measuring at once (default: half the CPUs, as model mode measures)")] = None,
    order: Annotated[bool, typer.Option(
        "--order", help="also compile each --trace's specs in run order, as the store compiled that run's "
        "sequence: its compiles in run order then take that scale")] = False,
) -> None:
    """Show this host's id and CPU score (benchmarked once, about 1 s, then recorded) and every recorded host.

    Scores are in reference units, higher is faster; one host's seconds are priced for another by their ratio.

    With --probe-specs HOST, compiles a fixed set of HOST's stored specs here, measured as the store
    measured them, and writes their times there and here and the scale (median ratio and spread) for
    compiles and fills: the measured replacement of the score ratio between two hosts. Run it alone, on
    the cores the target's compiles will have: a large grammar's compile spreads over the cores, so a
    probe on fewer cores than the target's prices the large compiles long
    (reports/spec_costs/out_of_sample.md, "A compile probe"). With --order, each --trace's run-order
    sequence stored for HOST is compiled here too (a model run of that trace on HOST stored it): a
    compile after related ones scales between hosts unlike one alone ("A probe in run order").

    Examples:
      cdbench host
      cdbench host --store runs/spec_costs --rerun
      cdbench host --store STORE --probe-specs 7fdcd680e958 --trace a/workload.trace.jsonl --out probe.json
      cdbench host --store STORE --probe-specs 7fdcd680e958 --trace a/workload.trace.jsonl --order --out probe.json
    """
    folder = store if store is not None else cache_dir() / "spec_costs"
    if probe_specs is not None:
        _probe(folder, probe_specs, out, trace, backend, vocab, specs, workers, order)
        return
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


def _probe(folder: Path, host_id: str, out: Path | None, traces: list[Path] | None, backend: str, vocab: str, specs: int,
           workers: int | None, order: bool) -> None:
    from cdbench.harness.costs.spec_store import SpecCostStore
    from cdbench.profile.spec_probe import probe_specs
    from cdbench.workloads.trace import read_trace

    if out is None:
        raise fail("--probe-specs writes a probe file: give it with --out")
    try:
        with user_errors(), progress_bar(transient=True) as bar:
            if order and not traces:
                raise fail("--order compiles each --trace's specs in run order: give at least one --trace")
            workloads = [read_trace(trace).workload.requests for trace in traces or ()]
            task = bar.add_task("probing", total=100)
            probe = probe_specs(SpecCostStore(folder), host_id, backend, vocab, [r for w in workloads for r in w],
                                n=specs, workers=workers, sequences=workloads if order else (),
                                progress=lambda stage, done: bar.update(task, description=stage, completed=100 * done))
    except SpecProbeError as exc:
        raise fail(str(exc)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(probe.model_dump_json(indent=1) + "\n", encoding="utf-8")
    table = Table(title=f"{probe.backend} {probe.backend_version} on {probe.vocab}: host {probe.measured_on.id} "
                        f"({probe.measured_on.name}) against this host {probe.host.id}")
    for column in ("spec", "compile there (ms)", "compile here (ms)", "here / there"):
        table.add_column(column, justify="left" if column == "spec" else "right")
    for s in probe.specs:
        table.add_row(s.label, f"{s.there_s * 1e3:.1f}", "failed" if s.here_s is None else f"{s.here_s * 1e3:.1f}",
                      "-" if s.here_s is None else f"{s.here_s / s.there_s:.3f}")
    console.print(table)
    fill = probe.fill.describe("texts") if probe.fill is not None else \
        f"not measured ({len(probe.walks)} stored texts walked: give --trace of the run that measured them)"
    console.print(f"compile {probe.compile.describe('specs')} (summed: × {probe.compile_total:.3f}); fill {fill}",
                  highlight=False)
    if probe.compile_order is not None:
        console.print(f"in run order ({len(probe.sequences)} sequences): compile "
                      f"{probe.compile_order.describe('specs')}", highlight=False)
    console.print(f"probe: {out}  (--set costs.spec_host_scale={PROBE_PREFIX}{out})", highlight=False)
