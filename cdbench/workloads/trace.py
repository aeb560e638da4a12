"""Replayable JSONL traces of a generated workload (format: ``docs/trace_format.md``).

>>> import io
>>> from cdbench.backends.vocab import load_vocab
>>> from cdbench.workloads.generator import generate
>>> from cdbench.workloads.config import WorkloadConfig
>>> wl = generate(WorkloadConfig(num_requests=3, kinds=["regex"]), load_vocab("cl100k"), progress=False)
>>> text = dumps_trace(wl)
>>> dumps_trace(loads_trace(text).workload) == text
True

A run replays a trace through its workload config (``workload.trace: PATH``):
:func:`cdbench.workloads.generator.generate` then calls :func:`replay`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import UnknownVocabularyError, Vocabulary, load_vocab
from cdbench.workloads.config import WorkloadConfig
from cdbench.workloads.corpora import check_spec
from cdbench.workloads.instances import InstanceFailure
from cdbench.workloads.request import Request, WalkParams
from cdbench.workloads.workload import BadTraceLine, Workload

# 2: requests carry ``random_walk``; the config has ``random_walk`` and ``trace``.
FORMAT_VERSION = 2


class TraceError(ValueError):
    """A trace that cannot be used as a whole: a missing or unreadable header, an unknown
    vocabulary, no loadable request (single bad request lines are skipped instead)."""


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TraceSpec(_Line):
    kind: Literal["json_schema", "regex", "ebnf", "choice", "structural_tag"]
    spec: Any
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _shaped(self) -> TraceSpec:
        check_spec(self.kind, self.spec, self.options.get("dialect"))  # the corpus reader's checks
        return self


class TraceWalk(_Line):
    seed: int
    eos_bias: float = Field(ge=0, le=1)
    max_tokens: int | None = Field(default=None, ge=0)


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
    arrival_s: float = Field(ge=0, allow_inf_nan=False)
    prompt_len: int = Field(ge=0)
    output_len: int = Field(ge=1)
    spec_id: str | None = None
    spec: TraceSpec | None = None
    output_tokens: list[Annotated[int, Field(ge=0)]] | None = None
    instance_index: int | None = Field(default=None, ge=0)
    think_len: int = Field(default=0, ge=0)
    thinking_budget: int | None = Field(default=None, ge=0)
    closed_loop: bool = False
    random_walk: TraceWalk | None = None

    @model_validator(mode="after")
    def _consistent(self) -> TraceRequest:
        if self.spec is None:
            extra = [name for name in ("spec_id", "output_tokens", "instance_index", "random_walk")
                     if getattr(self, name) is not None]
            if extra:
                raise ValueError(f"a plain request (spec null) cannot have {', '.join(extra)}")
        elif not self.spec_id:
            raise ValueError("a structured request needs a non-empty spec_id (it names the spec's compile)")
        if self.output_tokens is not None and self.output_len != len(self.output_tokens):
            raise ValueError(f"output_len {self.output_len} != len(output_tokens) {len(self.output_tokens)}")
        if self.instance_index is not None and self.output_tokens is None:
            raise ValueError("instance_index without output_tokens")
        if self.random_walk is not None and self.output_tokens is not None:
            raise ValueError("random_walk and output_tokens exclude each other (tokens are walked or given)")
        return self


@dataclass
class TraceLoad:
    """A replayed workload and the request lines that did not load (also in ``workload.bad_trace_lines``)."""

    workload: Workload
    skipped: list[BadTraceLine] = field(default_factory=list)

    @property
    def bad_line_count(self) -> int:
        return len(self.skipped)


def _dump(model: BaseModel) -> str:
    return json.dumps(model.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":"))


def dumps_trace(workload: Workload) -> str:
    """The trace text: a header line, then one line per request in order."""
    return "".join(f"{line}\n" for line in trace_lines(workload))


def trace_lines(workload: Workload) -> Iterator[str]:
    """The trace's lines (without line feeds), one at a time: a header line, then one line per request."""
    header = TraceHeader(format_version=FORMAT_VERSION, seed=workload.config.seed, vocab=workload.vocab_name,
                         config=workload.config,
                         failures=[{"spec_id": f.spec_id, "reason": f.reason} for f in workload.failures])
    yield _dump(header)
    for r in workload.iter_requests():
        spec = None if r.spec is None else TraceSpec(kind=r.spec.kind, spec=r.spec.spec, options=dict(r.spec.options))
        walk = None if r.random_walk is None else TraceWalk(
            seed=r.random_walk.seed, eos_bias=r.random_walk.eos_bias, max_tokens=r.random_walk.max_tokens)
        yield _dump(TraceRequest(
            request_id=r.request_id, arrival_s=r.arrival_s, prompt_len=r.prompt_len, output_len=r.output_len,
            spec_id=r.spec_id, spec=spec, output_tokens=None if r.output_tokens is None else list(r.output_tokens),
            instance_index=r.instance_index, think_len=r.think_len, thinking_budget=r.thinking_budget,
            closed_loop=r.closed_loop, random_walk=walk))


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    return f"{first['msg']} at {'.'.join(map(str, first['loc'])) or 'line'}"


