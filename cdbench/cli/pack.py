"""``cdbench pack``: a campaign's run folders as one compressed Parquet pack, its listing, unpacking and
rewriting in the current format."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from rich.table import Table

from cdbench.cli.support import console, progress_bar, user_errors
from cdbench.results.config_files import ConfigError
from cdbench.results.pack import Pack, find_run_folders, pack_runs
from cdbench.results.run_folder import ResultsError


def _campaign_files(src: Path, run_folders: list[Path]) -> dict[str, Path]:
    """Every file under ``src`` outside the run folders, by its path relative to ``src``."""
    inside = set(run_folders)
    return {path.relative_to(src).as_posix(): path for path in sorted(src.rglob("*"))
            if path.is_file() and not inside.intersection(path.parents)}


def _size(pack: Path) -> int:
    return sum(path.stat().st_size for path in pack.iterdir())


def _listing(pack: Pack) -> Table:
    table = Table(title=f"{pack.path}: {len(pack.run_ids)} runs", title_justify="left")
    for name in ("run id", "mode", "backend", "policy", "seed", "requests", "steps"):
        table.add_column(name, justify="left" if name == "run id" else "right", overflow="fold")
    for row in pack.index.itertuples(index=False):
        table.add_row(*("-" if pd.isna(value) else str(value) for value in row))
    return table


def pack(
    src: Annotated[Path, typer.Argument(help="Folder whose run folders are packed (with --list, --unpack or "
                                             "--repack: the pack).")],
    dest: Annotated[Path | None, typer.Argument(help="The pack folder to write (e.g. campaign.pack); with "
                                                      "--unpack, the folder to write the runs into.")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the runs of the pack SRC.")] = False,
    unpack: Annotated[bool, typer.Option("--unpack", help="Write the runs and files of the pack SRC back as "
                                                         "folders under DEST.")] = False,
    all_files: Annotated[bool, typer.Option("--all-files", help="Pack every other file under SRC too (campaign "
                                                               "pages, logs), listed by its path.")] = False,
    repack: Annotated[bool, typer.Option("--repack", help="Write the pack SRC again as the new pack DEST, in the "
                                                         "current (smaller) format: the same runs and files.")] = False,
    exact: Annotated[bool, typer.Option("--exact", help="Keep the step log's seconds as the runs wrote them (by "
                                                       "default a pack keeps them at 0.1 µs; summaries and "
                                                       "requests are always exact).")] = False,
) -> None:
    """Pack every run folder under SRC (a folder holding summary.json and config.yaml) into DEST: the runs'
    summaries, configs, requests and steps as zstd Parquet keyed by run id (the folder's path under SRC; the
    steps' seconds at 0.1 µs unless --exact), and their other files byte for byte; reports, plots and traces are left out (cdbench report rebuilds them).

    A packed run is named PACK::RUN_ID wherever cdbench fidelity and cdbench compare take a run folder.

    Examples:
      cdbench pack runs/campaign reports/campaign.pack
      cdbench pack --list reports/campaign.pack
      cdbench fidelity reports/campaign.pack::cell/hybrid-a reports/campaign.pack::cell/model
      cdbench pack --unpack reports/campaign.pack /tmp/campaign
      cdbench pack --repack old.pack new.pack
    """
    with user_errors():
        if list_ + unpack + repack > 1:
            raise ConfigError("give one of --list PACK, --unpack PACK DEST and --repack PACK DEST")
        if list_:
            if dest is not None:
                raise ConfigError(f"--list takes only the pack, not {dest}")
            packed = Pack(src)
            console.print(_listing(packed))
            console.print(f"{len(packed.files())} more files (cdbench pack --unpack writes them out)")
            return
        if dest is None:
            raise ConfigError("give the folder to write: cdbench pack SRC DEST (or --unpack/--repack PACK DEST)")
        if unpack or repack:
            packed = Pack(src)
            with progress_bar(transient=True) as bar:
                task = bar.add_task("repacking" if repack else "unpacking", total=len(packed.run_ids))
                if repack:
                    packed.repack(dest, progress=lambda run_id: bar.advance(task), exact=exact)
                else:
                    packed.unpack(dest, progress=lambda run_id: bar.advance(task))
            console.print(f"repacked {len(packed.run_ids)} runs: {_size(src) / 1e6:.2f} MB -> {_size(dest) / 1e6:.2f} MB"
                          if repack else f"unpacked {len(packed.run_ids)} runs into {dest}")
            return
        if not src.is_dir():
            raise ResultsError(f"{src} is not a folder")
        folders = find_run_folders(src)
        if not folders:
            raise ResultsError(f"{src} holds no run folder (a folder with summary.json and config.yaml)")
        files = _campaign_files(src, list(folders.values())) if all_files else {}
        with progress_bar(transient=True) as bar:
            task = bar.add_task("packing", total=len(folders))
            pack_runs(folders, dest, files=files, progress=lambda run_id: bar.advance(task), exact=exact)
    console.print(f"packed {len(folders)} runs{f' and {len(files)} files' if files else ''} into {dest} "
                  f"({_size(dest) / 1e6:.1f} MB)")
