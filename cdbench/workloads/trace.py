"""Replayable JSONL traces of a generated workload (format: ``docs/trace_format.md``).

>>> import io
>>> from cdbench.backends.vocab import load_vocab
>>> from cdbench.workloads.generator import generate
>>> from cdbench.workloads.config import WorkloadConfig
>>> wl = generate(WorkloadConfig(num_requests=3, kinds=["regex"]), load_vocab("cl100k"), progress=False)
>>> text = dumps_trace(wl)
>>> dumps_trace(loads_trace(text).workload) == text
True
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cdbench.backends.base import ConstraintSpec
from cdbench.workloads.config import WorkloadConfig
from cdbench.workloads.generator import Workload
from cdbench.workloads.instances import InstanceFailure
from cdbench.workloads.request import Request

FORMAT_VERSION = 1


class TraceError(ValueError):
    """A trace whose header is missing or unreadable (request lines are skipped instead)."""


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TraceSpec(_Line):
    kind: Literal["json_schema", "regex", "ebnf", "choice", "structural_tag"]
    spec: Any
    options: dict[str, Any] = Field(default_factory=dict)


class TraceHeader(_Line):
    type: Literal["header"] = "header"
    format_version: int
    seed: int
    vocab: str
    config: WorkloadConfig
    failures: list[dict[str, str]] = Field(default_factory=list)


class TraceRequest(_Line):
    type: Literal["request"] = "request"
    request_id: int = Field(ge=0)
    arrival_s: float = Field(ge=0)
    prompt_len: int = Field(ge=0)
    output_len: int = Field(ge=1)
    spec_id: str | None = None
    spec: TraceSpec | None = None
    output_tokens: list[int] | None = None
    instance_index: int | None = None
    think_len: int = Field(default=0, ge=0)
    thinking_budget: int | None = None
    closed_loop: bool = False


@dataclass(frozen=True)
class BadTraceLine:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclass
class TraceLoad:
    """A replayed workload and the request lines that did not load."""

    workload: Workload
    skipped: list[BadTraceLine] = field(default_factory=list)


def _dump(model: BaseModel) -> str:
    return json.dumps(model.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":"))


def dumps_trace(workload: Workload) -> str:
    """The trace text: a header line, then one line per request in order."""
    header = TraceHeader(format_version=FORMAT_VERSION, seed=workload.config.seed, vocab=workload.vocab_name,
                         config=workload.config,
                         failures=[{"spec_id": f.spec_id, "reason": f.reason} for f in workload.failures])
    lines = [_dump(header)]
    for r in workload.requests:
        spec = None if r.spec is None else TraceSpec(kind=r.spec.kind, spec=r.spec.spec, options=dict(r.spec.options))
        lines.append(_dump(TraceRequest(
            request_id=r.request_id, arrival_s=r.arrival_s, prompt_len=r.prompt_len, output_len=r.output_len,
            spec_id=r.spec_id, spec=spec, output_tokens=None if r.output_tokens is None else list(r.output_tokens),
            instance_index=r.instance_index, think_len=r.think_len, thinking_budget=r.thinking_budget,
            closed_loop=r.closed_loop)))
    return "\n".join(lines) + "\n"


def loads_trace(text: str) -> TraceLoad:
    """Parse trace text; bad request lines are reported by number and skipped."""
    lines = text.splitlines()
    if not lines:
        raise TraceError("empty trace: the first line must be the header")
    try:
        header = TraceHeader.model_validate_json(lines[0])
    except ValidationError as exc:
        raise TraceError(f"line 1 is not a valid trace header: {exc.errors()[0]['msg']} at "
                         f"{'.'.join(map(str, exc.errors()[0]['loc']))}") from exc
    if header.format_version != FORMAT_VERSION:
        raise TraceError(f"trace format_version {header.format_version} is not supported (expected {FORMAT_VERSION})")
    requests: list[Request] = []
    skipped: list[BadTraceLine] = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            r = TraceRequest.model_validate_json(line)
        except ValidationError as exc:
            first = exc.errors()[0]
            skipped.append(BadTraceLine(number, f"{first['msg']} at {'.'.join(map(str, first['loc'])) or 'line'}"))
            continue
        requests.append(Request(
            request_id=r.request_id, arrival_s=r.arrival_s, prompt_len=r.prompt_len, output_len=r.output_len,
            spec=None if r.spec is None else ConstraintSpec(r.spec.kind, r.spec.spec, r.spec.options),
            spec_id=r.spec_id, output_tokens=None if r.output_tokens is None else tuple(r.output_tokens),
            think_len=r.think_len, thinking_budget=r.thinking_budget, closed_loop=r.closed_loop,
            instance_index=r.instance_index))
    requests.sort(key=lambda q: (q.arrival_s, q.request_id))
    failures = [InstanceFailure(f["spec_id"], f["reason"]) for f in header.failures]
    return TraceLoad(Workload(header.config, header.vocab, requests, failures=failures), skipped)


def write_trace(workload: Workload, path: str | Path) -> None:
    Path(path).write_text(dumps_trace(workload), encoding="utf-8")


def read_trace(path: str | Path) -> TraceLoad:
    return loads_trace(Path(path).read_text(encoding="utf-8"))
