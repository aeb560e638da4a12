"""Where a live forward step's GPU time goes: one decode step of a model, eager, under torch's profiler, its
CUDA kernels summed by name (the share of the step each takes).

The calibration times whole steps; this splits one, to find what makes a step slower than the roofline's
floor (for a MoE model: the routed experts' grouped GEMMs, the routing's sort and scatter, or the rest).
Usage (a CUDA host)::

    python benchmarks/live_step_kernels.py --model qwen3-30b-a3b --rows 1 8 64 --kv 1024 --csv OUT.csv

``--moe-kernels grouped_mm fused`` profiles a MoE's routed experts both ways (torch's grouped GEMMs and the
fused kernels, :func:`cdbench.harness.live.experts.fused_experts`), one forward after the other.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from cdbench.harness.costs.hardware import resolve_model
from cdbench.harness.live.forward import LiveForward
from cdbench.harness.live.paged import KVCache


def kernel_times(fwd: LiveForward, cache: KVCache, rows: int, kv: int, steps: int) -> dict[str, float]:
    """Mean GPU microseconds a step per kernel name, over ``steps`` eager decode steps after two warm-ups."""
    decode = fwd.decode_inputs([kv] * rows, per_row=True)
    for _ in range(2):
        fwd.step(cache, decode)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fwd.step(cache, decode)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            totals[event.key] = totals.get(event.key, 0.0) + event.device_time_total / steps
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--kv", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="kernels printed per shape")
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--moe-kernels", nargs="+", default=["grouped_mm"], choices=["grouped_mm", "fused"])
    args = parser.parse_args()
    spec = resolve_model(args.model)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "gpu", "moe_kernels", "rows", "kv", "kernel", "us_per_step", "share"])
        for kernels in args.moe_kernels:
            fwd = LiveForward(spec, "cuda", moe_kernels=kernels)
            cache = KVCache.allocate(spec, max(args.rows), args.kv + 8, "cuda")
            for rows in args.rows:
                times = kernel_times(fwd, cache, rows, args.kv, args.steps)
                total = sum(times.values())
                print(f"{spec.name} ({kernels}) decode {rows}x{args.kv}: {total / 1e3:.3f} ms of kernels a step",
                      flush=True)
                for name, us in sorted(times.items(), key=lambda item: -item[1]):
                    writer.writerow([spec.name, torch.cuda.get_device_name(), kernels, rows, args.kv, name,
                                     f"{us:.2f}", f"{us / total:.4f}"])
                for name, us in sorted(times.items(), key=lambda item: -item[1])[:args.top]:
                    print(f"  {us:9.1f} us  {us / total:6.1%}  {name[:100]}", flush=True)
            del fwd, cache  # one model's weights on the GPU at a time
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
