"""A generated (or replayed) workload: its requests and what did not make it into them.

:class:`Workload` is what :func:`~cdbench.workloads.generator.generate` and
:func:`~cdbench.workloads.trace.replay` return; :class:`WorkloadReport` is its
account of lost items, saved with every run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from cdbench.backends.vocab import Vocabulary
from cdbench.workloads.config import WorkloadConfig
from cdbench.workloads.corpora import SkippedLine
from cdbench.workloads.drafts import DraftSource
from cdbench.workloads.instances import InstanceFailure, InstancePool
from cdbench.workloads.request import Request


@dataclass(frozen=True)
class BadTraceLine:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpecFailureRecord(_Record):
    spec_id: str
    reason: str


class SkippedLineRecord(_Record):
    path: str
    line: int
    reason: str


class BadTraceLineRecord(_Record):
    line: int
    reason: str


class WorkloadReport(_Record):
    """What a run reports about its workload besides the requests (``Workload.report()``).

    Counts first, then the entries: specs with no valid instance, corpus lines
    that did not load, trace lines that did not load (replays), and corpus ids
    dropped because an earlier item has the same spec (id → kept id).
    """

    requests: int
    structured_requests: int
    distinct_specs: int
    replayed_from: str | None
    spec_failure_count: int
    skipped_line_count: int
    bad_trace_line_count: int
    duplicate_spec_count: int
    spec_failures: list[SpecFailureRecord]
    skipped_lines: list[SkippedLineRecord]
    bad_trace_lines: list[BadTraceLineRecord]
    duplicate_specs: dict[str, str]


@dataclass
class Workload:
    """Requests sorted by arrival, with what the run needs besides them.

    ``pools`` maps each structured request's ``spec_id`` to its instance pool
    (oracle source only); ``failures`` lists specs with no valid instance (not
    used); ``skipped_lines`` the corpus lines that did not load;
    ``duplicate_specs`` the corpus ids dropped as repeats of an earlier item's
    spec (id → kept id). A replayed workload has ``trace_path`` and the trace
    lines that did not load in ``bad_trace_lines``.
    """

    config: WorkloadConfig
    vocab_name: str
    requests: list[Request]
    pools: dict[str, InstancePool] = field(default_factory=dict)
    failures: list[InstanceFailure] = field(default_factory=list)
    skipped_lines: list[SkippedLine] = field(default_factory=list)
    library_ids: list[str] = field(default_factory=list)
    duplicate_specs: dict[str, str] = field(default_factory=dict)
    bad_trace_lines: list[BadTraceLine] = field(default_factory=list)
    trace_path: Path | None = None
    rebuild: Callable[[], Iterable[Request]] | None = None
    """Builds the same requests again, a request at a time (a generated workload: its seeded streams)."""
    streamed: bool = False
    """No request is held: :attr:`rebuild` builds them each time they are read (``generate(..., held=False)``);
    the first :meth:`iter_requests` read to its end gives the workload its counts and its specs without a
    valid instance (``failures``)."""
    _counts: tuple[int, int, int] | None = None  # (requests, structured, distinct specs) of a streamed one

    def _surveying(self, stream: Iterable[Request]) -> Iterator[Request]:
        """``stream``'s requests; once it is read to its end, its counts (``counts``: requests, structured
        requests, distinct spec ids) and ``failures`` are the workload's."""
        yield from stream
        self._counts = stream.counts  # type: ignore[attr-defined]
        self.failures = list(stream.failures)  # type: ignore[attr-defined]

    def iter_requests(self) -> Iterator[Request]:
        """The requests in order: those held, or, when not held, built again."""
        if not self.streamed:
            return iter(self.requests)
        if self._counts is None:  # a streamed workload read for the first time
            return self._surveying(self.rebuild())
        return iter(self.rebuild())

    @property
    def max_concurrency(self) -> int | None:
        return self.config.max_concurrency

    @property
    def failure_count(self) -> int:
        return len(self.failures)

    @property
    def skipped_line_count(self) -> int:
        return len(self.skipped_lines)

    @property
    def bad_trace_line_count(self) -> int:
        return len(self.bad_trace_lines)

    def draft_source(self, vocab: Vocabulary) -> DraftSource:
        """Drafts at the config's acceptance rate, seeded by the config."""
        return DraftSource(self.config.spec_decode.alpha, vocab, self.config.seed, self.pools)

    def report(self) -> WorkloadReport:
        """Counts and entries of everything that did not make it into the requests (for the run's summary)."""
        if self.streamed and self._counts is None:
            raise ValueError("a workload not held knows its counts once its requests were read to the end")
        requests, structured, distinct = self._counts if self._counts is not None else _counts(self.requests)
        return WorkloadReport(
            requests=requests,
            structured_requests=structured,
            distinct_specs=distinct,
            replayed_from=None if self.trace_path is None else str(self.trace_path),
            spec_failure_count=self.failure_count,
            skipped_line_count=self.skipped_line_count,
            bad_trace_line_count=self.bad_trace_line_count,
            duplicate_spec_count=len(self.duplicate_specs),
            spec_failures=[SpecFailureRecord(spec_id=f.spec_id, reason=f.reason) for f in self.failures],
            skipped_lines=[SkippedLineRecord(path=s.path, line=s.line, reason=s.reason) for s in self.skipped_lines],
            bad_trace_lines=[BadTraceLineRecord(line=b.line, reason=b.reason) for b in self.bad_trace_lines],
            duplicate_specs=dict(self.duplicate_specs),
        )


def _counts(requests: list[Request]) -> tuple[int, int, int]:
    """Requests, structured requests and distinct specs (by id) of ``requests``."""
    return (len(requests), sum(r.spec is not None for r in requests),
            len({r.spec_id for r in requests if r.spec is not None}))
