"""Spans of the simulated timeline (``cdbench.results.chrome_trace`` writes them as a Chrome / Perfetto trace).

Tracks: ``scheduler`` (the scheduler thread's CPU work), ``gpu`` (the GPU
stream), ``kv cache`` (each step's KV slots in use, and its preemptions or
retractions) and ``rank<r>/compile<t>`` (compile-pool thread ``t`` of rank ``r``).

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

    def compile_spans(self, name: str, start, end, thread) -> None:
        """One grammar compile (or cache-hit round trip) on each rank: rank r ran it on thread ``thread[r]``."""
        for r in range(len(start)):
            self.span(f"rank{r}/compile{thread[r]}", name, float(start[r]), float(end[r] - start[r]))

    def kv_span(self, t: float, duration: float, used: int, capacity: int, evicted: int) -> None:
        """The KV cache over one step: slots in use (of ``capacity``), requests preempted or retracted for it."""
        name = f"KV {used / capacity:.0%}" + (f", {evicted} preempted" if evicted else "")
        self.span("kv cache", name, t, duration, {"kv_tokens": used, "capacity": capacity, "preempted": evicted})

    def step_spans(self, t, sync, has_grammar, schedule_s, wait_s, carry, launch_s, forward_s, fill_s, copy_s,
                   apply_s, sample_s, process_s, duration) -> None:
        """Spans of one iteration starting at ``t`` (its parts as the scheduler priced them)."""
        if sync:
            self.span("scheduler", "schedule", t, schedule_s)
            self.span("scheduler", "grammar poll/check", t + schedule_s, wait_s)
            cpu = t + schedule_s + wait_s
            self.span("scheduler", "process (previous)", cpu, carry)
            cpu += carry
            self.span("scheduler", "launch", cpu, launch_s)
            cpu += launch_s
            gpu_start = cpu
        else:
            self.span("scheduler", "launch", t, launch_s)
            t += launch_s
            self.span("scheduler", "schedule", t, schedule_s)
            self.span("scheduler", "grammar poll/check", t + schedule_s, wait_s)
            cpu = t + schedule_s + wait_s
            gpu_start = t
            self.span("scheduler", "process (previous)", cpu, carry)
            cpu += carry
        self.span("gpu", "forward", gpu_start, forward_s)
        self.span("scheduler", "mask fill", cpu, fill_s)
        self.span("scheduler", "mask copy", cpu + fill_s, copy_s)
        if has_grammar or sync:
            mask_end = max(gpu_start + forward_s, cpu + fill_s + copy_s)
        else:
            mask_end = gpu_start + forward_s
        self.span("gpu", "apply mask", mask_end, apply_s)
        self.span("gpu", "sample", mask_end + apply_s, sample_s)
        if sync:
            self.span("scheduler", "process", mask_end + apply_s + sample_s, process_s)
