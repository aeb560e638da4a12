"""Time the decode-attention kernel against the live forward's torch attention, on a GPU.

Per case (rows, lengths drawn uniformly in ``[mean/2, 3*mean/2)``, Llama-3.1-8B
heads, one layer's cache of ``--max-len`` keys per slot, scattered slots): the
kernel at its default splits, and the forward's current path
(``scaled_dot_product_attention`` over the slots gathered up to the longest row
and masked). Each is captured in a CUDA graph over several input sets with
disjoint slots, so no call finds its keys in L2 and no launch gap is counted
(:func:`cdbench.kernels.timing.graph_time`). Reports µs per call and the KV bytes
the rows need (each row's own length) per second. ``--sweep`` also times every
splits × key block × warps, to choose the defaults.

Run on a GPU host from the repo root: ``python benchmarks/bench_decode_attention.py [--sweep]``.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from cdbench.kernels import decode_attention as module
from cdbench.kernels.decode_attention import decode_attention
from cdbench.kernels.timing import Rotation, graph_time, rotation_count

KV_HEADS, GROUP, HEAD_DIM = 8, 4, 128


def sdpa_masked(q, k, v, slots, lengths, attend: int) -> torch.Tensor:
    """The live forward's decode attention: gather the rows' slots up to ``attend`` keys, mask the rest."""
    rows = q.shape[0]
    mask = (torch.arange(attend, device=q.device)[None, :] < lengths[:, None])[:, None, None, :]
    keys = k.index_select(0, slots)[:, :, :attend]
    values = v.index_select(0, slots)[:, :, :attend]
    return F.scaled_dot_product_attention(q.view(rows, KV_HEADS, GROUP, HEAD_DIM), keys, values, attn_mask=mask)


def time_case(rows: int, mean: int, max_len: int, sweep: bool, gen: torch.Generator) -> None:
    bytes_per_key = KV_HEADS * HEAD_DIM * 2 * 2
    n_sets = rotation_count(rows * mean * bytes_per_key, target_bytes=256 << 20, hi=32)
    k = torch.randn(rows * n_sets, KV_HEADS, max_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    slot_order = torch.randperm(rows * n_sets, device="cuda", generator=gen)
    sets = []
    for i in range(n_sets):
        q = torch.randn(rows, KV_HEADS * GROUP, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        lengths = (torch.rand(rows, device="cuda", generator=gen) * mean + mean / 2).clamp(1, max_len).int()
        sets.append((q, slot_order[i * rows:(i + 1) * rows], lengths, torch.empty_like(q)))
    attend = max(int(s[2].max()) for s in sets)
    gbytes = sum(float(s[2].sum()) for s in sets) / n_sets * bytes_per_key / 1e9

    def report(variant: str, fn, splits="", block="", warps="") -> None:
        us = graph_time(fn, Rotation(sets)).median_us
        print(f"{rows} {mean} {variant} {splits} {block} {warps} {us:.1f} {gbytes / (us * 1e-6):.0f}", flush=True)

    report("kernel", lambda s: decode_attention(s[0], k, v, s[1], s[2], out=s[3]),
           module.default_splits(rows, KV_HEADS, max_len, k.device), module.key_block(max_len), module.NUM_WARPS)
    report("sdpa_masked", lambda s: sdpa_masked(s[0], k, v, s[1], s[2], attend))
    if sweep:
        defaults = module.BLOCK_N, module.NUM_WARPS
        for splits, block, warps in itertools.product((1, 2, 4, 8, 16, 32, 64), (32, 64, 128), (4, 8)):
            module.BLOCK_N, module.NUM_WARPS = block, warps
            report("sweep", lambda s, n=splits: decode_attention(s[0], k, v, s[1], s[2], out=s[3], splits=n),
                   splits, block, warps)
        module.BLOCK_N, module.NUM_WARPS = defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    print("rows mean_len variant splits block warps us GB/s")
    for rows, mean in itertools.product((1, 8, 32, 128, 256), (512, 4096)):
        time_case(rows, mean, args.max_len, args.sweep, gen)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
