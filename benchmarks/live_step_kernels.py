"""Where a live forward step's GPU time goes: one decode step of a model, eager, under torch's profiler, its
CUDA kernels summed by name (the share of the step each takes).

The calibration times whole steps; this splits one, to find what makes a step slower than the roofline's
floor (for a MoE model: the routed experts' grouped GEMMs, the routing's sort and scatter, or the rest).
Usage (a CUDA host)::

    python benchmarks/live_step_kernels.py --model qwen3-30b-a3b --rows 1 8 64 --kv 1024 --csv OUT.csv

``--moe-kernels grouped_mm fused`` profiles a MoE's routed experts both ways (torch's grouped GEMMs and the
fused kernels, :func:`cdbench.harness.live.experts.fused_experts`), one forward after the other.

``--projections`` measures instead the bandwidth each projection of a dense model (fused QKV, output,
gate/up, down, LM head) reads its weights at, at ``--rows`` rows: enough copies of the weights (as layers
are) that together they overflow the L2 cache, one pass over all of them captured as a CUDA graph and timed;
read GB/s = the copies' bytes over the pass's median time, and its share of the device's copy bandwidth (bytes
read plus written, :func:`cdbench.kernels.timing.copy_bandwidth_gbs`, the weight-bytes floor's denominator),
with ``x @ w`` in the live forward's ``[K, N]`` layout (``torch``) and ``F.linear`` in the engines'
``nn.Linear`` ``[N, K]`` layout (``torch_nk``), both cuBLAS::

    python benchmarks/live_step_kernels.py --model llama-3.1-8b --projections --rows 1 2 4 8 16 --csv OUT.csv

Found on an H200 (``reports/calibration/README.md``, "Batch-1 decode: where the time goes"): cuBLAS reads the
wide projections at the copy bandwidth (gate/up 1.00, LM head 1.04) and the narrow ones below it (down 0.89,
QKV 0.78, output 0.62); a Triton split-K kernel tried in their place (tiles of 32-256 columns by 32-128
inputs, tensor-core or elementwise, 2-8 programs an SM) was never faster than cuBLAS at any of them.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from cdbench.harness.costs.hardware import ModelSpec, intermediate_size, resolve_model
from cdbench.harness.live.forward import LiveForward
from cdbench.harness.live.paged import KVCache

L2_OVERFLOW_BYTES = 1 << 30  # a projection pass reads at least this much: far past any GPU's L2


def kernel_times(fwd: LiveForward, cache: KVCache, rows: int, kv: int, steps: int) -> dict[str, tuple[float, float]]:
    """Mean GPU microseconds and launches a step per kernel name, over ``steps`` eager decode steps after two
    warm-ups."""
    decode = fwd.decode_inputs([kv] * rows, per_row=True)
    for _ in range(2):
        fwd.step(cache, decode)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fwd.step(cache, decode)
        torch.cuda.synchronize()
    totals: dict[str, tuple[float, float]] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            us, calls = totals.get(event.key, (0.0, 0.0))
            totals[event.key] = (us + event.device_time_total / steps, calls + event.count / steps)
    return totals


def projections(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(K, N) of each projection a dense model's decode step reads."""
    h, d = spec.hidden_size, spec.head_dim
    width = intermediate_size(spec)
    return {"qkv": (h, (spec.n_heads + 2 * spec.n_kv_heads) * d), "o": (spec.n_heads * d, h),
            "gate_up": (h, 2 * width), "down": (width, h), "lm_head": (h, spec.vocab_size)}


def graph_pass_s(run, reps: int = 7) -> float:
    """Median seconds of one replay of ``run`` captured as a CUDA graph (after two eager warm-ups)."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def projection_bandwidth(spec: ModelSpec, rows_list: list[int], writer) -> None:
    """Each projection's weight-read bandwidth at each row count, both layouts (the module doc)."""
    from cdbench.kernels.timing import copy_bandwidth_gbs

    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s (read + write)", flush=True)
    writer.writerow(["model", "gpu", "projection", "k", "n", "rows", "method", "copies", "us_per_copy", "read_gbs",
                     "copy_gbs", "share_of_copy"])
    for name, (k, n) in projections(spec).items():
        copies = max(2, -(-L2_OVERFLOW_BYTES // (k * n * 2)))
        weights = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        transposed = [w.t().contiguous() for w in weights]
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            for method, run in (("torch", lambda: [x @ w for w in weights]),
                                ("torch_nk", lambda: [F.linear(x, w) for w in transposed])):
                seconds = graph_pass_s(run)
                gbs = copies * k * n * 2 / seconds / 1e9
                writer.writerow([spec.name, torch.cuda.get_device_name(), name, k, n, rows, method, copies,
                                 f"{seconds / copies * 1e6:.2f}", f"{gbs:.0f}", f"{copy_gbs:.0f}",
                                 f"{gbs / copy_gbs:.4f}"])
                print(f"  {name} K={k} N={n} rows={rows} {method}: {gbs:.0f} GB/s ({gbs / copy_gbs:.3f})", flush=True)
        weights.clear()
        transposed.clear()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--kv", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="kernels printed per shape")
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--moe-kernels", nargs="+", default=["grouped_mm"], choices=["grouped_mm", "fused"])
    parser.add_argument("--projections", action="store_true",
                        help="each dense projection's weight-read bandwidth at --rows instead (the module doc)")
    args = parser.parse_args()
    spec = resolve_model(args.model)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.writer(f)
        if args.projections:
            projection_bandwidth(spec, args.rows, writer)
            return
        writer.writerow(["model", "gpu", "moe_kernels", "rows", "kv", "kernel", "us_per_step", "share",
                         "calls_per_step"])
        for kernels in args.moe_kernels:
            fwd = LiveForward(spec, "cuda", moe_kernels=kernels)
            cache = KVCache.allocate(spec, max(args.rows), args.kv + 8, "cuda")
            for rows in args.rows:
                times = kernel_times(fwd, cache, rows, args.kv, args.steps)
                total = sum(us for us, _ in times.values())
                launches = sum(calls for _, calls in times.values())
                print(f"{spec.name} ({kernels}) decode {rows}x{args.kv}: {total / 1e3:.3f} ms of kernels a step, "
                      f"{launches:.0f} launches", flush=True)
                ranked = sorted(times.items(), key=lambda item: -item[1][0])
                for name, (us, calls) in ranked:
                    writer.writerow([spec.name, torch.cuda.get_device_name(), kernels, rows, args.kv, name,
                                     f"{us:.2f}", f"{us / total:.4f}", f"{calls:g}"])
                for name, (us, calls) in ranked[:args.top]:
                    print(f"  {us:9.1f} us  {us / total:6.1%}  {calls:5.0f}x  {name[:90]}", flush=True)
            del fwd, cache  # one model's weights on the GPU at a time
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
