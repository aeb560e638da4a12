"""Diagnostic stores: the GPU host's store with (a) each spec's compile time replaced by live-a's in-situ one,
(b) also live-a's rejections (the walk the matcher refused, and where). Isolates what the store's prices miss."""
import json, glob, shutil, sys
from pathlib import Path
src, live_profile, out, what = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
shutil.rmtree(out, ignore_errors=True); shutil.copytree(src, out)
ins = {v["spec_id"]: v for v in json.load(open(live_profile))["specs"].values()}
n = 0
for f in glob.glob(f"{out}/*/*/*.json"):
    e = json.load(open(f)); s = ins.get(e["label"])
    if s is None or e["status"] != "ok" or s["status"] != "ok": continue
    e["costs"]["compile_s"] = s["compile_s"]
    if what == "compile+reject" and s.get("rejected"):
        e["costs"]["rejected"], e["costs"]["rejected_at"] = s["rejected"], s["rejected_at"]
        e["costs"]["walks"] = s["walks"]  # the in-situ reject rate
    json.dump(e, open(f, "w")); n += 1
print(f"{out}: {n} entries patched ({what})")
