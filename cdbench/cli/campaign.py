"""``cdbench campaign``: run a campaign file's missing runs, report its comparisons, pack its runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml
from pydantic import ValidationError

from cdbench.campaigns.execute import (
    RunOutcome,
    check_finished_configs,
    is_finished,
    run_campaign,
)
from cdbench.campaigns.plan import PlannedRun, folder_lookup, plan_runs, run_config
from cdbench.campaigns.report import (
    evaluate_campaign,
    folder_opener,
    runs_table,
    verdicts,
    write_campaign_report,
)
from cdbench.campaigns.spec import CampaignSpec, load_campaign
from cdbench.cli.support import (
    console,
    err_console,
    output_folder,
    progress_bar,
    user_errors,
)
from cdbench.results.config_files import ConfigError
from cdbench.results.output_folder import MARKER_FILE
from cdbench.results.sweep import base_config

app = typer.Typer(help="Experiments as files: arms, copies, seeds and comparisons (docs/campaigns.md).",
                  no_args_is_help=True)

CampaignArg = Annotated[Path, typer.Argument(help="Campaign YAML (docs/campaigns.md).")]
OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Campaign folder of the run folders "
                                                                  "(default runs/campaign-<name>).")]


def _default_out(spec: CampaignSpec) -> Path:
    return Path("runs") / f"campaign-{spec.name}"


def _unclaimed(folder: Path | None) -> bool:
    """Whether ``folder`` holds files but no cdbench command's marker (e.g. runs made before campaigns)."""
    return folder is not None and folder.is_dir() and not (folder / MARKER_FILE).exists() and any(folder.iterdir())


def _adoption(spec: CampaignSpec, out: Path | None, runs: list[PlannedRun], adopt: bool) -> list[PlannedRun]:
    """The campaign's finished runs in an unclaimed ``out`` that ``--adopt`` takes as they are; a one-line
    error where it is needed but not given, or given for a folder it cannot take."""
    earlier = [run for run in runs if _unclaimed(out) and is_finished(out / run.run_id)]
    if earlier and not adopt:
        raise ConfigError(f"--out {out} holds {len(earlier)} of the campaign's runs made before campaigns (e.g. "
                          f"{earlier[0].run_id}) but no campaign marker; --adopt takes them as finished runs")
    if adopt and not _unclaimed(out):
        raise ConfigError(f"--adopt takes a folder of runs made before campaigns; --out {out} is missing, empty or "
                          "already a cdbench command's folder (a campaign's own folder resumes without --adopt: its "
                          "finished runs kept, the missing ones run)" if out is not None else
                          "--adopt needs --out, the folder of the runs made before campaigns")
    if adopt and not earlier:
        raise ConfigError(f"--adopt: --out {out} holds none of the campaign's runs at the folders its layout gives "
                          f"(e.g. {runs[0].run_id}); check the layout or --out")
    return earlier


def _differences(spec: CampaignSpec, base: dict, out: Path, run: PlannedRun) -> list[str]:
    """The config keys where an adopted run's own config.yaml differs from what the campaign file gives it."""
    import pandas as pd

    from cdbench.harness.config import RunConfig

    def flatten(tree: dict) -> dict:
        return pd.json_normalize(tree, sep=".").iloc[0].to_dict()

    try:
        planned, saved = (flatten(RunConfig.model_validate(tree).model_dump(mode="json"))
                          for tree in (run_config(spec, base, run, folder_lookup(out), out),
                                       yaml.safe_load((out / run.run_id / "config.yaml").read_text())))
    except (ConfigError, ValidationError, OSError, yaml.YAMLError):
        return ["(its config.yaml cannot be compared)"]
    return sorted(key for key in planned.keys() | saved.keys() if planned.get(key) != saved.get(key))


