"""Time a MoE layer's routed experts as live mode runs them (torch's grouped GEMMs) by token count.

The question (issue 29): does the grouped GEMM cost what its tokens' FLOPs say, or what each expert's rows
padded to the kernel's row tile say? torch's ``grouped_mm`` on Hopper picks its CUTLASS tile from the mean
rows an expert (``pairs / experts``): 64 rows at most 128, else 128 (``GroupMM.cu``). Each token count is
routed two ways: uniformly over all experts (decode rows) and over one random subset of ``experts / skew``
experts (a prefill chunk as the calibration's ``chunk_routing_skew`` routes it). Each call cycles through
``--layers`` copies of the weights so they stream from memory as a forward's 48 layers do, not from L2.
Prints one line per (routing, tokens): the GPU time of ``grouped_experts`` and of its two grouped GEMMs
alone, the rows padded to the tile, and the CUTLASS kernel names the profiler saw (once).

    python benchmarks/moe_grouped_gemm.py --model qwen3-30b-a3b --csv OUT.csv
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from cdbench.harness.costs.hardware import resolve_model
from cdbench.harness.live.experts import grouped_experts


def routing(tokens: int, n_experts: int, k: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """``[tokens, k]`` distinct experts a token, drawn uniformly from one random subset of ``n_experts / skew``."""
    subset = torch.randperm(n_experts, generator=gen, device="cuda")[:max(k, round(n_experts / skew))]
    scores = torch.rand(tokens, subset.numel(), generator=gen, device="cuda")
    return subset[scores.topk(k, dim=-1).indices]


def timed(fn, reps: int) -> float:
    """Median GPU milliseconds of ``fn`` over ``reps`` calls after three warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+",
                        default=[1, 8, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 2304, 3072, 4096, 6144, 8192])
    parser.add_argument("--skew", type=float, nargs="+", default=[1.0, 3.36])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--csv", type=Path, required=True)
    args = parser.parse_args()
    spec = resolve_model(args.model)
    e, k, h, w = spec.n_experts, spec.experts_per_token, spec.hidden_size, spec.moe_intermediate_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [((torch.randn(e, h, 2 * w, generator=gen, device="cuda") * 0.02).to(torch.bfloat16),
               (torch.randn(e, w, h, generator=gen, device="cuda") * 0.02).to(torch.bfloat16))
              for _ in range(args.layers)]
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["model", "gpu", "skew", "tokens", "touched", "rows_padded", "tile", "experts_ms", "gemms_ms"])
        for skew in args.skew:
            for tokens in args.tokens:
                x = torch.randn(tokens, h, generator=gen, device="cuda").to(torch.bfloat16)
                ids = routing(tokens, e, k, skew, gen)
                weights = torch.softmax(torch.rand(tokens, k, generator=gen, device="cuda"), -1)
                counts = torch.bincount(ids.reshape(-1), minlength=e)
                tile = 64 if tokens * k // e <= 128 else 128
                padded = int(((counts + tile - 1) // tile * tile).sum())
                ends = counts.cumsum(0).to(torch.int32)
                xs = x[ids.reshape(-1).argsort(stable=True) // k]
                mid = torch.randn(tokens * k, w, generator=gen, device="cuda").to(torch.bfloat16)
                layer = iter(range(10**9))

                def experts():
                    gate_up, down = layers[next(layer) % len(layers)]
                    grouped_experts(x, weights, ids, gate_up, down)

                def gemms():
                    gate_up, down = layers[next(layer) % len(layers)]
                    F.grouped_mm(xs, gate_up, offs=ends)
                    F.grouped_mm(mid, down, offs=ends)

                experts_ms, gemms_ms = timed(experts, args.reps), timed(gemms, args.reps)
                out.writerow([spec.name, torch.cuda.get_device_name(), skew, tokens, int((counts > 0).sum()), padded,
                              tile, f"{experts_ms:.5f}", f"{gemms_ms:.5f}"])
                print(f"skew {skew} tokens {tokens:5d}: touched {int((counts > 0).sum()):3d} rows {tokens * k:6d} "
                      f"padded {padded:6d} (tile {tile}) experts {experts_ms * 1e3:8.1f} us gemms "
                      f"{gemms_ms * 1e3:8.1f} us  {gemms_ms * 1e3 / tokens:7.2f} us/token", flush=True)
                if tokens in (1024, 4096) and skew == args.skew[0]:
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        gemms()
                        torch.cuda.synchronize()
                    for event in prof.key_averages():
                        if "gemm" in event.key.lower() or "cutlass" in event.key.lower():
                            print(f"    kernel: {event.key[:240]}", flush=True)


if __name__ == "__main__":
    main()
