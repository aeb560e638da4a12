"""Per spec of each case: compile and mean fill (fill_scale_s) as live-a, live-b and hybrid met them in situ, as the
GPU host's store measured them (model at its defaults), and as this machine measured them (twice for the medium
corpus); and where live-a's matcher refused the walked text. Writes per_spec_<phase>.csv."""
import csv, glob, json, sys
GPU, HERE = "7fdcd680e958", "dc87bbe29a53"
def store(root, host):
    out = {}
    for f in glob.glob(f"{root}/*/*/*.json"):
        e = json.load(open(f))
        if e["host"]["id"] == host:
            out[e["label"]] = (e["status"], e["costs"])
    return out
def insitu(path):
    return {v["spec_id"]: v for v in json.load(open(path))["specs"].values()}
gpu, here1, here2 = store("/tmp/oos/dev/.cache/spec_costs", GPU), store("/tmp/oos/store_here_for_gpu", HERE), store("/tmp/oos/store_local2", HERE)
out = sys.argv[1]
for ph, ov, pol in (("under", "true", "sglang"), ("saturated", "false", "sglang")):
    base = f"/tmp/oos/dev/{ph}/json-{pol}-overlap_{ov}"
    la, lb, hy = (insitu(f"{base}-{c}/grammar_profile.json") for c in ("live-a", "live-b", "hybrid"))
    vl = insitu(f"/tmp/oos/dev/{ph}/json-vllm-overlap_{ov}-live-a/grammar_profile.json")
    cols = ["spec_id", "status_live", "compile_s_live_a", "compile_s_live_b", "compile_s_hybrid", "compile_s_vllm_live_a",
            "compile_s_store_gpu_host", "compile_s_here_1", "compile_s_here_2",
            "mean_fill_us_live_a", "mean_fill_us_store_gpu_host", "mean_fill_us_here_1", "mean_fill_us_here_2",
            "fills_live_a", "fills_store_gpu_host", "rejected_at_live_a"]
    with open(f"{out}/per_spec_{ph}.csv", "w", newline="") as fh:
        w = csv.writer(fh); w.writerow(cols)
        for sid in sorted(la):
            def c(d): return d[sid]["compile_s"] if sid in d and d[sid]["status"] == "ok" else ""
            def s(d, key):
                if sid not in d or d[sid][0] != "ok": return ""
                v = d[sid][1][key]; return v * 1e6 if key == "fill_scale_s" else v
            def f(d): return d[sid]["fill_scale_s"] * 1e6 if sid in d and d[sid]["status"] == "ok" else ""
            w.writerow([sid, la[sid]["status"], c(la), c(lb), c(hy), c(vl), s(gpu, "compile_s"), s(here1, "compile_s"),
                        s(here2, "compile_s"), f(la), s(gpu, "fill_scale_s"), s(here1, "fill_scale_s"),
                        s(here2, "fill_scale_s"), la[sid]["fills"], s(gpu, "fills"),
                        la[sid]["rejected_at"] if la[sid].get("rejected") else ""])
    print(f"{out}/per_spec_{ph}.csv: {len(la)} specs")
