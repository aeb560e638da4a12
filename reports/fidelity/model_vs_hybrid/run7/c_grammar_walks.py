"""Walk the longest pooled text of lark/syncode/c_grammar four times with xgrammar, alone, timing each fill.

Run from the repository root: .venv/bin/python reports/fidelity/model_vs_hybrid/run7/c_grammar_walks.py
Prints each walk's median fill and its five largest fills (answer position, ms); the Python garbage
collector is on for walks 1 and 3 and off for walks 2 and 4.
"""

import gc
import time

import numpy as np

from cdbench.backends import create_backend
from cdbench.backends.vocab import load_vocab
from cdbench.workloads.corpora import load_corpora
from cdbench.workloads.instances import PoolCache

vocab = load_vocab("qwen3.6")
item = next(it for it in load_corpora(["embedded"]).items if it.id == "lark/syncode/c_grammar")
pool = PoolCache().get(item.id, item.to_spec(), vocab, size=4, seed=0)
backend = create_backend("xgrammar", vocab)
grammar = backend.compile(item.to_spec())
tokens = max(pool.tokens, key=len)


def walk() -> np.ndarray:
    matcher, mask = backend.matcher(grammar), backend.allocate_mask(1)
    out = []
    for token in tokens:
        start = time.perf_counter_ns()
        matcher.fill_mask(mask, 0)
        out.append(time.perf_counter_ns() - start)
        matcher.accept(token)
    return np.array(out) / 1e6


for collector in ("on", "off", "on", "off"):
    gc.enable() if collector == "on" else gc.disable()
    fills = walk()
    top = np.argsort(-fills)[:5]
    print(f"gc {collector}: {len(fills)} fills, median {np.median(fills):.1f} ms, largest "
          f"{[(int(i), round(float(fills[i]))) for i in top]}")
