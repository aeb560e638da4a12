"""Spans of the simulated timeline (``cdbench.results.chrome_trace`` writes them as a Chrome / Perfetto trace).

Tracks: ``scheduler`` (the scheduler thread's CPU work), ``gpu`` (the GPU
stream), and ``rank<r>/compile<t>`` (compile-pool thread ``t`` of rank ``r``).

>>> tl = Timeline(max_steps=10)
>>> tl.span("gpu", "forward", 0.0, 0.01)
>>> tl.spans[0].duration_s
0.01
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Span:
    track: str
    name: str
    start_s: float
    duration_s: float
    args: dict | None = None


@dataclass
class Timeline:
    """Spans of the first ``max_steps`` iterations (0 records nothing), and of compiles started meanwhile."""

    max_steps: int = 2000
    spans: list[Span] = field(default_factory=list)
    steps_seen: int = 0

    @property
    def recording(self) -> bool:
        return self.steps_seen < self.max_steps

    def span(self, track: str, name: str, start_s: float, duration_s: float, args: dict | None = None) -> None:
        if duration_s > 0:
            self.spans.append(Span(track, name, start_s, duration_s, args))
