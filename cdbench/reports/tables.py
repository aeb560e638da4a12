"""Summary tables: a run's ``summary.json`` arranged for reading, as markdown or rich tables.

The summary is flat (vLLM's serving-benchmark names: ``mean_ttft_ms``,
``p99_tpot_ms``, ``request_throughput``, ...). :func:`summary_sections` groups
it into a latency grid (metric × statistic), throughput, and everything else
by topic, without needing to know every field in advance.

Examples
--------
>>> sections = summary_sections({"mean_ttft_ms": 12.5, "p99_ttft_ms": 40.0, "request_throughput": 3.2})
>>> [s.title for s in sections]
['Latency (ms)', 'Throughput']
>>> print(to_markdown(sections[0]))
| metric | mean | p99 |
| --- | --- | --- |
| TTFT | 12.5 | 40 |
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rich.table import Table

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
_LATENCY_FIELD = re.compile(r"^(mean|median|std|p\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")
_TOPICS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("Throughput", re.compile(r"throughput|goodput|^completed$|^duration|^total_(input|output)_tokens$|^num_")),
    ("KV cache", re.compile(r"^kv_|_kv_")),
    ("Grammar compile and wait", re.compile(r"compile|wait|cache|poll|inflight")),
    ("Aborts and failures", re.compile(r"abort|timeout|fail|error")),
    ("Step time: host CPU beside the GPU", re.compile(r"^host_|^gpu_share$|contention|contended")),
    ("Masks and overlap", re.compile(r"mask|fill|apply|copy|overlap|hidden|exposed|share")),
    ("Speculative decoding, jump-forward, validity", re.compile(r"draft|rollback|rolled|accept|jump|valid")),
    ("Ranks", re.compile(r"rank|skew")),
)


@dataclass(frozen=True, slots=True)
class Section:
    """A titled table: a header row and rows of cells (numbers or text)."""

    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[object, ...], ...]


def format_value(value: object) -> str:
    """Numbers to four significant digits (integers whole); ``None``/NaN as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.3g}"
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.4e}"
    return str(value)


def _stat_order(stat: str) -> tuple[int, float]:
    fixed = {"mean": 0, "median": 1, "std": 3}
    return (fixed[stat], 0.0) if stat in fixed else (2, float(stat[1:]))


def summary_sections(summary: Mapping[str, object]) -> list[Section]:
    """Group a flat summary into sections; empty sections are left out."""
    latency: dict[str, dict[str, object]] = {}
    leftover: dict[str, object] = {}
    flat: dict[str, object] = {}
    for key, value in summary.items():
        if key == "workload_issues":
            continue  # not a measurement: the run report gives it a section of its own
        if isinstance(value, Mapping):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    for key, value in flat.items():
        match = _LATENCY_FIELD.match(key)
        if match:
            latency.setdefault(match.group(2), {})[match.group(1)] = value
        elif isinstance(value, int | float | str | bool) or value is None:
            leftover[key] = value
    sections: list[Section] = []
    if latency:
        stats = sorted({s for per in latency.values() for s in per}, key=_stat_order)
        rows = tuple(
            (name.upper(), *(latency[name].get(s) for s in stats)) for name in LATENCY_METRICS if name in latency
        )
        sections.append(Section("Latency (ms)", ("metric", *stats), rows))
    for title, pattern in _TOPICS:
        taken = {k: v for k, v in leftover.items() if pattern.search(k)}
        if taken:
            sections.append(Section(title, ("metric", "value"), tuple(taken.items())))
            for key in taken:
                del leftover[key]
    if leftover:
        sections.append(Section("Other", ("metric", "value"), tuple(leftover.items())))
    return sections


def to_markdown(section: Section) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(section.header) + " |", "| " + " | ".join("---" for _ in section.header) + " |"]
    lines += ["| " + " | ".join(format_value(c) for c in row) + " |" for row in section.rows]
    return "\n".join(lines)


HEADLINE = ("completed", "failed", "request_throughput", "output_throughput", "request_goodput",
            "mean_grammar_wait_ms", "p99_grammar_wait_ms", "mean_compile_ms", "cache_hit_rate", "rollback_rate",
            "validity_rate", "mask_share", "mask_row_p99_us", "cpu_hidden_by_overlap_s", "mean_rank_skew_ms",
            "host_schedule_share", "host_grammar_share", "host_transfer_share", "host_process_share", "gpu_share",
            "kv_capacity_tokens", "kv_preemptions", "kv_retractions", "kv_recomputed_tokens", "kv_peak_utilization",
            "mean_kv_wait_ms")
"""Fields shown in the console summary after the latency grid (the report has them all)."""


def console_sections(summary: Mapping[str, object]) -> list[Section]:
    """The console summary: the latency grid and one table of :data:`HEADLINE` fields present in ``summary``."""
    sections = [s for s in summary_sections(summary) if s.title == "Latency (ms)"]
    rows = tuple((k, summary[k]) for k in HEADLINE if k in summary)
    if rows:
        sections.append(Section("Throughput and grammar", ("metric", "value"), rows))
    return sections


def to_rich(section: Section) -> Table:
    """A rich table for the console; numeric columns right-aligned."""
    table = Table(title=section.title, title_justify="left", min_width=len(section.title))
    widest = max((len(str(row[0])) for row in section.rows), default=6)
    for i, name in enumerate(section.header):
        if i == 0:
            table.add_column(name, no_wrap=True, min_width=widest)
        else:
            table.add_column(name, justify="right")
    for row in section.rows:
        table.add_row(*(format_value(c) for c in row))
    return table


def frame_to_markdown(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Markdown for any header and rows (used by comparisons and sweeps)."""
    return to_markdown(Section("", tuple(header), tuple(tuple(r) for r in rows)))
