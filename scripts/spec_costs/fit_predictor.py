"""Fit the shipped spec-cost predictors from ``cdbench profile`` outputs, and tabulate their held-out error.

Command (from the repository root; seconds)::

    .venv/bin/python scripts/spec_costs/fit_predictor.py --data .cache/spec_predictor_data

``--data`` holds one ``cdbench profile`` output folder per corpus (``items.parquet``: each item's compile
status and time per backend; ``tokens.parquet``: every timed fill). Each item becomes a
:class:`~cdbench.harness.costs.spec_predictor.SpecCostRow` per backend: its spec (read back from its
corpus by id), compile outcome and time, and mean fill over its walked instance. The held-out split goes
by source: a corpus file, except for the corpora derived from JSON schemas (regexes and choice lists),
whose items are grouped by the JSONSchemaBench sub-dataset (or BFCL) they were taken from, so that a
regex from a held-out schema collection is held out with it. The default held-out groups are chosen
before looking at any error: JSONSchemaBench's ``Github_hard`` and ``Glaiveai2K`` (schemas, and the
regexes and choice lists taken from them) and the grammar corpus ``gbnf_transformers_cfg``.

Writes ``cdbench/harness/costs/predictors/<backend>__<vocab>.json`` for each backend and a markdown table
(``--table``) of the held-out median and 90th percentile ``|predicted / measured - 1|`` by backend and kind,
beside the error of pricing every held-out spec at its kind's training median (the baseline the
features must beat).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from cdbench.harness.costs.spec_predictor import (
    PREDICTOR_DIR,
    HeldOutError,
    LogLinearFit,
    SpecCostPredictor,
    SpecCostRow,
)
from cdbench.workloads.corpora import CorpusItem, load_corpus

DERIVED_CORPORA = ("regex_from_json_schemas", "choice_from_json_schema_enums")
HELD_OUT_SOURCES = ("Github_hard", "Glaiveai2K")
HELD_OUT_CORPORA = ("jsonschemabench_github_hard", "jsonschemabench_glaiveai2k", "gbnf_transformers_cfg")


def group_of(corpus: str, item: CorpusItem) -> str:
    """The held-out split's group of an item: its corpus, or for a derived corpus ``corpus/<source>``."""
    if corpus not in DERIVED_CORPORA:
        return corpus
    path = item.source.split(":", 1)[1].split("/")
    return f"{corpus}/{path[1] if path[0] == 'data' else 'bfcl'}"


def read_rows(data: Path, vocab: str) -> tuple[dict[str, list[SpecCostRow]], list[str]]:
    """Rows per backend from every profile folder under ``data`` of ``vocab``, and the folders read."""
    rows: dict[str, list[SpecCostRow]] = {}
    folders = []
    for items_path in sorted(data.glob("*/items.parquet")):
        folder = items_path.parent
        config = json.loads((folder / "profile_config.json").read_text(encoding="utf-8"))
        if config["vocab"] != vocab:
            continue
        folders.append(folder.name)
        items = pd.read_parquet(items_path)
        tokens = pd.read_parquet(folder / "tokens.parquet")
        fills = tokens.groupby(["item_id", "backend"], observed=True).fill_us.mean() / 1e6
        specs = {}
        for corpus in items.corpus.unique():
            specs |= {item.id: (corpus, item) for item in load_corpus(corpus).items}
        for r in items.itertuples():
            corpus, item = specs[r.item_id]
            ok = r.status == "ok"
            fill = fills.get((r.item_id, r.backend)) if ok else None
            rows.setdefault(r.backend, []).append(SpecCostRow(
                spec=item.to_spec(), corpus=group_of(corpus, item), status=r.status,
                compile_s=r.compile_ms / 1e3 if ok else None,
                fill_mean_s=None if fill is None or math.isnan(fill) else float(fill),
            ))
    return rows, folders


def held_out_groups(rows: list[SpecCostRow]) -> list[str]:
    """The default held-out groups present in ``rows``."""
    present = {r.corpus for r in rows}
    wanted = set(HELD_OUT_CORPORA) | {f"{c}/{s}" for c in DERIVED_CORPORA for s in HELD_OUT_SOURCES}
    return sorted(present & wanted)


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def _log(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _method(fit: LogLinearFit | None, held_out: HeldOutError) -> str:
    shipped = fit.method if fit is not None else "none"
    return shipped if held_out.method == shipped else f"{shipped} (held-out fit: {held_out.method})"


def table(predictors: dict[str, SpecCostPredictor], baselines: dict[str, SpecCostPredictor]) -> str:
    """The held-out error table (markdown), one line per backend and kind."""
    lines = [
        "| backend | kind | specs (failed) | compile: held-out n | median (p90) | mean abs log | kind median "
        "| model | fill: held-out n | median (p90) | mean abs log | kind median | model |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for backend, predictor in predictors.items():
        for kind, m in predictor.kinds.items():
            base = baselines[backend].kinds[kind]
            cells = [backend, kind, f"{m.specs} ({m.specs - m.statuses.get('ok', 0)})"]
            for fit, held, base_held in ((m.compile, m.held_out_compile, base.held_out_compile),
                                         (m.fill, m.held_out_fill, base.held_out_fill)):
                cells += [str(held.n), f"{_percent(held.median)} ({_percent(held.p90)})", _log(held.mean_abs_log),
                          f"{_percent(base_held.median)}, {_log(base_held.mean_abs_log)}", _method(fit, held)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _host() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="folder of cdbench profile output folders")
    parser.add_argument("--vocab", default="qwen3.6")
    parser.add_argument("--out-dir", type=Path, default=PREDICTOR_DIR)
    parser.add_argument("--table", type=Path, default=Path("reports/spec_costs/heldout_errors.md"))
    args = parser.parse_args(argv)
    rows, folders = read_rows(args.data, args.vocab)
    if not rows:
        parser.error(f"no profile output of vocabulary {args.vocab} under {args.data}")
    predictors, baselines = {}, {}
    for backend, backend_rows in sorted(rows.items()):
        held_out = held_out_groups(backend_rows)
        source = (f"scripts/spec_costs/fit_predictor.py over cdbench profile outputs of {', '.join(folders)} "
                  f"({len(backend_rows)} specs; {datetime.now(UTC):%Y-%m-%d}; {_host()})")
        predictors[backend] = SpecCostPredictor.fit(backend_rows, backend, args.vocab, held_out, source=source)
        baselines[backend] = SpecCostPredictor.fit(backend_rows, backend, args.vocab, held_out,
                                                   min_specs=sys.maxsize)
        path = args.out_dir / f"{backend}__{args.vocab}.json"
        predictors[backend].save(path)
        print(f"wrote {path}")
    held = sorted({g for p in predictors.values() for g in p.held_out_corpora})
    text = (f"Held-out groups: {', '.join(held)}. Errors over the held-out specs of each kind: the median and "
            "90th percentile of |predicted / measured - 1|, and the mean |ln(predicted / measured)| (0.69: a "
            "factor of 2). 'kind median' prices every held-out spec at its kind's training median (median "
            "relative error, mean abs log). 'model': the shipped fit, and the held-out fit's where it differs.\n\n"
            + table(predictors, baselines))
    args.table.parent.mkdir(parents=True, exist_ok=True)
    args.table.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