def _decode_lines(data: str | bytes) -> list[str | BadTraceLine]:
    """The lines of a trace, split at line feeds only (``str.splitlines`` would also split inside
    JSON strings holding U+2028 or U+0085); with bytes, a line that is not UTF-8 becomes a :class:`BadTraceLine`."""
    out: list[str | BadTraceLine] = []
    if isinstance(data, str):
        out = [line.rstrip("\r") for line in data.split("\n")]
    else:
        for number, raw in enumerate(data.split(b"\n"), start=1):
            try:
                out.append(raw.decode("utf-8").rstrip("\r"))
            except UnicodeDecodeError as exc:
                out.append(BadTraceLine(number, f"invalid UTF-8 at byte {exc.start} of the line"))
    if out and out[-1] == "":
        out.pop()
    return out


def _vocab_size(name: str) -> int:
    try:
        return load_vocab(name).size
    except UnknownVocabularyError as exc:
        raise TraceError(f"line 1: header names an unknown vocabulary: {exc}") from exc


def loads_trace(data: str | bytes) -> TraceLoad:
    """Parse a trace; bad request lines are reported by number and skipped, the rest loads.

    A request line is bad when it does not validate (fields, types, ranges, the
    spec's shape for its kind, ``output_len == len(output_tokens)``, no spec
    fields on a plain request), repeats an earlier ``request_id``, or has a
    token id outside the header's vocabulary.
    """
    lines = _decode_lines(data)
    if not lines or isinstance(lines[0], BadTraceLine):
        raise TraceError("line 1 must be the trace header" + (f" ({lines[0].reason})" if lines else ": empty trace"))
    try:
        header = TraceHeader.model_validate_json(lines[0])
    except ValidationError as exc:
        raise TraceError(f"line 1 is not a valid trace header: {_first_error(exc)}") from exc
    if header.format_version != FORMAT_VERSION:
        raise TraceError(f"trace format_version {header.format_version} is not supported (expected {FORMAT_VERSION})")
    vocab_size = _vocab_size(header.vocab)
    requests: list[Request] = []
    skipped: list[BadTraceLine] = []
    first_line: dict[int, int] = {}
    for number, line in enumerate(lines[1:], start=2):
        if isinstance(line, BadTraceLine):
            skipped.append(line)
            continue
        if not line.strip():
            continue
        try:
            r = TraceRequest.model_validate_json(line)
        except ValidationError as exc:
            skipped.append(BadTraceLine(number, _first_error(exc)))
            continue
        if r.request_id in first_line:
            skipped.append(BadTraceLine(number, f"duplicate request_id {r.request_id} "
                                                f"(first on line {first_line[r.request_id]})"))
            continue
        outside = next((t for t in r.output_tokens or () if t >= vocab_size), None)
        if outside is not None:
            skipped.append(BadTraceLine(number, f"output token {outside} is outside vocabulary "
                                                f"{header.vocab!r} (size {vocab_size})"))
            continue
        first_line[r.request_id] = number
        requests.append(Request(
            request_id=r.request_id, arrival_s=r.arrival_s, prompt_len=r.prompt_len, output_len=r.output_len,
            spec=None if r.spec is None else ConstraintSpec(r.spec.kind, r.spec.spec, r.spec.options),
            spec_id=r.spec_id, output_tokens=None if r.output_tokens is None else tuple(r.output_tokens),
            think_len=r.think_len, thinking_budget=r.thinking_budget, closed_loop=r.closed_loop,
            instance_index=r.instance_index,
            random_walk=None if r.random_walk is None else WalkParams(**r.random_walk.model_dump())))
    requests.sort(key=lambda q: (q.arrival_s, q.request_id))
    failures = [InstanceFailure(f["spec_id"], f["reason"]) for f in header.failures]
    workload = Workload(header.config, header.vocab, requests, failures=failures, bad_trace_lines=list(skipped))
    return TraceLoad(workload, skipped)


def write_trace(workload: Workload, path: str | Path) -> None:
    """Write ``workload`` as a trace file (what a run folder's ``workload.trace.jsonl`` holds), a line at a time."""
    with open(path, "w", encoding="utf-8", newline="") as out:
        for line in trace_lines(workload):
            out.write(f"{line}\n")


def read_trace(path: str | Path) -> TraceLoad:
    return loads_trace(Path(path).read_bytes())


def replay(config: WorkloadConfig, vocab: Vocabulary) -> Workload:
    """The workload of ``config.trace``, for a run on ``vocab``.

    The requests (arrivals, specs, oracle tokens, walk settings) and the config
    are the trace's, except ``spec_decode``, which is ``config``'s: one trace
    can be replayed under several draft settings. ``TraceError`` when the trace
    holds token ids of another vocabulary or no request line loads.
    """
    if config.trace is None:
        raise ValueError("replay needs config.trace")
    load = read_trace(config.trace)
    workload = load.workload
    if workload.vocab_name != vocab.name:
        if any(r.output_tokens is not None for r in workload.requests):
            raise TraceError(f"trace {config.trace} holds token ids of vocabulary {workload.vocab_name!r}; "
                             f"the run uses {vocab.name!r}")
        workload.vocab_name = vocab.name  # lengths only: nothing ties the trace to a vocabulary
    if not workload.requests:
        first = f"; first: {load.skipped[0]}" if load.skipped else ""
        raise TraceError(f"trace {config.trace} has no loadable request line ({load.bad_line_count} bad{first})")
    workload.config = workload.config.model_copy(update={"spec_decode": config.spec_decode})
    workload.trace_path = Path(config.trace)
    return workload
