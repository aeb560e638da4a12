"""Where the time goes for sparse masks at B = 64, and which launch shape is fastest there.

Times the shipped ``apply_bitmask`` kernel at several launch shapes, a persistent
(grid-stride) variant of its skip path with (SMs × k) programs that loads the next
tile's bitmask words before working on the current tile, and streaming cache hints;
each under do_bench (as ``cdbench kernels`` does) and CUDA-graph replay, with an
empty launch and a same-size copy for the fixed cost. Every configuration is first
compared with the torch reference on fresh inputs. Prints one line per
(case, configuration). Run on a GPU host from the repo root:
``python benchmarks/kernels_b64_explore.py``.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch
import triton
import triton.language as tl

from cdbench.kernels import apply_bitmask, reference
from cdbench.kernels._launch import sm_count
from cdbench.kernels.bench import Case, make_inputs
from cdbench.kernels.bitmask import _apply_bitmask_packs
from cdbench.kernels.timing import (
    Rotation,
    copy_bandwidth_gbs,
    event_time,
    graph_time,
    rotation_count,
)


@triton.jit
def _tile_words(bitmask_ptr, tile, n_tiles, n_col_blocks, n_words, bitmask_stride,
                PACK: tl.constexpr, BLOCK: tl.constexpr):
    row = (tile // n_col_blocks).to(tl.int64)
    word_idx = ((tile % n_col_blocks) * BLOCK + tl.arange(0, BLOCK // PACK) * PACK) // 32
    n_valid = tl.where(tile < n_tiles, n_words, 0)  # past the last tile: load nothing
    return tl.load(bitmask_ptr + row * bitmask_stride + word_idx, mask=word_idx < n_valid, other=0)


@triton.jit
def _tile_apply(logits_ptr, tile, word, n_col_blocks, n_cols, logits_stride,
                PACK: tl.constexpr, BLOCK: tl.constexpr, STREAM: tl.constexpr):
    row = (tile // n_col_blocks).to(tl.int64)
    pack_start = (tile % n_col_blocks) * BLOCK + tl.arange(0, BLOCK // PACK) * PACK
    pack_bits = (word.to(tl.uint32, bitcast=True) >> (pack_start % 32).to(tl.uint32)) & ((1 << PACK) - 1)
    lane = tl.arange(0, PACK)
    cols = pack_start[:, None] + lane[None, :]
    allowed = ((pack_bits[:, None] >> lane[None, :].to(tl.uint32)) & 1) != 0
    in_row = cols < n_cols
    load_mask = in_row & (pack_bits != 0)[:, None]
    store_mask = in_row & (pack_bits != (1 << PACK) - 1)[:, None]
    ptrs = logits_ptr + row * logits_stride + cols
    if STREAM:
        x = tl.load(ptrs, mask=load_mask, other=float("-inf"), eviction_policy="evict_first")
        tl.store(ptrs, tl.where(allowed, x, float("-inf")), mask=store_mask, cache_modifier=".cs")
    else:
        x = tl.load(ptrs, mask=load_mask, other=float("-inf"))
        tl.store(ptrs, tl.where(allowed, x, float("-inf")), mask=store_mask)


@triton.jit(do_not_specialize=["n_rows", "n_words", "bitmask_stride"])
def _skip_tiles(logits_ptr, bitmask_ptr, n_rows, n_cols, n_words, logits_stride, bitmask_stride,
                PACK: tl.constexpr, BLOCK: tl.constexpr, PERSISTENT: tl.constexpr, STREAM: tl.constexpr):
    """Skip-mode apply over tiles (row, column block); one tile per program, or grid-stride."""
    n_col_blocks = tl.cdiv(n_cols, BLOCK)
    n_tiles = n_rows * n_col_blocks
    pid = tl.program_id(0)
    if PERSISTENT:
        step = tl.num_programs(0)
        word = _tile_words(bitmask_ptr, pid, n_tiles, n_col_blocks, n_words, bitmask_stride, PACK, BLOCK)
        for tile in range(pid, n_tiles, step):
            # the next tile's words are in flight while this tile's logits load waits on its own
            nxt = _tile_words(bitmask_ptr, tile + step, n_tiles, n_col_blocks, n_words, bitmask_stride, PACK, BLOCK)
            _tile_apply(logits_ptr, tile, word, n_col_blocks, n_cols, logits_stride, PACK, BLOCK, STREAM)
            word = nxt
    else:
        word = _tile_words(bitmask_ptr, pid, n_tiles, n_col_blocks, n_words, bitmask_stride, PACK, BLOCK)
        _tile_apply(logits_ptr, pid, word, n_col_blocks, n_cols, logits_stride, PACK, BLOCK, STREAM)


@triton.jit
def _noop(x_ptr):
    pass


def shipped(kind: str, block: int, warps: int, pack_bytes: int):
    def run(s) -> None:
        n_rows, n_cols = s.logits.shape
        pack = pack_bytes // s.logits.element_size()
        _apply_bitmask_packs[(triton.cdiv(n_cols, block), n_rows)](
            s.logits, s.bitmask, None, n_cols, s.bitmask.shape[1], s.logits.stride(0), s.bitmask.stride(0), 1,
            HAS_INDICES=False, PACK=pack, BLOCK=block, SKIP=kind != "rmw", ADAPTIVE=kind == "adaptive",
            num_warps=warps)
    return run


def tiles(block: int, warps: int, pack_bytes: int, programs_per_sm: int, stream: bool):
    def run(s) -> None:
        n_rows, n_cols = s.logits.shape
        n_tiles = n_rows * triton.cdiv(n_cols, block)
        grid = (min(n_tiles, programs_per_sm * sm_count(s.logits.device.index or 0)) if programs_per_sm else n_tiles,)
        _skip_tiles[grid](s.logits, s.bitmask, n_rows, n_cols, s.bitmask.shape[1], s.logits.stride(0),
                          s.bitmask.stride(0), PACK=pack_bytes // s.logits.element_size(), BLOCK=block,
                          PERSISTENT=programs_per_sm > 0, STREAM=stream, num_warps=warps)
    return run


def configs(case: Case) -> list[tuple[str, object]]:
    fp32 = case.elem == 4
    out: list[tuple[str, object]] = [("copy", lambda s: s.dst.copy_(s.logits)),
                                     ("auto(wrapper)", lambda s: apply_bitmask(s.logits, s.bitmask))]
    current = ("adaptive", 2048, 4, 16) if fp32 else ("skip", 4096, 8, 32)
    out.append(("shipped " + "/".join(map(str, current)), shipped(*current)))
    wide = case.batch <= 64
    if wide:
        blocks = (1024, 2048, 4096) if fp32 else (2048, 4096, 8192)
        for block, warps, pack in itertools.product(blocks, (4, 8), (16, 32)):
            out.append((f"shipped skip/{block}/{warps}/{pack}", shipped("skip", block, warps, pack)))
        if fp32:
            out += [(f"shipped adaptive/{b}/{w}/16", shipped("adaptive", b, w, 16)) for b, w in ((1024, 4), (2048, 8))]
    out.append(("shipped rmw/8192/8/16", shipped("rmw", 8192, 8, 16)))
    out.append(("tiles grid/2048/8", tiles(2048, 8, 32 if not fp32 else 16, 0, False)))
    out.append(("tiles grid/2048/8 stream", tiles(2048, 8, 32 if not fp32 else 16, 0, True)))
    pers = itertools.product((1024, 2048, 4096), (4, 8), (2, 4, 8, 16)) if wide else \
        itertools.product((2048, 4096), (8,), (4, 8))
    for block, warps, k in pers:
        out.append((f"persist {block}/{warps} k={k}", tiles(block, warps, 32 if not fp32 else 16, k, False)))
    for k in (4, 8):
        out.append((f"persist 2048/8 k={k} stream", tiles(2048, 8, 32 if not fp32 else 16, k, True)))
    # repeated at the end: the spread between the two is the noise of this case
    out.append(("shipped " + "/".join(map(str, current)) + " again", shipped(*current)))
    return out


def host_us(fn, s, calls: int = 200) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(s)
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def main() -> None:
    rng = np.random.default_rng(0)
    copy_gbs = copy_bandwidth_gbs()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; copy {copy_gbs:.0f} GB/s; "
          f"torch {torch.__version__}, triton {triton.__version__}")
    buf = torch.empty(1, device="cuda")
    noop = Rotation([buf])
    _noop[(1,)](buf)
    print(f"empty launch: do_bench {event_time(lambda b: _noop[(1,)](b), noop, 5, 20).median_us:.2f} us, "
          f"graph {graph_time(lambda b: _noop[(1,)](b), Rotation([buf] * 64)).median_us:.2f} us")
    tiny = Rotation([(torch.empty(8, device="cuda"), torch.empty(8, device="cuda"))] * 64)
    print(f"32-byte copy: do_bench {event_time(lambda p: p[1].copy_(p[0]), tiny, 5, 20).median_us:.2f} us, "
          f"graph {graph_time(lambda p: p[1].copy_(p[0]), tiny).median_us:.2f} us")
    cases = [Case(v, 64, d, "sparse") for d in ("bf16", "fp32") for v in (129280, 151936, 248320)]
    cases += [Case(151936, b, d, "sparse") for b in (256, 1024) for d in ("bf16", "fp32")]
    print("vocab dtype batch config event_us graph_us evt%fl graph%fl host_us ok")
    for case in cases:
        floor = case.floor_bytes / (copy_gbs * 1e3)
        sets = make_inputs(case, rotation_count(case.batch * case.vocab * case.elem), rng, "cuda", with_dst=True)
        fresh = make_inputs(case, 1, rng, "cuda", with_dst=True)[0]
        expected = fresh.logits.clone()
        reference.apply_bitmask_ref(expected, fresh.bitmask)
        for name, fn in configs(case):
            trial = type(fresh)(fresh.logits.clone(), fresh.bitmask, fresh.half_rows, torch.empty_like(fresh.logits))
            fn(trial)
            ok = torch.equal(trial.dst, fresh.logits) if name == "copy" else torch.equal(trial.logits, expected)
            ev = event_time(fn, Rotation(sets), 5, 20).median_us
            gr = graph_time(fn, Rotation(sets[:64])).median_us
            # host µs per call: the wrapper against a direct launch of the kernel it picks
            timed_host = name in ("auto(wrapper)", "copy") or name.startswith(
                ("shipped skip/4096/8/32", "shipped adaptive/2048/4/16"))
            host = host_us(fn, sets[0]) if timed_host else float("nan")
            print(f"{case.vocab} {case.dtype} {case.batch} {name.replace(' ', '_')} {ev:.2f} {gr:.2f} "
                  f"{100 * floor / ev:.0f} {100 * floor / gr:.0f} {host:.1f} {'ok' if ok else 'MISMATCH'}",
                  flush=True)
        del sets, fresh, expected
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
