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

``--paged``: the live forward's path instead, at the reference forward's decode shapes
(``benchmarks/reference_forward.py``: every row ``kv`` cached keys, rows × kv at most
2^18): the kernel over a paged cache of 16-token blocks (each row's blocks in a row of the
block table, as a fresh pool hands them out), against the reference's attention (torch's
``scaled_dot_product_attention`` over a contiguous cache, flash attention on a Hopper GPU);
with ``--sweep`` every splits × key block × warps × pipeline stages × fewest keys a split of the paged kernel.

Run on a GPU host from the repo root: ``python benchmarks/bench_decode_attention.py [--paged] [--sweep]``.
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


def time_paged_case(rows: int, kv: int, sweep: bool, gen: torch.Generator, block_size: int = 16) -> None:
    bytes_per_key = KV_HEADS * HEAD_DIM * 2 * 2
    n_sets = rotation_count(rows * kv * bytes_per_key, target_bytes=256 << 20, hi=32)
    per_row = -(-kv // block_size)
    k = torch.randn(rows * per_row * n_sets, KV_HEADS, block_size, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                    generator=gen)
    v = torch.randn_like(k)
    lengths = torch.full((rows,), kv, device="cuda", dtype=torch.int32)
    slots = torch.arange(rows, device="cuda", dtype=torch.int32)
    sets = []
    for i in range(n_sets):
        q = torch.randn(rows, KV_HEADS * GROUP, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        table = (torch.arange(rows * per_row, device="cuda", dtype=torch.int32) + i * rows * per_row).view(rows, -1)
        contiguous = tuple(torch.randn(rows, KV_HEADS, kv, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                                       generator=gen) for _ in range(2)) if i < 2 else None
        sets.append((q, table, torch.empty_like(q), contiguous))
    gbytes = rows * kv * bytes_per_key / 1e9

    def report(variant: str, fn, rotation, splits="", block="", warps="", stages="", least="") -> None:
        us = graph_time(fn, rotation).median_us
        print(f"{rows} {kv} {variant} {splits} {block} {warps} {stages} {least} {us:.1f} "
              f"{gbytes / (us * 1e-6):.0f}", flush=True)

    def paged(s, n=None, least=None):
        return decode_attention(s[0], k, v, slots, lengths, out=s[2], splits=n, block_table=s[1],
                                min_split_keys=least)

    report("paged", paged, Rotation(sets), module.default_splits(rows, KV_HEADS, kv, k.device),
           module.key_block(kv), module.NUM_WARPS, module.NUM_STAGES)
    # the reference's attention, two caches in turn (a contiguous cache a set would not fit the device)
    # (as the reference does: a KV head's G query heads are its G query positions, one read of its keys)
    report("reference_sdpa", lambda s: F.scaled_dot_product_attention(
        s[0].view(rows, KV_HEADS, GROUP, HEAD_DIM), *s[3]), Rotation(sets[:2]))
    if sweep:
        defaults = module.BLOCK_N, module.NUM_WARPS, module.NUM_STAGES
        for splits, block, warps, stages, least in itertools.product((1, 2, 4, 8, 16, 32), (16, 32, 64, 128), (2, 4),
                                                                     (2,), (16, 64, 256)):
            if least < block and least != 16:
                continue  # rounded up to the block: the same launch as the row with 16
            module.BLOCK_N, module.NUM_WARPS, module.NUM_STAGES = block, warps, stages
            report("sweep", lambda s, n=splits, m=least: paged(s, n, m), Rotation(sets), splits, block, warps, stages,
                   least)
        module.BLOCK_N, module.NUM_WARPS, module.NUM_STAGES = defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--paged", action="store_true", help="the paged path at the reference forward's shapes")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--kv", type=int, nargs="+", default=[512, 2048, 8192])
    args = parser.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    if args.paged:
        print("rows kv variant splits block warps stages min_split_keys us GB/s")
        for kv, rows in itertools.product(args.kv, args.rows):
            if rows * kv <= 2**18:
                time_paged_case(rows, kv, args.sweep, gen)
                torch.cuda.empty_cache()
        return
    print("rows mean_len variant splits block warps us GB/s")
    for rows, mean in itertools.product((1, 8, 32, 128, 256), (512, 4096)):
        time_case(rows, mean, args.max_len, args.sweep, gen)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
