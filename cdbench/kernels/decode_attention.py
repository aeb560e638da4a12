"""Decode attention over a paged KV cache, each row to its own length (flash-decoding, GQA).

A continuous-batching decode batch has one query token per row, and every row
attends to positions ``0..length-1`` of its own request's cache. Masking every
row to the longest one (what a padded dense kernel does) reads the bytes of
the longest context for every row; this kernel reads each row's own length only.

The cache is paged as the engines page it (vLLM's blocks, SGLang's pages): the
keys of every layer live in ``[blocks, kv_heads, block_size, d]``, and a
request's position ``p`` is at offset ``p % block_size`` of its block
``block_table[request, p // block_size]``; a row names its request's row of the
block table (``slots``). Without a block table, ``slots`` name whole blocks of
``max_len`` keys: one block per request (a slot cache), the same kernel.

Launch shape and graphs: the lengths are read from a device tensor inside the
kernel and the launch shape depends only on tensor shapes and ``splits``, so a
call can be captured once in a CUDA graph per row count and replayed for any
lengths up to the cache's ``max_len``.

How the work is split:

- one program per (split, KV head, row): the ``G`` query heads that share a
  KV head are the rows of one ``tl.dot`` (padded to 16), so each key and
  value block is read once for the whole group;
- flash-decoding: a row's keys are cut into at most ``splits`` chunks of
  ``ceil(length / splits)`` keys, but of no fewer than ``min_split_keys``
  (both rounded up to a whole key block), each chunk an online softmax in fp32;
  programs whose chunk starts past the row's length return at once. ``splits``
  is fixed per launch (a graph serves every length up to the cache's); the
  floor makes a short row in a long cache split as it would in a cache only
  as long as the row, the way the calibration grid measures it (on an H100 the
  two take the same time within noise: reports/live/decode_split_floor_h100.csv);
- a second kernel merges the chunks' partial outputs by their log-sum-exp
  (skipped when ``splits`` is 1: the single chunk writes the output);
- longest rows first: the GPU hands out a grid's programs about in index
  order, row after row, and at large batches (one split) a ragged batch's long
  rows are single programs that read several times the keys of the others;
  handed out last, they run on after the rest have finished (on an H100, 8
  rows 3.5 times the mean long at the end of 64-128-row batches made the whole
  forward 0.6-4.6 % slower than with them at the start:
  reports/kv_capacity/step_gap_large_h100.csv). So the program at grid row
  ``i`` takes row ``order[i]``, the rows sorted by length longest first
  (longest-processing-time-first; sorted on the device, which a CUDA graph
  captures), and reads and writes at that row's own index. ``balance=False``
  keeps the row order (benchmarks compare the two); a caller that runs
  several layers over the same lengths sorts once (:func:`lpt_order`) and
  passes ``order``.

Examples
--------
>>> import torch
>>> q = torch.ones(1, 2, 16, dtype=torch.bfloat16)
>>> k = torch.zeros(3, 1, 8, 16, dtype=torch.bfloat16)
>>> v = torch.arange(8.0)[None, None, :, None].expand(3, 1, 8, 16).to(torch.bfloat16)
>>> out = decode_attention(q, k, v, slots=torch.tensor([2]), lengths=torch.tensor([4]))
>>> out[0, :, 0].tolist()   # equal scores: the mean of values 0..3
[1.5, 1.5]
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cdbench.kernels import reference
from cdbench.kernels._launch import sm_count, use_triton

_DTYPES = (torch.bfloat16, torch.float16)
#: Keys each program reads per step; with d = 128 a 64 × 128 bf16 block per operand keeps
#: enough bytes in flight per program without spilling registers. Caches shorter than
#: ``4 * BLOCK_N`` use smaller blocks (:func:`key_block`).
BLOCK_N = 64
#: Warps per split program: 4 warps cover a 16 × 64 score block and a 64 × 128 value block.
NUM_WARPS = 4
#: Software-pipelining depth of the key loop: on an H200 two stages beat Triton's default three by 3-30 %
#: at 16-128 rows of 2k-8k paged keys, and more stages gain nothing
#: (``benchmarks/bench_decode_attention.py --paged --sweep``, reports/calibration/README.md).
NUM_STAGES = 2
#: Fewest keys worth giving a split of their own: below this the partial write and the merge
#: cost more than the extra parallelism saves. One key block: on an H200, a decode batch of 1-8 rows at 512
#: cached keys took 11.7-20.0 µs a layer with it against 17.1-22.1 at 256 (its rows then got 2 splits,
#: each a serial walk of 256 keys), within 1 µs of the sweep's best at every shape of 1-16 rows and
#: 512-8,192 keys (``benchmarks/bench_decode_attention.py --paged --sweep``, reports/calibration/README.md).
MIN_KEYS_PER_SPLIT = 64
#: Most splits a row gets: the most the sweep measured (1-2 rows reach it at 2k+ keys).
MAX_SPLITS = 32
#: Programs per SM the default ``splits`` aims for at most, so each SM has several key streams in
#: flight while others wait on memory; past it the partials cost more than the streams gain (on an H200,
#: 16-64 rows at 8 programs per SM took 9-17 % longer than at 4).
PROGRAMS_PER_SM = 4


def default_splits(rows: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits per row: the largest power of two that keeps the (row, KV head, split) programs within
    :data:`PROGRAMS_PER_SM` per SM (at least 1), leaves :data:`MIN_KEYS_PER_SPLIT` keys per split of a
    full ``max_len`` row and is at most :data:`MAX_SPLITS`. Powers of two keep the number of compiled merge
    kernels small.

    1 off a GPU (the Triton interpreter runs programs one after another).
    """
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    wanted = max(1, PROGRAMS_PER_SM * sm_count(index) // max(1, rows * kv_heads))
    most = max(1, max_len // MIN_KEYS_PER_SPLIT)
    return 1 << (min(wanted, most, MAX_SPLITS).bit_length() - 1)


def key_block(max_len: int) -> int:
    """Keys per block: :data:`BLOCK_N`, or less for a short cache so that it still holds 4 blocks
    (splits are whole blocks, so a cache of one block could not be split at all)."""
    return min(BLOCK_N, max(16, triton.next_power_of_2(max_len) // 4))


def lpt_order(lengths: torch.Tensor) -> torch.Tensor:
    """The rows by length, longest first: the order :func:`decode_attention` launches them in
    (on the device, no synchronization, so a CUDA graph can capture it).

    >>> lpt_order(torch.tensor([3, 9, 1, 5])).tolist()
    [1, 3, 0, 2]
    """
    return torch.argsort(lengths, descending=True)


@triton.jit
def _chunk(length, splits, min_blocks, BLOCK_N: tl.constexpr):
    """Keys per split of a row of ``length`` keys: a whole number of blocks, at least ``min_blocks``."""
    per_split = tl.cdiv(length, splits)
    return tl.maximum(tl.cdiv(per_split, BLOCK_N), min_blocks) * BLOCK_N


@triton.jit
def _decode_split(
    q_ptr, k_ptr, v_ptr, slots_ptr, lengths_ptr, order_ptr, table_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    max_len, splits, min_blocks, group, head_dim, qk_scale, table_row,
    q_row, q_head, k_slot, k_head, k_pos, v_slot, v_head, v_pos, o_row, o_head,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DIRECT: tl.constexpr,
    ORDERED: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    if ORDERED:
        # Grid row i runs the i-th longest row; everything below reads and writes at the row's own index
        # (clamped, as the lengths are: a GPU order is not checked).
        row = tl.minimum(tl.maximum(tl.load(order_ptr + tl.program_id(2)).to(tl.int32), 0), tl.num_programs(2) - 1)
    else:
        row = tl.program_id(2)
    # Clamped, not checked: a check would synchronize, and a clamp keeps reads inside the slot.
    length = tl.minimum(tl.maximum(tl.load(lengths_ptr + row).to(tl.int32), 0), max_len)
    chunk = _chunk(length, splits, min_blocks, BLOCK_N)
    start = split * chunk
    # Split 0 always runs, so that a row of length 0 still gets its (zero) output written.
    if (start >= length) & (split > 0):
        return
    end = tl.minimum(start + chunk, length)
    slot = tl.load(slots_ptr + row).to(tl.int64)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    g_ok = g < group
    d_ok = d < head_dim
    q = tl.load(q_ptr + row.to(tl.int64) * q_row + heads[:, None] * q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + kv_head.to(tl.int64) * k_head
    v_base = v_ptr + kv_head.to(tl.int64) * v_head
    if not PAGED:
        k_base += slot * k_slot
        v_base += slot * v_slot

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        if PAGED:
            # each key's block from the request's row of the block table, then its offset in the block
            block = tl.load(table_ptr + slot * table_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)
            k_at = block * k_slot + (n % PAGE) * k_pos
            v_at = block * v_slot + (n % PAGE) * v_pos
        else:
            k_at = n * k_pos
            v_at = n * v_pos
        k = tl.load(k_base + k_at[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        # Scores in log2 units (scale folded with log2(e)) so the softmax uses exp2.
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        v = tl.load(v_base + v_at[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new

    # l is 0 only for a row of length 0 (split 0 ran no block): output 0, log-sum-exp -inf.
    l = tl.where(l > 0, l, 1.0)
    acc = acc / l[:, None]
    if DIRECT:
        tl.store(out_ptr + row.to(tl.int64) * o_row + heads[:, None] * o_head + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        n_heads = tl.num_programs(1) * group
        part = (row.to(tl.int64) * n_heads + heads) * splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(part_lse_ptr + part, m + tl.math.log2(l), mask=g_ok)


@triton.jit
def _decode_merge(
    part_out_ptr, part_lse_ptr, lengths_ptr, out_ptr, max_len, splits, min_blocks, n_heads, head_dim, o_row, o_head,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    head = tl.program_id(0)
    row = tl.program_id(1)
    length = tl.minimum(tl.maximum(tl.load(lengths_ptr + row).to(tl.int32), 0), max_len)
    # The splits that ran (the others returned before writing their partials).
    n_valid = tl.cdiv(length, _chunk(length, splits, min_blocks, BLOCK_N))
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < n_valid
    part = (row.to(tl.int64) * n_heads + head) * splits + s
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    # A row of length 0 has no partials: max() of all -inf, weights 0, output 0.
    lse_max = tl.maximum(tl.max(lse, axis=0), -1e30)
    w = tl.where(s_ok, tl.math.exp2(lse - lse_max), 0.0)
    o = tl.load(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    merged = tl.sum(o * w[:, None], axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(out_ptr + row.to(tl.int64) * o_row + head * o_head + d, merged.to(out_ptr.dtype.element_ty),
             mask=d < head_dim)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           lengths: torch.Tensor, out: torch.Tensor | None, block_table: torch.Tensor | None) -> int:
    """Raise on inputs the kernel cannot take; returns the most keys a row can have."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"want q [rows, heads, d] and equal caches [blocks, kv_heads, block_size, d], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    rows, n_heads, d = q.shape
    n_blocks, kv_heads, block_size, cache_d = k_cache.shape
    if cache_d != d or n_heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} "
                         "(head_dim must match; heads must be a multiple of kv_heads)")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q and caches must share one of bfloat16/float16, got {q.dtype}, {k_cache.dtype}, "
                        f"{v_cache.dtype}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q and the caches must be contiguous along head_dim")
    for name, index in (("slots", slots), ("lengths", lengths)):
        if index.dim() != 1 or index.shape[0] != rows or index.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32/int64 [{rows}], got {index.dtype} {tuple(index.shape)}")
    n_slots, max_len = n_blocks, block_size
    if block_table is not None:
        if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64) or \
                block_table.stride(1) != 1:
            raise TypeError(f"block_table must be int32/int64 [requests, blocks] contiguous along its blocks, got "
                            f"{block_table.dtype} {tuple(block_table.shape)}")
        n_slots, max_len = block_table.shape[0], block_table.shape[1] * block_size
        if block_table.device.type == "cpu" and block_table.numel() and \
                (int(block_table.min()) < 0 or int(block_table.max()) >= n_blocks):
            raise IndexError(f"block_table entries must lie in [0, {n_blocks})")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} contiguous along head_dim, "
                         f"got {out.dtype} {tuple(out.shape)}")
    # Values on a GPU are not checked (that would synchronize the stream); the kernel clamps lengths.
    if slots.device.type == "cpu" and rows and (int(slots.min()) < 0 or int(slots.max()) >= n_slots):
        raise IndexError(f"slots must lie in [0, {n_slots}), got {slots.tolist()}")
    if lengths.device.type == "cpu" and rows and (int(lengths.min()) < 0 or int(lengths.max()) > max_len):
        raise IndexError(f"lengths must lie in [0, {max_len}], got {lengths.tolist()}")
    return max_len


def _check_order(order: torch.Tensor | None, balance: bool, lengths: torch.Tensor) -> None:
    if order is None:
        return
    if not balance:
        raise ValueError("order is the balanced launch's: pass it with balance=True, or neither")
    rows = lengths.shape[0]
    if order.dim() != 1 or order.shape[0] != rows or order.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"order must be int32/int64 [{rows}], got {order.dtype} {tuple(order.shape)}")
    if order.device != lengths.device:
        raise ValueError(f"order must be on the lengths' device {lengths.device}, got {order.device}")
    # Like lengths, a GPU order is not checked (that would synchronize the stream).
    if order.device.type == "cpu" and not torch.equal(order.sort().values, torch.arange(rows, dtype=order.dtype)):
        raise IndexError(f"order must be a permutation of the {rows} rows, got {order.tolist()}")


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor | None = None,
    scale: float | None = None,
    splits: int | None = None,
    min_split_keys: int | None = None,
    balance: bool = True,
    order: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each decode row's query over the first ``lengths[r]`` keys of request ``slots[r]``.

    Parameters
    ----------
    q : bfloat16/float16 ``[rows, n_heads, d]``, one query token per row.
    k_cache, v_cache : ``[blocks, kv_heads, block_size, d]``, same dtype as ``q``; query head ``h``
        reads KV head ``h // (n_heads // kv_heads)``.
    slots : int32/int64 ``[rows]``, each row's request: its row of ``block_table``, or without one
        its block (a slot of ``block_size`` = ``max_len`` keys).
    lengths : int32/int64 ``[rows]``, keys each row attends to (positions ``0..length-1``; the new
        token's key is already at ``length - 1``). A row of length 0 (a padding row of a captured
        batch) gets zeros. Values on a GPU are not checked; they are clamped to ``[0, max_len]``,
        ``max_len`` being the block table's width times ``block_size`` (``block_size`` without one).
    out : optional ``[rows, n_heads, d]`` buffer of ``q``'s dtype to write (a graph's static output).
    scale : softmax scale, default ``1 / sqrt(d)``.
    splits : chunks each row's keys are cut into (:func:`default_splits` when None); fixed per
        launch so a captured graph replays for any lengths.
    min_split_keys : fewest keys in a row's chunk (rounded up to a key block; default
        :data:`MIN_KEYS_PER_SPLIT`): shorter rows use fewer than ``splits`` chunks.
    balance : launch the rows longest first (the module doc); False: in row order. The output
        is the same either way, bit for bit.
    order : with ``balance``, the launch order when the caller has it (``lpt_order(lengths)``,
        sorted once for all layers of a step); computed here when None. int32/int64 ``[rows]``,
        a permutation of the rows (checked on the CPU only).
    block_table : optional int32/int64 ``[requests, blocks]``: request ``s``'s position ``p`` is at
        offset ``p % block_size`` of block ``block_table[s, p // block_size]``. Entries past a
        request's length are not read; on a GPU they are not checked.

    Returns
    -------
    ``out`` (allocated when not given).
    """
    max_len = _check(q, k_cache, v_cache, slots, lengths, out, block_table)
    _check_order(order, balance, lengths)
    least = MIN_KEYS_PER_SPLIT if min_split_keys is None else min_split_keys
    if least < 1 or (splits is not None and splits < 1):
        raise ValueError(f"splits and min_split_keys must be at least 1, got {splits} and {least}")
    rows, n_heads, d = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if out is None:
        out = torch.empty_like(q)
    tables = () if block_table is None else (block_table,)
    if not use_triton(q, k_cache, v_cache, slots, lengths, out, *tables):
        return reference.decode_attention_reference(q, k_cache, v_cache, slots, lengths, out, scale, block_table)
    if rows == 0 or n_heads == 0:
        return out
    if splits is None:
        splits = default_splits(rows, kv_heads, max_len, q.device)
    group = n_heads // kv_heads
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(d))
    direct = splits == 1
    block_n = key_block(max_len)
    min_blocks = -(-least // block_n)
    if balance and order is None:
        order = lpt_order(lengths)
    if direct:
        part_out = part_lse = out  # unused: the single split writes ``out``
    else:
        part_out = torch.empty(rows, n_heads, splits, block_d, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(rows, n_heads, splits, device=q.device, dtype=torch.float32)
    paged = block_table is not None
    _decode_split[(splits, kv_heads, rows)](
        q, k_cache, v_cache, slots, lengths, order if balance else lengths, block_table if paged else lengths,
        out, part_out, part_lse, max_len, splits, min_blocks, group, d, scale * math.log2(math.e),
        block_table.stride(0) if paged else 0,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, DIRECT=direct, ORDERED=balance,
        PAGE=block_size if paged else 1, PAGED=paged, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if not direct:
        _decode_merge[(n_heads, rows)](
            part_out, part_lse, lengths, out, max_len, splits, min_blocks, n_heads, d, out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_N=block_n, BLOCK_D=block_d, num_warps=1,
        )
    return out
