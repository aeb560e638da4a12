"""Does an xgrammar spec compile faster after the corpus's earlier specs than alone?

Each of the first N specs of a corpus is compiled on an engine that compiled the corpus's earlier specs
(history) and alone on a freshly warmed engine (as the spec-cost store measures it), interleaved so both see
the same load; prints the median, p10 and p90 of history / alone, the sums and medians (ms). Usage::

    .venv/bin/python benchmarks/xgrammar_compile_history.py jsonschemabench_kubernetes_sampled 80

Found (2-core development VM, 80 specs each; reports/spec_costs/out_of_sample.md): after the corpus's earlier
specs against alone, median 0.88 for Kubernetes (total -13 %: its schemas share definitions, and xgrammar caches
the token masks of shared rules) and 0.99 for Glaive (no shared definitions). This is why model mode prices an
xgrammar run's compiles from its specs compiled in the run's order (spec_costs.measure_sequence).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from cdbench.backends.measure_worker import WARM_UP_SPEC, warm_up_engine
from cdbench.backends.registry import create_backend
from cdbench.backends.vocab import load_vocab
from cdbench.workloads.corpora import load_corpus


def _timed_compile(engine, spec) -> float:
    start = time.perf_counter()
    try:
        engine.compile(spec)
    except Exception:  # a spec the engine refuses still took its time
        pass
    return time.perf_counter() - start


def main() -> None:
    corpus, count = sys.argv[1], int(sys.argv[2])
    vocab = load_vocab("qwen3.6")
    items = load_corpus(corpus).items[:count]
    with_history = create_backend("xgrammar", vocab)
    with_history.compile(WARM_UP_SPEC)
    alone = create_backend("xgrammar", vocab)
    after, isolated = [], []
    for item in items:
        spec = item.to_spec()
        warm_up_engine(alone)
        isolated.append(_timed_compile(alone, spec))
        after.append(_timed_compile(with_history, spec))
    after_ms, isolated_ms = np.array(after) * 1e3, np.array(isolated) * 1e3
    ratio = after_ms / isolated_ms
    print(f"{corpus} history/alone: median {np.median(ratio):.3f}, p10 {np.quantile(ratio, 0.1):.3f}, "
          f"p90 {np.quantile(ratio, 0.9):.3f}; sums {after_ms.sum():.1f} / {isolated_ms.sum():.1f} ms; "
          f"medians {np.median(after_ms):.2f} / {np.median(isolated_ms):.2f} ms")
    print(f" second half median ratio {np.median(ratio[len(ratio) // 2:]):.3f}")


if __name__ == "__main__":
    main()
