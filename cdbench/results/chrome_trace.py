"""Write a scheduler timeline as a Chrome / Perfetto trace.

The output is the Trace Event Format's JSON object form: ``traceEvents`` holds
one complete event (``ph: "X"``, microseconds) per span, plus ``process_name``
and ``thread_name`` metadata events so the UI shows named tracks. Open the file
at https://ui.perfetto.dev or chrome://tracing.

A span's ``track`` names its process and thread as ``"process/thread"``
(``"rank0/compile3"``: thread ``compile3`` of process ``rank0``); a track with
no slash is a process with a single thread of the same name. The scheduler's
timeline spans (:class:`cdbench.harness.timeline.Span`) fit as they are.

Examples
--------
>>> from cdbench.results.chrome_trace import TraceSpan, chrome_trace
>>> trace = chrome_trace([TraceSpan("scheduler", "step 0", 0.0, 0.004)])
>>> [e["ph"] for e in trace.events]
['M', 'M', 'M', 'X']
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class Span(Protocol):
    """What the trace writer needs from a timeline span (virtual seconds)."""

    track: str
    name: str
    start_s: float
    duration_s: float


@dataclass(frozen=True, slots=True)
class TraceSpan:
    """A plain span, for callers that have no span type of their own."""

    track: str
    name: str
    start_s: float
    duration_s: float
    args: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ChromeTrace:
    """A built trace: its events and how many spans were left out by the cap."""

    events: list[dict[str, Any]]
    spans_written: int
    spans_dropped: int
    cut_at_s: float | None  # spans starting at or after this virtual time were dropped
    recorded_note: str = ""  # what the recorder itself left out (e.g. only the first N iterations)

    def to_json(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"spans_written": self.spans_written, "spans_dropped": self.spans_dropped}
        notes = [self.recorded_note] if self.recorded_note else []
        if self.cut_at_s is not None:
            notes.append(f"spans starting at or after {self.cut_at_s:.6f} s of virtual time were left out")
        if notes:
            meta["note"] = "trace capped: " + "; ".join(notes)
        return {"traceEvents": self.events, "displayTimeUnit": "ms", "otherData": meta}

    def write(self, path: Path) -> None:
        # Compact separators: traces of big runs are mostly punctuation otherwise.
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")))


def _split_track(track: str) -> tuple[str, str]:
    process, sep, thread = track.partition("/")
    return (process, thread) if sep else (track, track)


def chrome_trace(spans: Iterable[Span], max_spans: int | None = 200_000, recorded_note: str = "") -> ChromeTrace:
    """Build a trace from ``spans``, keeping the earliest ``max_spans`` of them.

    Capping by start time keeps a complete prefix of the run (the first N steps
    on every track) rather than a random thinning, so what is shown is exact.
    """
    ordered = sorted(spans, key=lambda s: (s.start_s, s.track))
    kept = ordered if max_spans is None else ordered[:max_spans]
    cut_at = ordered[len(kept)].start_s if len(kept) < len(ordered) else None

    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    meta: list[dict[str, Any]] = []
    body: list[dict[str, Any]] = []
    for span in kept:
        process, thread = _split_track(span.track)
        if process not in pids:
            pids[process] = len(pids) + 1
            meta.append({"ph": "M", "name": "process_name", "pid": pids[process], "tid": 0, "args": {"name": process}})
            meta.append({"ph": "M", "name": "process_sort_index", "pid": pids[process], "tid": 0,
                         "args": {"sort_index": pids[process]}})
        key = (process, thread)
        if key not in tids:
            tids[key] = len(tids) + 1
            meta.append({"ph": "M", "name": "thread_name", "pid": pids[process], "tid": tids[key], "args": {"name": thread}})
        event: dict[str, Any] = {
            "name": span.name,
            "cat": process,
            "ph": "X",
            "ts": round(span.start_s * 1e6, 3),
            "dur": round(max(span.duration_s, 0.0) * 1e6, 3),
            "pid": pids[process],
            "tid": tids[key],
        }
        args = getattr(span, "args", None)
        if args:
            event["args"] = dict(args)
        body.append(event)
    return ChromeTrace(meta + body, len(kept), len(ordered) - len(kept), cut_at, recorded_note)
