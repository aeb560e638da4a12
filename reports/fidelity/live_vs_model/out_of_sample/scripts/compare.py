"""Per spec: compile and mean fill in live-a's in-situ profile, in the GPU host's spec store, in this machine's store."""
import json, glob, sys, statistics as st
import numpy as np
def store(root, host=None):
    out = {}
    for f in glob.glob(f"{root}/*/*/*.json"):
        e = json.load(open(f))
        if host and e["host"]["id"] != host: continue
        if e["status"] != "ok": continue
        c = e["costs"]
        out[e["label"]] = (c["compile_s"], c["fill_scale_s"], c["fills"], e["host"])
    return out
def insitu(path):
    p = json.load(open(path))
    return {v["spec_id"]: (v["compile_s"], v["fill_scale_s"], v["fills"]) for v in p["specs"].values() if v["status"] == "ok"}
def q(a, qs=(10, 50, 90)):
    return " ".join(f"p{x}={np.percentile(a, x):.2f}" for x in qs)
gpu = store("/tmp/oos/dev/.cache/spec_costs", "7fdcd680e958")
loc = store("/tmp/oos/store_local")
for ph, corpus in (("under", "Github_medium"), ("saturated", "Github_hard")):
    for pol in ("sglang", "vllm"):
        ov = "true" if ph == "under" else "false"
        for copy in ("live-a", "live-b", "hybrid"):
            ins = insitu(f"/tmp/oos/dev/{ph}/json-{pol}-overlap_{ov}-{copy}/grammar_profile.json")
            common = [k for k in ins if k in gpu]
            rc = np.array([gpu[k][0] / ins[k][0] for k in common]); rf = np.array([gpu[k][1] / ins[k][1] for k in common])
            big = [k for k in common if ins[k][0] > 0.05]
            rcb = np.array([gpu[k][0] / ins[k][0] for k in big])
            tot_ins = sum(ins[k][0] for k in common); tot_gpu = sum(gpu[k][0] for k in common)
            print(f"{ph:9s} {pol:6s} {copy:6s} n={len(common):3d} compile store/insitu {q(rc)} | >50ms n={len(big)} {q(rcb) if big else ''} | sum {tot_gpu:.1f}/{tot_ins:.1f} s | mean fill store/insitu {q(rf)}")

if len(sys.argv) > 1:
    ins = insitu("/tmp/oos/dev/under/json-sglang-overlap_true-live-a/grammar_profile.json")
    rows = sorted(((gpu[k][0] / ins[k][0], k, ins[k][0], gpu[k][0], loc.get(k, (float('nan'),))[0]) for k in ins if k in gpu), reverse=True)
    for r in rows[:15]: print("%.1fx %s live %.3f s gpu-store %.3f s local-store %.3f s" % r)
    for r in rows[-5:]: print("%.1fx %s live %.3f s gpu-store %.3f s local-store %.3f s" % r)
