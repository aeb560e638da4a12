"""The discrete-event core: a virtual clock and a queue of timed events.

>>> q = EventQueue()
>>> q.push(0.002, EventKind.ITERATION)
>>> q.push(0.002, EventKind.ARRIVAL, 7)
>>> q.pop()
(0.002, <EventKind.ARRIVAL: 0>, 7)
>>> q.now
0.002

Ordering is explicit: events pop by ``(time, kind priority, sequence number)``.
At one instant, everything that *arrives* (requests) is handled before the
scheduler runs an iteration, as an engine drains its input queue before it
schedules; among events of one kind, the one pushed first pops first.

Vidur, by contrast, keys its heap on ``(time, id, event_type)`` where the
``event_type`` property returns ``None``; since ids are unique the heap
silently orders same-time events by creation order, and the priority its
``EventType`` enum documents is never applied.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from typing import Any


class EventKind(enum.IntEnum):
    """Event kinds; the value is the priority among events at the same time (lower first)."""

    ARRIVAL = 0  # a request reaches the engine
    ITERATION = 1  # the scheduler runs one loop iteration


_KINDS = tuple(sorted(EventKind, key=int))  # by value: cheaper than calling EventKind(value) per event


class EventQueue:
    """A min-heap of ``(time, kind, seq, payload)`` with a virtual clock.

    ``now`` is the time of the event popped last; it never goes backwards.
    """

    __slots__ = ("_heap", "_seq", "now")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.now = 0.0

    def push(self, time: float, kind: EventKind, payload: Any = None) -> None:
        """Schedule ``kind`` at ``time``; times before ``now`` are an error."""
        if time < self.now:
            raise ValueError(f"event {kind.name} at {time} is before the clock ({self.now})")
        heapq.heappush(self._heap, (time, int(kind), next(self._seq), payload))

    def pop(self) -> tuple[float, EventKind, Any]:
        """Remove the next event, advance the clock to it and return ``(time, kind, payload)``."""
        time, kind, _, payload = heapq.heappop(self._heap)
        self.now = time
        return time, _KINDS[kind], payload

    def peek_time(self) -> float:
        """Time of the next event (``inf`` when empty)."""
        return self._heap[0][0] if self._heap else float("inf")

    def __len__(self) -> int:
        return len(self._heap)
