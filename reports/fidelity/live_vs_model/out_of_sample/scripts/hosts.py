"""Host scaling of spec costs: per spec, the GPU host's measurement / this machine's, against the ratio of the
hosts' benchmark scores; and this machine against itself (two measurements of the same specs) as its noise."""
import json, glob
import numpy as np
GPU, HERE = "7fdcd680e958", "dc87bbe29a53"
def entries(root, host):
    out = {}
    for f in glob.glob(f"{root}/*/*/*.json"):
        e = json.load(open(f))
        if e["host"]["id"] == host and e["status"] == "ok":
            out[e["label"]] = e["costs"]
    return out
gpu = entries("/tmp/oos/dev/.cache/spec_costs", GPU)
here1 = entries("/tmp/oos/store_here_for_gpu", HERE)   # first measurement here (+ o27148, measured by the scaled run)
here2 = entries("/tmp/oos/store_local2", HERE)         # the medium specs measured here again
h_gpu = json.load(open(f"/tmp/oos/dev/.cache/spec_costs/hosts/{GPU}.json"))
h_here = json.load(open(f"/tmp/oos/store_here_for_gpu/hosts/{HERE}.json"))
pred = h_here["score"] / h_gpu["score"]  # cdbench's time_scale(here -> GPU host): seconds here x pred = seconds there
print(f"benchmark scores: GPU host ({h_gpu['name']}) {h_gpu['score']:.3f}, this machine ({h_here['name']}) "
      f"{h_here['score']:.3f}: predicted GPU-host/here time ratio {pred:.3f}\n")
print("| compared | corpus | what | specs | ratio p10 | median | p90 | median / predicted | geometric sd | within ±25 % of predicted | sum ratio |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
def row(name, corpus, what, pairs, p):
    r = np.array([a / b for a, b in pairs]); lr = np.log(r)
    s = sum(a for a, _ in pairs) / sum(b for _, b in pairs)
    print(f"| {name} | {corpus} | {what} | {len(r)} | {np.percentile(r,10):.2f} | {np.median(r):.2f} | {np.percentile(r,90):.2f} "
          f"| {np.median(r)/p:.2f} | ×{np.exp(lr.std()):.2f} | {np.mean(np.abs(r/p-1) <= 0.25)*100:.0f} % | {s:.2f} |")
for name, a, b, p in (("GPU host / here", gpu, here1, pred), ("here, 2nd / 1st", here2, here1, 1.0)):
    for corpus in ("Github_medium", "Github_hard"):
        keys = sorted(k for k in a if k in b and corpus in k)
        if not keys: continue
        c = [(a[k]["compile_s"], b[k]["compile_s"]) for k in keys]
        row(name, corpus, "compile", c, p)
        row(name, corpus, "compile ≥ 50 ms here", [x for x in c if x[1] >= 0.05], p)
        row(name, corpus, "compile < 50 ms here", [x for x in c if x[1] < 0.05], p)
        row(name, corpus, "mean fill", [(a[k]["fill_scale_s"], b[k]["fill_scale_s"]) for k in keys
                                        if a[k]["fills"] and b[k]["fills"]], p)
