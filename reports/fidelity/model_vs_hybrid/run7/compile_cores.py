"""Compile every default-corpus spec once with xgrammar (a fresh compiler, so no cache hits) and print the times.

Run from the repository root on one core and on two, alternating:
    for c in 1 0,1 1 0,1; do taskset -c $c .venv/bin/python reports/fidelity/model_vs_hybrid/run7/compile_cores.py; done
xgrammar's compiler uses up to 8 threads (cdbench's default ``max_threads``), so a run pinned to one core
compiles its large grammars more slowly than one with two.
"""

import time

import numpy as np

from cdbench.backends import create_backend
from cdbench.backends.base import CompileError
from cdbench.backends.vocab import load_vocab
from cdbench.workloads.corpora import load_corpora
from cdbench.workloads.generator import distinct_specs

vocab = load_vocab("qwen3.6")
backend = create_backend("xgrammar", vocab)
times = []
for item in distinct_specs(load_corpora(["embedded"]).items)[0]:
    start = time.perf_counter()
    try:
        backend.compile(item.to_spec())
    except CompileError:
        continue
    times.append(time.perf_counter() - start)
ms = np.array(times) * 1e3
print(f"{len(ms)} compiles: mean {ms.mean():.2f} ms, p50 {np.median(ms):.2f} ms, p99 {np.percentile(ms, 99):.1f} ms, "
      f"total {ms.sum() / 1e3:.2f} s")
