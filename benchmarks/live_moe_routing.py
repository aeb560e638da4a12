"""Count the distinct experts each MoE layer of the live forward routes to: a prefill chunk vs decode rows.

Every step feeds each request its own token ids (``request_tokens`` of its table row and position, as live
mode and the calibration do), through the live forward's random weights: the prefill as one chunk from an
empty cache, the decode rows at 256 cached tokens each, once over contexts nobody wrote and once after a
prefill of each row's own prompt. Uniform routing touches ``E·(1 − (1 − k/E)^n)`` experts for ``n`` tokens.
Usage (runs on the CPU with the first few layers; the count per layer does not depend on the later ones)::

    python benchmarks/live_moe_routing.py --model qwen3-30b-a3b --layers 4 --device cpu

Found (qwen3-30b-a3b, 4 layers, one H200, reports/calibration/README.md): decode rows touch what uniform
routing does, with or without their contexts written (4 rows: 31, 30, 29, 30 and 30, 29, 29, 27 against 29.1);
a prefill chunk's tokens fewer, fewer the deeper the layer. Before each request had its own ids (one id per
batch row every step, one prompt for every request), decode rows over written contexts touched far fewer
(29, 14, 11, 10): their contexts were alike.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from cdbench.harness.costs.hardware import resolve_model
from cdbench.harness.live import forward as live
from cdbench.harness.live.paged import KVPool

DECODE_CACHED = 256


@contextlib.contextmanager
def counting_routes(counts: list[int]):
    """Record, for every MoE layer the forward runs, how many distinct experts its router picked."""
    route = live.route

    def counted(x, router, k):
        weights, ids = route(x, router, k)
        counts.append(int(ids.unique().numel()))
        return weights, ids

    live.route = counted
    try:
        yield
    finally:
        live.route = route


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4, help="build only the first N layers")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    spec = resolve_model(args.model)
    if not spec.is_moe:
        parser.error(f"{spec.name} is not a mixture of experts")
    spec = spec.model_copy(update={"n_layers": min(args.layers, spec.n_layers)})
    forward = live.LiveForward(spec, args.device)
    e, k = spec.n_experts, spec.experts_per_token
    print(f"{spec.name}, first {spec.n_layers} layers, {e} experts, {k} per token: distinct experts per MoE layer")
    print("| tokens | uniform routing | prefill chunk | decode rows | decode rows, contexts prefilled |")
    print("|---:|---:|---|---|---|")
    for n in args.tokens:
        # each request's context in whole blocks of 16
        cache = KVPool(spec, (n + 1) * (DECODE_CACHED + 16), args.device).cache(n + 1, DECODE_CACHED + 1)
        prefill, decode, prefilled = [], [], []
        with torch.inference_mode():
            with counting_routes(prefill):
                forward.step(cache, prefill=[live.PrefillChunk(0, 0, n)])
            # as a calibration step's rows: contexts nobody wrote
            with counting_routes(decode):
                forward.step(cache, decode=forward.decode_inputs([DECODE_CACHED] * n, slots=range(1, n + 1)))
            for slot in range(1, n + 1):  # as a live request's: its prompt's prefill wrote it
                forward.step(cache, prefill=[live.PrefillChunk(slot, 0, DECODE_CACHED)])
            with counting_routes(prefilled):
                forward.step(cache, decode=forward.decode_inputs([DECODE_CACHED] * n, slots=range(1, n + 1)))
        uniform = e * (1 - (1 - k / e) ** n)
        counts = " | ".join(", ".join(map(str, c)) for c in (prefill, decode, prefilled))
        print(f"| {n} | {uniform:.1f} | {counts} |", flush=True)


if __name__ == "__main__":
    main()
