"""A decode run's pricing as arrays over its steps, against its steps priced one by one in Python floats.

Asks issue 32's question of a Python-float path for small runs (numpy's calls cost about a microsecond
whatever a small array holds): the default workload's ``cdbench run --mode model -n N``
(``bench_phases.simulate``) is run once with the pricer's decode-run calls captured
(``StepPricer.price_decode_run``), then each call is priced again, warm, by the pricer itself and by
the same steps one by one: each step's parts (the pricer's ``_decode_parts``), its padded forward
(``decode_forward_s``, a span at a time) and ``step_time`` on Python floats. The values are checked
equal; the CPU a call (the best of three passes, on the thread's clock) is printed by the run's steps
and by whether its rows leave within it (segments).

Run from the repository root of the tree to measure::

    python benchmarks/bench_decode_pricing.py --requests 5000 --core 1

Found (2-CPU x86-64 machine shared with other work, 5,000 requests on core 1; ``reports/scheduler_benchmark.md``,
the section of 2026-11-28 "Python floats for small runs"), at 3e9f3fd, with ``main`` 75ad587's arrays (before the
segments' parts were gathered from tables) run just before::

    steps   segments   calls   arrays µs   floats µs   (75ad587: arrays, floats)
    1       one          143        16.4         8.8     17.8   9.3
    2       one          101        15.6        10.8     17.3  10.9
    2       several       65        24.5        16.1     28.2  17.2
    3-4     one          152        16.9        12.9     17.2  14.4
    3-4     several      163        28.2        21.0     33.1  23.0
    5-8     one          273        18.9        18.5     18.6  19.9
    5-8     several      349        31.4        28.0     37.1  29.4
    9-16    one          406        20.0        31.2     20.6  31.0
    9-16    several      640        39.8        46.3     42.7  46.2
    17-64   one          693        23.2        66.5     22.0  68.5
    17-64   several     1069        42.2        87.0     48.7  85.1

A step in floats costs about what an array operation over all the run's steps costs: floats win below 5 to 9
steps, arrays from there on, and most runs (and most of the pricing's time) are longer. Floats for the short
runs alone would save about 1 µs a request.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable

import bench_phases  # (this folder's: the run as bench_phases.py runs it)
import numpy as np

from cdbench.harness import step_cost
from cdbench.harness.policies import padded_decode
from cdbench.harness.step_time import step_time

BUCKETS = [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 64)]
FIELDS = ("duration", "after_token", "exposed", "hidden", "carry_out", "forward_s", "fill_s", "copy_s", "apply_s",
          "sample_s", "process_s", "transfer_s", "launch_s")


def captured(n: int) -> tuple[step_cost.StepPricer, list[tuple]]:
    """The pricer of a run of ``n`` requests and the arguments of its decode-run calls (copied as given)."""
    calls, pricer = [], []
    original = step_cost.StepPricer.price_decode_run

    def capturing(self, *args):
        pricer[:] = [self]
        calls.append(copy.deepcopy(args))
        return original(self, *args)

    step_cost.StepPricer.price_decode_run = capturing
    try:
        bench_phases.simulate(n)
    finally:
        step_cost.StepPricer.price_decode_run = original
    return pricer[0], calls


def in_floats(pricer: step_cost.StepPricer, rows, grammar_rows, lengths, pre, carry, fill_s, process_s, kv, sync,
              has_grammar, stretch) -> dict[str, list[float]]:
    """``price_decode_run``'s fields of the same steps, each step priced alone in Python floats."""
    cfg, gpu = pricer.cfg, pricer.gpu
    one = len(lengths) == 1
    pre, process_s = pre.tolist(), process_s.tolist()
    fill_s = fill_s.tolist() if fill_s is not None else None
    out: dict[str, list[float]] = {name: [] for name in FIELDS}
    at, carried = 0, carry
    for length in lengths:
        n = rows if one else int(rows[at])
        g = grammar_rows if one else int(grammar_rows[at])
        host_fill_s, transfer_s, engine_process_s, copy_s, apply_s, sample_s, launch_s, prep_s, build_s = \
            pricer._decode_parts(n, g, stretch)
        size, pad = padded_decode(cfg.cuda_graph_sizes, n, 0)
        forward_s = gpu.decode_forward_s(size, kv[at:at + length] + pad).tolist()
        waiting = 0.0 if cfg.pinned_mask else copy_s
        holds = not cfg.pinned_mask and bool(g) and pricer._copy_holds_host(n if pricer.batch_copy else g)
        prep_after = prep_s if pricer.sample_prep and holds else 0.0
        for i in range(at, at + length):
            fill = (fill_s[i] * stretch if fill_s is not None else 0.0) + host_fill_s
            process = process_s[i] * stretch + engine_process_s
            host_path = fill + (prep_s - prep_after) if pricer.sample_prep else fill
            forward = forward_s[i - at]
            values = step_time(sync, has_grammar, pre[i], carried, forward, host_path, copy_s - waiting + transfer_s,
                               apply_s, sample_s, process, launch_s, cfg.fill_beside_forward,
                               after_forward_s=prep_after, waiting_copy_s=waiting,
                               loop_waits=holds and cfg.mask_transfer == "none", build_s=build_s,
                               tail_beside_next=cfg.sample_beside_schedule)
            carried = 0.0 if sync else process
            for name, value in zip(FIELDS, (*values, forward, fill + build_s, copy_s, apply_s, sample_s, process,
                                            transfer_s, launch_s)):
                out[name].append(value)
        at += length
    return out


def best(price: Callable, pricer: step_cost.StepPricer, calls: list[tuple]) -> float:
    """The best of three passes over ``calls``: µs a call."""
    seconds = []
    for _ in range(3):
        start = time.thread_time()
        for args in calls:
            price(pricer, *args)
        seconds.append(time.thread_time() - start)
    return min(seconds) / len(calls) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5_000)
    parser.add_argument("--core", type=int, default=None, help="pin this process to this CPU core")
    args = parser.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    pricer, calls = captured(args.requests)
    arrays = step_cost.StepPricer.price_decode_run
    for call in calls:  # (the memos warm, and the same values both ways)
        cost, floats = arrays(pricer, *call), in_floats(pricer, *call)
        for name in FIELDS:
            assert np.broadcast_to(getattr(cost, name), len(call[7])).tolist() == floats[name], name
    print(f"{'steps':7s} {'segments':9s} {'calls':>6s} {'arrays µs':>11s} {'floats µs':>11s}")
    for low, high in BUCKETS:
        for label, several in (("one", False), ("several", True)):
            chosen = [c for c in calls if (len(c[2]) > 1) == several and low <= len(c[7]) <= high]
            if chosen:
                steps = str(low) if low == high else f"{low}-{high}"
                print(f"{steps:7s} {label:9s} {len(chosen):6d} {best(arrays, pricer, chosen):11.1f} "
                      f"{best(in_floats, pricer, chosen):11.1f}")


if __name__ == "__main__":
    main()
