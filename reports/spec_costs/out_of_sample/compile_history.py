# Each spec of a corpus compiled on an engine that compiled the corpus's earlier specs (history) and alone on a
# warmed engine (as the store measures it), interleaved so both see the same load. Usage:
#   python reports/spec_costs/out_of_sample/compile_history.py jsonschemabench_kubernetes_sampled 80
import time, sys, numpy as np
from cdbench.backends.vocab import load_vocab
from cdbench.backends.registry import create_backend
from cdbench.backends.measure_worker import warm_up_engine, WARM_UP_SPEC
from cdbench.workloads.corpora import load_corpus
v = load_vocab("qwen3.6")
items = load_corpus(sys.argv[1]).items[:int(sys.argv[2])]
A = create_backend("xgrammar", v); A.compile(WARM_UP_SPEC)
B = create_backend("xgrammar", v)
ha, hb = [], []
for it in items:
    s = it.to_spec()
    warm_up_engine(B)
    t = time.perf_counter()
    try: B.compile(s)
    except Exception: pass
    hb.append(time.perf_counter() - t)
    t = time.perf_counter()
    try: A.compile(s)
    except Exception: pass
    ha.append(time.perf_counter() - t)
ha, hb = np.array(ha) * 1e3, np.array(hb) * 1e3
r = ha / hb
print(sys.argv[1], "history/isolated: median", np.median(r).round(3), "p10", np.quantile(r, .1).round(3), "p90", np.quantile(r, .9).round(3), "sums", ha.sum().round(1), hb.sum().round(1), "medians", np.median(ha).round(2), np.median(hb).round(2))
print(" second half median ratio", np.median(r[len(r)//2:]).round(3))
