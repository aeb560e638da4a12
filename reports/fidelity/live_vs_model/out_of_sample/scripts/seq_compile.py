"""Compile a run's specs in its request order in ONE xgrammar backend (as live mode's engine does), then each
again in a fresh backend, timing both: does a spec's compile depend on what the engine compiled before it?"""
import json, sys, time
from cdbench.backends.registry import create_backend
from cdbench.backends.base import ConstraintSpec
trace, picks = sys.argv[1], sys.argv[2:]
reqs = [json.loads(l) for l in open(trace)]
reqs = [r for r in reqs if r.get("type") == "request"]
order, seen = [], set()
for r in reqs:
    if r["spec_id"] not in seen:
        seen.add(r["spec_id"]); order.append((r["spec_id"], r["spec"]))
def timed(b, spec):
    t = time.perf_counter()
    try:
        b.compile(ConstraintSpec(spec["kind"], spec["spec"]))
    except Exception:
        return None
    return time.perf_counter() - t
b = create_backend("xgrammar", "qwen3.6")
timed(b, {"kind": "json_schema", "spec": {"type": "object", "properties": {"a": {"type": "string"}}}})  # warm
seq = {}
for sid, spec in order:
    if picks and sid not in picks and len(seq) >= 0 and sid not in picks:
        # compile everything up to the last pick, in order
        if all(p in seq for p in picks): break
    seq[sid] = timed(b, spec)
for sid in (picks or [s for s, _ in order]):
    if sid not in seq: continue
    f = create_backend("xgrammar", "qwen3.6")
    timed(f, {"kind": "json_schema", "spec": {"type": "object", "properties": {"a": {"type": "string"}}}})
    fresh = timed(f, dict(order)[sid])
    print(f"{sid}: in sequence {seq[sid]}, fresh engine {fresh}")
