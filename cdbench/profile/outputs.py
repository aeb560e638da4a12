"""Turn ``cdbench profile`` results into its output files.

- ``items.parquet``: one row per item × backend (status, compile time, correctness counts);
- ``tokens.parquet``: every timed token, raw (no sketch): fill, accept, rollback µs and
  the number of forced (jump-forward) tokens at that step, counted by each backend's own
  rule (:data:`cdbench.reports.profile_report.FORCED_TOKEN_RULES`), so the counts do not
  compare across backends;
- ``profile_<backend>.parquet``: a :class:`~cdbench.harness.costs.grammar_profile.GrammarProfile`
  built from these measurements, the input of ``model`` mode, in the compressed file format of
  the shipped profiles;
- ``report.md`` and PNG plots (:mod:`cdbench.reports.profile_report`).
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd

from cdbench.backends.measure_worker import ItemResult
from cdbench.harness.costs.grammar_profile import (
    CompileMeasurement,
    GrammarProfile,
    WalkMeasurement,
)

ENGINE_DISTRIBUTIONS = ("xgrammar", "llguidance", "outlines-core")


def items_frame(results: Sequence[ItemResult]) -> pd.DataFrame:
    """One row per result, without the per-token lists."""
    rows = [
        {
            "corpus": r.corpus,
            "item_id": r.item_id,
            "kind": r.kind,
            "backend": r.backend,
            "status": r.status,
            "message": r.message,
            "compile_ms": r.compile_ms,
            "n_warnings": len(r.warnings),
            "warnings": "; ".join(r.warnings),
            "instance_failure": r.instance_failure,
            "n_valid": r.n_valid,
            "false_rejects": r.false_rejects,
            "first_reject_position": r.first_reject_position,
            "first_reject_text": r.first_reject_text,
            "n_invalid": r.n_invalid,
            "false_accepts": r.false_accepts,
            "false_accept_labels": ",".join(r.false_accept_labels),
            "walk_error": r.walk_error,
            "n_tokens": len(r.tokens.fill_us),
        }
        for r in results
    ]
    frame = pd.DataFrame(rows, columns=list(rows[0]) if rows else None)
    if len(frame):
        frame["compile_ms"] = frame.compile_ms.astype(float)
        frame["first_reject_position"] = frame.first_reject_position.astype("Int64")
    return frame


def tokens_frame(results: Sequence[ItemResult]) -> pd.DataFrame:
    """One row per timed token of every result."""
    parts = []
    for r in results:
        t = r.tokens
        if not t.fill_us:
            continue
        n = len(t.fill_us)
        parts.append(
            pd.DataFrame(
                {
                    "corpus": [r.corpus] * n,
                    "item_id": [r.item_id] * n,
                    "kind": [r.kind] * n,
                    "backend": [r.backend] * n,
                    "instance": np.asarray(t.instance, dtype=np.int32),
                    "position": np.asarray(t.position, dtype=np.int32),
                    "fill_us": np.asarray(t.fill_us, dtype=float),
                    "accept_us": np.asarray(t.accept_us, dtype=float),
                    "rollback_us": np.asarray([np.nan if v is None else v for v in t.rollback_us], dtype=float),
                    "forced_tokens": np.asarray(t.forced_tokens, dtype=np.int32),
                }
            )
        )
    columns = ["corpus", "item_id", "kind", "backend", "instance", "position",
               "fill_us", "accept_us", "rollback_us", "forced_tokens"]
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)
    for column in ("corpus", "item_id", "kind", "backend"):
        frame[column] = frame[column].astype("category")
    return frame


def _versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for dist in ENGINE_DISTRIBUTIONS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    versions["cpus"] = str(os.cpu_count())
    return versions


def backend_profiles(results: Sequence[ItemResult], vocab: str, source: str) -> dict[str, GrammarProfile]:
    """One :class:`GrammarProfile` per backend from the item results (spec id = item id)."""
    by_backend: dict[str, list[ItemResult]] = {}
    for r in results:
        by_backend.setdefault(r.backend, []).append(r)
    profiles = {}
    for backend, rows in sorted(by_backend.items()):
        compiles = [
            CompileMeasurement(r.item_id, r.kind, r.status, None if r.compile_ms is None else r.compile_ms / 1e3)
            for r in rows
        ]
        walks = [
            WalkMeasurement(
                r.item_id,
                r.kind,
                fill_s=np.asarray(r.tokens.fill_us) / 1e6,
                accept_s=np.asarray(r.tokens.accept_us) / 1e6,
                rollback_s=np.asarray([v for v in r.tokens.rollback_us if v is not None], dtype=float) / 1e6,
                forced_tokens=np.asarray(r.tokens.forced_tokens, dtype=np.int64),
            )
            for r in rows
            if r.tokens.fill_us
        ]
        profiles[backend] = GrammarProfile.from_measurements(backend, vocab, compiles, walks, source)
    return profiles


def _input_notes(items: pd.DataFrame, skipped: Sequence[str]) -> list[str]:
    notes = []
    if skipped:
        notes.append(f"{len(skipped)} corpus line(s) skipped: " + "; ".join(skipped[:3]) + ("; …" if len(skipped) > 3 else ""))
    if len(items):
        failures = items.drop_duplicates(["corpus", "item_id"])
        failures = failures[failures.instance_failure != ""]
        if len(failures):
            top = failures.instance_failure.str.slice(0, 100).value_counts().head(3)
            notes.append(
                f"{len(failures)} item(s) without an oracle instance (compiled, not walked); most frequent reasons: "
                + "; ".join(f"{count} × {reason}" for reason, count in top.items())
            )
    return notes


def write_outputs(
    results: Sequence[ItemResult],
    config,
    out_dir: str | Path,
    command: str | None = None,
    skipped: Sequence[str] = (),
) -> list[Path]:
    """Write parquet tables, per-backend profiles and the report; returns the paths.

    ``skipped`` lists the corpus lines that could not be read; the report counts them.
    """
    from cdbench.reports.profile_report import ProfileReportInfo, write_report

    out_dir = Path(out_dir)
    command = command if command is not None else shlex.join(["cdbench", *sys.argv[1:]])
    versions = _versions()
    items, tokens = items_frame(results), tokens_frame(results)
    items_path, tokens_path = out_dir / "items.parquet", out_dir / "tokens.parquet"
    # zstd: per-token timings are most of a profile's bytes, and results are committed as evidence
    items.to_parquet(items_path, index=False, compression="zstd")
    tokens.to_parquet(tokens_path, index=False, compression="zstd")
    files = [items_path, tokens_path]
    source = f"{command} ({datetime.now(timezone.utc):%Y-%m-%d}; " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ")"
    for backend, profile in backend_profiles(results, config.vocab, source).items():
        path = out_dir / f"profile_{backend}.parquet"
        profile.save(path)
        files.append(path)
    info = ProfileReportInfo(
        command=command,
        settings={
            "vocab": config.vocab,
            "limit per corpus": config.limit,
            "seed": config.seed,
            "compile timeout s": config.compile_timeout_s,
            "walk timeout s": config.walk_timeout_s,
            "valid instances per item": config.valid_instances,
            "invalid instances per item": config.invalid_instances,
            "workers": config.workers,
            "worker memory": config.worker_memory.human_readable(decimal=True),
        },
        versions=versions,
        notes=[
            "TBM = first mask fill after each token of the oracle instances (repeat fills are not timed: "
            "llguidance caches masks per state); tokens.parquet holds every timed token, raw.",
            "TTFM = cold compile of the items that compiled (timeouts, crashes and ooms are not in it; "
            "they are counted in their own columns: a compile timeout was killed before its compile "
            "ended, a walk timeout compiled and was killed walking its instances, an oom ran out of "
            "its worker's memory cap). llguidance builds its lexer lazily, so part of "
            "its compile cost shows up in the first fills (TBM), not in TTFM.",
            "Empirical coverage needs an oracle instance: items the instance generator could not serve "
            "count as not covered for every backend.",
            f"Worker processes: {config.workers} on {os.cpu_count()} CPUs; times are wall-clock "
            "(perf_counter_ns) with GC paused during walks, so they include any CPU contention "
            "from other work on the machine.",
            *_input_notes(items, skipped),
        ],
    )
    files += write_report(items, tokens, out_dir, info)
    return files
