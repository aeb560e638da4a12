"""Accept cost when other work runs between a step's fills and its accepts.

A trace's first N texts walked 16 at a time (every row's fill, then every row's accept, as ``walk_in_batch``)
with, between a step's fills and its accepts: nothing, reading 0.5 / 2 / 8 MB, spinning or sleeping 5 ms (an
engine's wait for the forward). Prints median and mean accept and fill (µs) per variant. Usage::

    .venv/bin/python benchmarks/xgrammar_accept_after_wait.py TRACE.jsonl 20

Results: reports/spec_costs/out_of_sample.md, "Accepts walked in batch".
"""

from __future__ import annotations

import gc
import sys
import time
from collections import deque

import numpy as np

from cdbench.backends.base import CompileError
from cdbench.backends.registry import create_backend
from cdbench.backends.vocab import load_vocab
from cdbench.workloads.trace import read_trace


def _walk(backend, texts, mask, between) -> tuple[np.ndarray, np.ndarray]:
    fills, accepts, clock = [], [], time.perf_counter_ns
    waiting, active = deque(texts), []
    gc.disable()
    while waiting or active:
        while waiting and len(active) < 16:
            grammar, tokens = waiting.popleft()
            active.append([backend.matcher(grammar), tokens, 0])
        for row, walk in enumerate(active):
            t0 = clock()
            walk[0].fill_mask(mask, row)
            fills.append(clock() - t0)
        between()
        for walk in active:
            t0 = clock()
            ok = walk[0].accept(walk[1][walk[2]])
            accepts.append(clock() - t0)
            walk[2] += 1 if ok else len(walk[1])
        active = [w for w in active if w[2] < len(w[1])]
    gc.enable()
    return np.array(fills) / 1e3, np.array(accepts) / 1e3


def main() -> None:
    requests = [r for r in read_trace(sys.argv[1]).workload.requests if r.spec is not None and r.output_tokens]
    backend = create_backend("xgrammar", load_vocab("qwen3.6"))
    texts = []
    for r in requests[:int(sys.argv[2])]:
        try:
            texts.append((backend.compile(r.spec), r.output_tokens))
        except CompileError:
            pass
    mask = backend.allocate_mask(16)
    buffers = {mb: np.ones(int(mb * (1 << 20)), np.uint8) for mb in (0.5, 2, 8)}

    def spin() -> None:
        end = time.perf_counter() + 0.005
        while time.perf_counter() < end:
            pass

    variants = [("nothing", lambda: None), *((f"read {mb} MB", b.sum) for mb, b in buffers.items()),
                ("spin 5 ms", spin), ("sleep 5 ms", lambda: time.sleep(0.005)), ("nothing", lambda: None)]
    for name, between in variants:
        fills, accepts = _walk(backend, texts, mask, between)
        print(f"{name:12s} accept median {np.median(accepts):.2f} mean {accepts.mean():.2f} µs; "
              f"fill median {np.median(fills):.2f} mean {fills.mean():.2f} µs ({len(accepts)} rows)", flush=True)


if __name__ == "__main__":
    main()
