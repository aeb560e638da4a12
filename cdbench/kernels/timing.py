"""GPU timing primitives for the kernel benchmark: rotating inputs, event medians, graph replay.

All times are microseconds. Event timing uses :func:`triton.testing.do_bench`
(L2 flushed before each call, median of repeats); each call also moves to the
next of several input sets, so no call finds its inputs in cache. Graph replay
captures one call per input set back to back in a CUDA graph and divides the
replay time by the number of calls: pure GPU time, no launch gaps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
MiB = 1 << 20


@dataclass(frozen=True)
class Timing:
    """Median and 20/80 % quantiles of one measurement, µs."""

    median_us: float
    q20_us: float
    q80_us: float


def rotation_count(bytes_per_set: int, target_bytes: int = 512 * MiB, lo: int = 2, hi: int = 512) -> int:
    """How many input sets make ``n * bytes_per_set >= target_bytes`` (clamped to ``[lo, hi]``).

    >>> rotation_count(100 * MiB), rotation_count(1 * MiB), rotation_count(2 * MiB, hi=64)
    (6, 512, 64)
    """
    return max(lo, min(hi, -(-target_bytes // max(bytes_per_set, 1))))


class Rotation(Generic[T]):
    """Cycles through input sets; ``next()`` returns the following one."""

    def __init__(self, sets: Sequence[T]):
        if not sets:
            raise ValueError("need at least one input set")
        self.sets = list(sets)
        self._i = -1

    def next(self) -> T:
        self._i = (self._i + 1) % len(self.sets)
        return self.sets[self._i]


def event_time(fn: Callable[[T], object], rotation: Rotation[T], warmup_ms: float = 10, rep_ms: float = 40) -> Timing:
    """do_bench median of ``fn(next input set)`` on the current CUDA device."""
    from triton.testing import do_bench

    q = do_bench(lambda: fn(rotation.next()), warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return Timing(q[0] * 1e3, q[1] * 1e3, q[2] * 1e3)


def graph_time(fn: Callable[[T], object], rotation: Rotation[T], replays: int = 10) -> Timing:
    """Per-call GPU time of ``fn`` over every input set, captured once in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles, allocator) off the capture
        for item in rotation.sets:
            fn(item)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for item in rotation.sets:
            fn(item)
    graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / len(rotation.sets))
    del graph
    return _summary(per_call)


def wall_time(fn: Callable[[], object], reps: int = 20, sync: Callable[[], None] | None = None) -> Timing:
    """Host-clock median of ``fn`` (followed by ``sync``, if given), after one warm-up call."""
    fn()
    if sync:
        sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _summary(samples)


def h2d_time(nbytes: int, pinned: bool, reps: int = 20) -> Timing:
    """Host-to-device copy of ``nbytes``: pinned is CUDA-event time of a ``non_blocking`` copy;
    pageable is host time of a blocking copy (it waits for the staging copy either way)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.random_(0, 256, generator=torch.Generator().manual_seed(nbytes))
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    if not pinned:
        return wall_time(lambda: dst.copy_(src), reps=reps, sync=torch.cuda.synchronize)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    if not torch.equal(dst[:: max(1, nbytes // 4096)].cpu(), src[:: max(1, nbytes // 4096)]):
        raise RuntimeError(f"host-to-device copy of {nbytes} bytes produced different bytes")
    return _summary(samples)


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read plus bytes written per second, in GB/s."""
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _summary(samples: list[float]) -> Timing:
    ordered = sorted(samples)
    return Timing(statistics.median(ordered), ordered[int(0.2 * (len(ordered) - 1))], ordered[int(0.8 * (len(ordered) - 1))])
