"""Fit the shipped spec-cost predictors from the spec-cost store, and tabulate their held-out error
(``cdbench fit-predictor``).

Fill the store with the developer corpora first (``cdbench measure-specs``, minutes;
reports/spec_costs/predictor.md lists the corpora and limits), then fit (seconds)::

    cdbench measure-specs --corpus <corpora> --limit <n> --backend xgrammar,llguidance \
        --vocab qwen3.6 --store .cache/spec_store_dev
    cdbench fit-predictor --store .cache/spec_store_dev

The predictor prices what model mode would measure, so it is fitted on what model mode measures: the
store's entries (each spec compiled on a warmed engine without earlier specs' cached work, and walked along
its oracle texts), of this machine's host only, since other hosts' times are on another scale. Each entry
becomes a :class:`~cdbench.harness.costs.spec_predictor.SpecCostRow`: its spec rebuilt from the entry's
canonical text, compile outcome and time, and mean fill (where a text was walked). ``data`` fits on
``cdbench profile`` output folders instead (one per corpus: ``items.parquet``, ``tokens.parquet``), as
the first shipped predictors were; given beside a store, it is only compared with the store, spec by
spec (the fit stays the store's).

The held-out split goes by source: the corpus file an entry's label (its item id) comes from, except for
the corpora derived from JSON schemas (regexes and choice lists), whose items are grouped by the
JSONSchemaBench sub-dataset (or BFCL) they were taken from, so that a regex from a held-out schema
collection is held out with it; a label no known corpus has goes by its id prefix
(:func:`~cdbench.harness.costs.spec_profile.corpus_of`). The default held-out groups were chosen before
looking at any error: JSONSchemaBench's ``Github_hard`` and ``Glaiveai2K`` (schemas, and the regexes and
choice lists taken from them) and the grammar corpus ``gbnf_transformers_cfg``.

:func:`fit_predictors` writes ``<backend>__<vocab>.json`` for each backend (by default into
``cdbench/harness/costs/predictors/``) and returns the markdown text of the held-out median and 90th
percentile ``|predicted / measured - 1|`` by backend and kind, beside the error of pricing every held-out
spec at its kind's training median (the baseline the features must beat).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

from cdbench.backends.base import ConstraintSpec
from cdbench.harness.costs.host import this_host
from cdbench.harness.costs.spec_predictor import (
    HeldOutError,
    LogLinearFit,
    SpecCostPredictor,
    SpecCostRow,
)
from cdbench.harness.costs.spec_profile import corpus_of
from cdbench.harness.costs.spec_store import SpecCostStore
from cdbench.workloads.corpora import CorpusItem, known_corpora, load_corpus


class FitError(ValueError):
    """Nothing to fit on: no store entry or profile output of the vocabulary."""


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


def read_store_rows(store: SpecCostStore, vocab: str, host_id: str) -> dict[str, list[SpecCostRow]]:
    """Rows per backend from the entries of ``store`` of ``vocab`` measured on host ``host_id``."""
    # An entry keeps its item's id, not its corpus: the known corpora's ids give the corpus file (and the
    # source of a derived item) the held-out split goes by. The embedded corpus samples the shared files,
    # so its ids are looked up last: an item belongs to the file it was sampled from.
    items = {}
    for corpus in sorted(known_corpora(), key=lambda name: name == "embedded"):
        for item in load_corpus(corpus).items:
            items.setdefault(item.id, (corpus, item))
    rows: dict[str, list[SpecCostRow]] = {}
    for folder in sorted(p for p in store.root.glob("*/*") if p.is_dir()):
        for entry in store.entries(folder.name):
            if entry.host.id != host_id or entry.vocab != vocab:
                continue
            canonical = json.loads(entry.spec)
            spec = ConstraintSpec(canonical["kind"], canonical["spec"], canonical["options"])
            found = items.get(entry.label)
            group = group_of(*found) if found is not None else corpus_of(entry.label) or entry.label
            ok = entry.status == "ok"
            rows.setdefault(entry.backend, []).append(SpecCostRow(
                spec=spec, corpus=group, status=entry.status, compile_s=entry.costs.compile_s if ok else None,
                fill_mean_s=entry.costs.fill_scale_s if ok and entry.costs.fills else None,
            ))
    return rows


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


def comparison(store_rows: dict[str, list[SpecCostRow]], profile_rows: dict[str, list[SpecCostRow]]) -> str:
    """A markdown table of how the store's measurement of each spec compares with the profile's, per backend
    and kind: the specs both compiled, and the median store / profile ratio of compile time and mean fill."""
    lines = ["| backend | kind | specs in both | compile: store / profile, median (p10-p90) "
             "| mean fill: store / profile, median (p10-p90) |", "| --- | --- | ---: | ---: | ---: |"]
    for backend in sorted(store_rows.keys() & profile_rows.keys()):
        profiled = {r.spec: r for r in profile_rows[backend] if r.status == "ok"}
        pairs = [(r, profiled[r.spec]) for r in store_rows[backend] if r.status == "ok" and r.spec in profiled]
        for kind in sorted({r.kind for r, _ in pairs}):
            cells = [backend, kind, str(sum(r.kind == kind for r, _ in pairs))]
            for target in ("compile_s", "fill_mean_s"):
                ratios = [getattr(a, target) / getattr(b, target) for a, b in pairs
                          if a.kind == kind and getattr(a, target) and getattr(b, target)]
                if ratios:
                    p10, p50, p90 = np.quantile(ratios, [0.1, 0.5, 0.9])
                    cells.append(f"{p50:.2f} ({p10:.2f}-{p90:.2f})")
                else:
                    cells.append("–")
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


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit_predictors` wrote: each backend's predictor file, and the held-out error text."""

    paths: list[Path]
    text: str


