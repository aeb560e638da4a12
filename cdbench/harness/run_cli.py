"""``cdbench run``: one configured run into a results folder, with a summary table.

The run options here (``--backend``, ``--policy``, ...) are shared with
``cdbench compare``: each sets one dotted path of the run configuration
(:data:`RUN_OPTION_PATHS`) on top of the config file.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from cdbench.harness.cli import app
from cdbench.harness.cli_support import console, progress_bar, user_errors
from cdbench.harness.config_io import apply_overrides, builtin_config_path, read_yaml_mapping
from cdbench.harness.results import SavedRun, record_run, validate_run_config
from cdbench.reports.tables import console_sections, to_rich

RUN_OPTION_PATHS: dict[str, str] = {
    "backend": "backend.name",
    "policy": "policy.name",
    "mode": "mode",
    "model": "costs.model",
    "gpu": "costs.gpu",
    "corpus": "workload.corpus",
    "requests": "workload.num_requests",
    "rate": "workload.rate",
    "seed": "seed",
}
"""Command-line option → the configuration path it sets."""

ConfigArg = Annotated[
    Path | None, typer.Argument(help="Run-config YAML; without it the built-in default (cdbench/configs/default.yaml).")
]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="Grammar backend: xgrammar, llguidance, outlines, none.")]
PolicyOpt = Annotated[str | None, typer.Option("--policy", help="Scheduler policy preset: sglang or vllm.")]
ModeOpt = Annotated[str | None, typer.Option("--mode", help="model (profiled grammar costs) or hybrid (real backend).")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Model for the cost model, e.g. qwen3-8b, or a spec file.")]
GpuOpt = Annotated[str | None, typer.Option("--gpu", help="GPU for the cost model, e.g. H100, or a spec file.")]
CorpusOpt = Annotated[str | None, typer.Option("--corpus", help="Workload corpus, e.g. embedded.")]
RequestsOpt = Annotated[int | None, typer.Option("--requests", "-n", help="Number of requests.")]
RateOpt = Annotated[float | None, typer.Option("--rate", help="Arrival rate (requests per second).")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Seed of every random choice.")]
SetOpt = Annotated[
    list[str], typer.Option("--set", "-s", help="Any config path: --set scheduler.poll_interval_s=0.001 (repeatable).")
]


def parse_set_options(items: list[str]) -> dict[str, Any]:
    """``path=value`` strings to overrides; values are parsed as YAML (numbers, booleans, lists)."""
    import yaml

    from cdbench.harness.config_io import ConfigError

    out: dict[str, Any] = {}
    for item in items:
        path, sep, raw = item.partition("=")
        if not sep or not path.strip():
            raise ConfigError(f"--set {item!r} is not PATH=VALUE (e.g. scheduler.overlap=false)")
        try:
            out[path.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ConfigError(f"--set {item!r}: {raw!r} is not a valid value") from None
    return out


def load_run_tree(config: Path | None, options: dict[str, Any], sets: list[str]) -> tuple[dict[str, Any], str]:
    """The configuration mapping: the file (or built-in default), then options, then ``--set`` values."""
    path = config if config is not None else builtin_config_path("default")
    source = str(config) if config is not None else "built-in default config"
    tree = read_yaml_mapping(path)
    tree = apply_overrides(tree, {RUN_OPTION_PATHS[k]: v for k, v in options.items()})
    tree = apply_overrides(tree, parse_set_options(sets))
    return tree, source


def default_out_dir(prefix: str = "") -> Path:
    """``runs/<prefix><UTC timestamp>``, unique to the second."""
    return Path("runs") / f"{prefix}{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


def execute(tree: dict[str, Any], source: str, out: Path, description: str = "simulating") -> SavedRun:
    """Validate, run with a progress bar, save and report; user mistakes become one-line errors."""
    with user_errors(out / "run.log"):
        run_config = validate_run_config(tree, source)
        with progress_bar() as bar:
            task = bar.add_task(description, total=100)
            saved = record_run(run_config, out, progress=lambda f: bar.update(task, completed=100 * f))
            bar.update(task, completed=100)
    return saved


@app.command("run")
def run_command(
    config: ConfigArg = None,
    backend: BackendOpt = None,
    policy: PolicyOpt = None,
    mode: ModeOpt = None,
    model: ModelOpt = None,
    gpu: GpuOpt = None,
    corpus: CorpusOpt = None,
    requests: RequestsOpt = None,
    rate: RateOpt = None,
    seed: SeedOpt = None,
    set_: SetOpt = [],  # noqa: B006 (typer reads the default, it is never mutated)
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Results folder (default runs/<timestamp>).")] = None,
) -> None:
    """Run one simulation and write its results folder (config, parquet tables, summary, report, plots, trace).

    Options override the config file. With no arguments: the built-in default (hybrid mode, xgrammar,
    sglang policy, Qwen3-8B on an H100, the embedded sample workload).

    Example: cdbench run --backend llguidance --policy vllm --rate 20 --out runs/llg
    """
    options = dict(backend=backend, policy=policy, mode=mode, model=model, gpu=gpu, corpus=corpus,
                   requests=requests, rate=rate, seed=seed)
    with user_errors():
        tree, source = load_run_tree(config, options, set_)
    out = out or default_out_dir()
    saved = execute(tree, source, out)
    for section in console_sections(saved.summary):
        console.print(to_rich(section))
    console.print(f"results: {out}/  (report: {out / 'report.md'}, trace: {out / 'trace.json'} for ui.perfetto.dev)")
