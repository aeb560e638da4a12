"""Launch-shape sweep of the apply-bitmask kernels (block size, warps, pack width, store threshold).

Used to choose the defaults in ``cdbench/kernels/bitmask.py``; prints one line per configuration.
Run on a GPU host from the repo root: ``python benchmarks/kernels_block_sweep.py``.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
import triton

from cdbench.kernels import reference
from cdbench.kernels.bench import Case, make_inputs
from cdbench.kernels.bitmask import _apply_bitmask_packs, _apply_bitmask_store
from cdbench.kernels.timing import Rotation, event_time, rotation_count


def launch(kind: str, s, block: int, warps: int, pack: int, eighths: int) -> None:
    n_rows, n_cols = s.logits.shape
    grid = (triton.cdiv(n_cols, block), n_rows)
    args = (s.logits, s.bitmask, None, n_cols, s.bitmask.shape[1], s.logits.stride(0), s.bitmask.stride(0), 1)
    if kind == "store":
        _apply_bitmask_store[grid](*args, HAS_INDICES=False, BLOCK=block, num_warps=warps)
    else:
        _apply_bitmask_packs[grid](*args, HAS_INDICES=False, PACK=pack, BLOCK=block, SKIP=kind != "rmw",
                                   ADAPTIVE=kind == "adaptive", STORE_EIGHTHS=eighths, num_warps=warps)


def main() -> None:
    rng = np.random.default_rng(0)
    configs = [("store", b, w, 0, 0) for b, w in itertools.product((1024, 2048, 4096), (4, 8))]
    for kind, block, warps, wide in itertools.product(("rmw", "skip", "adaptive"), (2048, 4096, 8192), (4, 8),
                                                     (False, True)):
        configs.append((kind, block, warps, wide, 7))
    configs += [("adaptive", 4096, 4, False, 6), ("adaptive", 4096, 4, False, 8)]
    print("vocab dtype batch density kind block warps pack eighths us")
    for vocab, dtype, batch, density in itertools.product((151936, 248320), ("bf16", "fp32"), (64, 1024),
                                                          ("sparse", "dense")):
        case = Case(vocab, batch, dtype, density)
        sets = make_inputs(case, rotation_count(batch * vocab * case.elem), rng, "cuda", with_dst=False)
        fresh = make_inputs(case, 1, rng, "cuda", with_dst=False)[0]
        expected = fresh.logits.clone()
        reference.apply_bitmask_ref(expected, fresh.bitmask)
        for kind, block, warps, wide, eighths in configs:
            pack = (32 if wide else 16) // case.elem
            got = fresh.logits.clone()
            launch(kind, type(fresh)(got, fresh.bitmask, fresh.half_rows), block, warps, pack, eighths)
            ok = torch.equal(got, expected)
            t = event_time(lambda s: launch(kind, s, block, warps, pack, eighths), Rotation(sets), 5, 15)
            print(vocab, dtype, batch, density, kind, block, warps, pack, eighths, f"{t.median_us:.1f}",
                  "" if ok else "MISMATCH", flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