def fit_predictors(store: Path | None, data: Path | None, vocab: str, out_dir: Path) -> FitResult:
    """Fit one predictor a backend on ``store``'s entries of this host (or, without a store, on the
    ``cdbench profile`` outputs under ``data``), write them into ``out_dir``, and return the held-out error
    text (with, given both, the store / profile comparison). :class:`FitError` when there is nothing to fit."""
    if store is None and data is None:
        raise FitError("give a spec-cost store (--store) or cdbench profile outputs (--data)")
    if data is not None:
        profile_rows, folders = read_rows(data, vocab)
        if not profile_rows:
            raise FitError(f"no cdbench profile output of vocabulary {vocab} under {data}")
    if store is not None:
        opened = SpecCostStore(store)
        host = this_host(opened.root)
        rows = read_store_rows(opened, vocab, host.id)
        if not rows:
            raise FitError(f"no entry of vocabulary {vocab} measured on this host ({host.id}) in {store}")
        what = f"the spec-cost store {store} (entries of host {host.id}, {host.name})"
    else:
        rows, what = profile_rows, f"cdbench profile outputs of {', '.join(folders)}"
    predictors, baselines, paths = {}, {}, []
    for backend, backend_rows in sorted(rows.items()):
        held_out = held_out_groups(backend_rows)
        source = (f"cdbench fit-predictor over {what} ({len(backend_rows)} specs; "
                  f"{datetime.now(UTC):%Y-%m-%d}; {_host()})")
        predictors[backend] = SpecCostPredictor.fit(backend_rows, backend, vocab, held_out, source=source)
        baselines[backend] = SpecCostPredictor.fit(backend_rows, backend, vocab, held_out, min_specs=sys.maxsize)
        path = Path(out_dir) / f"{backend}__{vocab}.json"
        predictors[backend].save(path)
        paths.append(path)
    held = sorted({g for p in predictors.values() for g in p.held_out_corpora})
    text = (f"Held-out groups: {', '.join(held)}. Errors over the held-out specs of each kind: the median and "
            "90th percentile of |predicted / measured - 1|, and the mean |ln(predicted / measured)| (0.69: a "
            "factor of 2). 'kind median' prices every held-out spec at its kind's training median (median "
            "relative error, mean abs log). 'model': the shipped fit, and the held-out fit's where it differs.\n\n"
            + table(predictors, baselines))
    if store is not None and data is not None:
        text += ("\nThe same specs in the store and in the profile outputs (both compiled): store / profile "
                 "ratios.\n\n" + comparison(rows, profile_rows))
    return FitResult(paths, text)