@app.command("run")
def run(
    campaign_file: CampaignArg,
    out: OutOpt = None,
    deadline_s: Annotated[float | None, typer.Option("--deadline-s", help="Start no run after this many seconds "
                                                                          "(and stop the running ones).")] = None,
    adopt: Annotated[bool, typer.Option("--adopt", help="Take an --out folder of runs made before campaigns (no "
                                                       "campaign marker) as this campaign's: its finished runs at "
                                                       "the layout's folders count as done, as they are.")] = False,
) -> None:
    """Run every run of the campaign whose folder holds no finished run; a rerun runs only what is missing.

    Examples:
      cdbench campaign run campaigns/model_vs_hybrid.yaml --out runs/mvh
      cdbench campaign run campaigns/ranks_vs_model.yaml --out /tmp/rk --adopt   (runs made by hand before)
    """
    with user_errors():
        spec = load_campaign(campaign_file)
        base = base_config(spec.base, campaign_file)
        runs = plan_runs(spec)
        adopted = _adoption(spec, out, runs, adopt)
        out = output_folder(out, _default_out(spec), "campaign", identity={"campaign": spec.name}, resumable=True,
                            adopt=adopt)
        check_finished_configs(spec, base, out, runs)
        for run in adopted:
            differ = _differences(spec, base, out, run)
            console.print(f"adopted {run.run_id}" + (f"; its config differs from the file's in {', '.join(differ[:4])}"
                                                     + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
                                                     if differ else ""), highlight=False, soft_wrap=True)
    counts = {"done": 0, "skipped": 0}
    problems: list[RunOutcome] = []
    with user_errors(out / "campaign.log"), progress_bar() as bar:
        task = bar.add_task(f"campaign {spec.name} ({len(runs)} runs)", total=len(runs))

        def advance(outcome: RunOutcome) -> None:
            if outcome.status in counts:
                counts[outcome.status] += 1
            else:
                problems.append(outcome)
            bar.advance(task)

        run_campaign(spec, base, runs, out, [sys.executable, "-m", "cdbench"], on_outcome=advance,
                     deadline_s=deadline_s)
    console.print(f"campaign {spec.name}: {out}/ ({counts['done']} run, {counts['skipped']} already done, "
                  f"{len(problems)} not done)")
    for outcome in problems:
        err_console.print(f"[red]{outcome.status}[/] {outcome.run.run_id}: {outcome.error}", soft_wrap=True)
    if problems:
        raise typer.Exit(1)


@app.command("report")
def report(
    campaign_file: CampaignArg,
    out: OutOpt = None,
    pack: Annotated[Path | None, typer.Option("--pack", help="Read the runs from this pack (cdbench campaign "
                                                             "pack) instead of the campaign folder.")] = None,
    report_dir: Annotated[Path | None, typer.Option("--report", help="Folder of campaign.md, campaign.csv and each "
                                                                     "comparison's pages (default <out>/report).")] = None,
) -> None:
    """Judge every comparison cell by cell (cdbench fidelity's bars and noise floor) and write campaign.md,
    campaign.csv, runs.csv (every run's summary figures) and each judgement's fidelity page with its plots.

    Examples:
      cdbench campaign report campaigns/model_vs_hybrid.yaml --out runs/mvh
      cdbench campaign report campaigns/model_vs_hybrid.yaml --pack reports/fidelity/model_vs_hybrid.pack
    """
    with user_errors():
        spec = load_campaign(campaign_file)
        if pack is not None:
            from cdbench.results.pack import Pack

            packed = Pack(pack)
            opener = packed.open
            report_dir = report_dir or pack.with_name(pack.name.removesuffix(".pack") + "-report")
        else:
            folder = out or _default_out(spec)
            if not folder.is_dir():
                raise ConfigError(f"campaign folder {folder} does not exist; run the campaign first or give --pack")
            opener = folder_opener(folder)
            report_dir = report_dir or folder / "report"
    with user_errors(), err_console.status("judging the comparisons and drawing their plots"):
        frame = evaluate_campaign(spec, opener, report_dir)
        md = write_campaign_report(spec, frame, runs_table(spec, opener), report_dir)
    for name, (passing, judged, within, checked, unresolved) in verdicts(spec, frame).items():
        console.print(f"{name}: cells passing {passing} of {judged}; figures within their bar {within} of {checked}"
                      + (f" ({unresolved} of the others unresolved: too few requests)" if unresolved else ""))
    console.print(f"report: {md} (table {report_dir / 'campaign.csv'})")


@app.command("pack")
def pack(
    campaign_file: CampaignArg,
    dest: Annotated[Path, typer.Argument(help="The pack folder to write (e.g. reports/x/campaign.pack).")],
    out: OutOpt = None,
) -> None:
    """Pack the campaign's finished runs, keyed by run id, into one pack (cdbench pack's format);
    `cdbench campaign report FILE --pack DEST` reads it alone.

    Example: cdbench campaign pack campaigns/model_vs_hybrid.yaml reports/fidelity/mvh.pack --out runs/mvh
    """
    from cdbench.results.pack import pack_runs

    with user_errors():
        spec = load_campaign(campaign_file)
        folder = out or _default_out(spec)
        runs = plan_runs(spec)
        finished = {run.run_id: folder / run.run_id for run in runs if is_finished(folder / run.run_id)}
        if not finished:
            raise ConfigError(f"campaign folder {folder} holds none of the campaign's finished runs")
        with progress_bar() as bar:
            task = bar.add_task(f"packing {len(finished)} runs", total=len(finished))
            pack_runs(finished, dest, progress=lambda _: bar.advance(task))
    missing = len(runs) - len(finished)
    console.print(f"pack: {dest} ({len(finished)} runs{f'; {missing} not finished, left out' if missing else ''})")
