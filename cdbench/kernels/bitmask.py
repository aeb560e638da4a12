"""Apply a grammar mask to logits in place: int32 bitmask or bool mask, all rows or some.

The bitmask kernel works on packs of 16 or 32 bytes (4-8 fp32 or 8-16
bf16/fp16 logits), so every thread moves whole vectors, and each pack's bits
come from one bitmask word. Strategies (``mode``):

``"auto"`` (default)
    ``"rmw"`` for small launches (see :data:`ADAPTIVE_MIN_BYTES`); for larger
    ones ``"adaptive"`` with fp32 logits and ``"skip"`` with 16-bit logits
    (where the adaptive kernel's extra reduction costs more than it saves;
    measured in reports/kernels/README.md).
``"adaptive"``
    per block of tokens: ``"store"`` where at least 7/8 of the block is
    allowed, ``"skip"`` elsewhere.
``"skip"``
    read-modify-write, but packs whose tokens are all disallowed are written
    as -inf without being read, and packs whose tokens are all allowed are
    neither read nor written. Never moves more bytes than ``"rmw"``.
``"rmw"``
    read every pack, write every pack (the byte floor: bitmask + 2 × logits).
``"store"``
    never read logits; store -inf only at disallowed tokens, one token per
    lane so a warp's store covers consecutive tokens. Wins for dense masks
    (few disallowed tokens), loses for sparse ones.

Columns past the bitmask's vocabulary (``logits.shape[1] > 32 * W``, a padded
output layer) are disallowed.

Examples
--------
>>> import torch
>>> from cdbench.kernels import apply_bitmask
>>> logits = torch.zeros(2, 70)
>>> bitmask = torch.tensor([[1, 0, 0], [-1, -1, -1]], dtype=torch.int32)
>>> apply_bitmask(logits, bitmask, indices=[0])
>>> int(torch.isfinite(logits[0]).sum()), int(torch.isfinite(logits[1]).sum())
(1, 70)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import triton
import triton.language as tl

from cdbench.kernels import reference
from cdbench.kernels._launch import (
    as_index_tensor,
    check_bitmask,
    check_logits,
    pick_block,
    use_triton,
)

ApplyMode = Literal["auto", "adaptive", "skip", "rmw", "store"]
_MODES = ("auto", "adaptive", "skip", "rmw", "store")
#: Logits bytes from which ``mode="auto"`` is ``"adaptive"`` rather than ``"rmw"``. Skipping makes
#: each logits access wait for its bitmask word; in a launch this small that extra memory latency
#: costs more than the bytes it saves (measured: reports/kernels/README.md).
ADAPTIVE_MIN_BYTES = 1 << 20
# (mode, logits element bytes) -> (largest block of tokens, warps, bytes per thread access), from
# the launch-shape sweep on an H100 (benchmarks/kernels_block_sweep.py, reports/kernels/README.md).
_LAUNCH = {
    ("skip", 2): (4096, 8, 32),
    ("skip", 4): (2048, 8, 16),
    ("adaptive", 2): (2048, 4, 16),
    ("adaptive", 4): (2048, 4, 16),
    ("store", 2): (2048, 8, 0),
    ("store", 4): (1024, 8, 0),
}
_LAUNCH_DEFAULT = (8192, 8, 16)


@triton.jit
def _store_neg_inf_lanes(logits_row, bitmask_row, col0, n_cols, n_words, one, BLOCK: tl.constexpr):
    """Store -inf at the disallowed tokens of ``[col0, col0 + BLOCK)`` without reading logits."""
    # Multiplying by a run-time 1 hides contiguity from the compiler, so it gives each lane one
    # token (a warp stores 32 consecutive tokens) instead of per-thread vectors of scalar stores.
    cols = (col0 + tl.arange(0, BLOCK)) * one
    word_idx = cols // 32
    word = tl.load(bitmask_row + word_idx, mask=word_idx < n_words, other=0)
    allowed = ((word.to(tl.uint32, bitcast=True) >> (cols % 32).to(tl.uint32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), logits_row.dtype.element_ty)
    tl.store(logits_row + cols, neg_inf, mask=(cols < n_cols) & ~allowed)


@triton.jit(do_not_specialize=["one"])
def _apply_bitmask_packs(
    logits_ptr, bitmask_ptr, indices_ptr, n_cols, n_words, logits_stride, bitmask_stride, one,
    HAS_INDICES: tl.constexpr, PACK: tl.constexpr, BLOCK: tl.constexpr, SKIP: tl.constexpr,
    ADAPTIVE: tl.constexpr, STORE_EIGHTHS: tl.constexpr = 7,
):
    if HAS_INDICES:
        row = tl.load(indices_ptr + tl.program_id(1)).to(tl.int64)
    else:
        row = tl.program_id(1).to(tl.int64)
    logits_row = logits_ptr + row * logits_stride
    bitmask_row = bitmask_ptr + row * bitmask_stride
    col0 = tl.program_id(0) * BLOCK
    pack_start = col0 + tl.arange(0, BLOCK // PACK) * PACK
    word_idx = pack_start // 32
    word = tl.load(bitmask_row + word_idx, mask=word_idx < n_words, other=0)
    # PACK divides 32, so a pack's bits never straddle two words.
    pack_bits = (word.to(tl.uint32, bitcast=True) >> (pack_start % 32).to(tl.uint32)) & ((1 << PACK) - 1)
    lane = tl.arange(0, PACK)
    cols = pack_start[:, None] + lane[None, :]
    allowed = ((pack_bits[:, None] >> lane[None, :].to(tl.uint32)) & 1) != 0
    in_row = cols < n_cols
    store_only = False
    if ADAPTIVE:
        # Mostly-allowed blocks: writing -inf at the few disallowed tokens beats reading everything.
        n_allowed = tl.sum(tl.sum((allowed & in_row).to(tl.int32), axis=1), axis=0)
        store_only = n_allowed * 8 >= tl.minimum(n_cols - col0, BLOCK) * STORE_EIGHTHS
    if store_only:
        _store_neg_inf_lanes(logits_row, bitmask_row, col0, n_cols, n_words, one, BLOCK)
    else:
        if SKIP:
            # Per-pack predicates keep each thread's 16 B access a single vector load/store: packs
            # with no allowed token are not read, packs with every token allowed are not written.
            load_mask = in_row & (pack_bits != 0)[:, None]
            store_mask = in_row & (pack_bits != (1 << PACK) - 1)[:, None]
        else:
            load_mask = in_row
            store_mask = in_row
        x = tl.load(logits_row + cols, mask=load_mask, other=float("-inf"))
        tl.store(logits_row + cols, tl.where(allowed, x, float("-inf")), mask=store_mask)


@triton.jit(do_not_specialize=["one"])
def _apply_bitmask_store(
    logits_ptr, bitmask_ptr, indices_ptr, n_cols, n_words, logits_stride, bitmask_stride, one,
    HAS_INDICES: tl.constexpr, BLOCK: tl.constexpr,
):
    if HAS_INDICES:
        row = tl.load(indices_ptr + tl.program_id(1)).to(tl.int64)
    else:
        row = tl.program_id(1).to(tl.int64)
    _store_neg_inf_lanes(logits_ptr + row * logits_stride, bitmask_ptr + row * bitmask_stride,
                         tl.program_id(0) * BLOCK, n_cols, n_words, one, BLOCK)


def apply_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | Sequence[int] | None = None,
    *,
    mode: ApplyMode = "auto",
) -> None:
    """Set disallowed logits to -inf in place.

    Parameters
    ----------
    logits : float32 / bfloat16 / float16 ``[B, V']``, rows contiguous.
    bitmask : int32 ``[B, W]``; bit ``t % 32`` of word ``t // 32`` is 1 when token ``t`` is allowed.
        Columns ``t >= 32 * W`` are disallowed.
    indices : rows to mask (others are left untouched); default all rows.
    mode : ``"auto"``, ``"adaptive"``, ``"skip"``, ``"rmw"`` or ``"store"`` (see the module docstring);
        all give the same result.
    """
    check_logits(logits)
    check_bitmask(bitmask, logits.shape[0])
    if mode not in _MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {sorted(_MODES)}")
    rows = as_index_tensor(indices, logits.shape[0], logits.device, "indices")
    if not use_triton(logits, bitmask):
        reference.apply_bitmask_ref(logits, bitmask, rows)
        return
    n_rows = logits.shape[0] if rows is None else rows.numel()
    n_cols = logits.shape[1]
    if n_rows == 0 or n_cols == 0:
        return
    elem = logits.element_size()
    if mode == "auto":
        small = n_rows * n_cols * elem < ADAPTIVE_MIN_BYTES
        mode = "rmw" if small else ("adaptive" if elem == 4 else "skip")
    largest, num_warps, pack_bytes = _LAUNCH.get((mode, elem), _LAUNCH_DEFAULT)
    block = pick_block(n_rows, n_cols, logits.device, largest=largest)
    num_warps = num_warps if block > 1024 else 4
    grid = (triton.cdiv(n_cols, block), n_rows)
    common = (logits, bitmask, rows, n_cols, bitmask.shape[1], logits.stride(0), bitmask.stride(0), 1)
    if mode == "store":
        _apply_bitmask_store[grid](*common, HAS_INDICES=rows is not None, BLOCK=block, num_warps=num_warps)
        return
    _apply_bitmask_packs[grid](*common, HAS_INDICES=rows is not None, PACK=pack_bytes // elem, BLOCK=block,
                               SKIP=mode in ("skip", "adaptive"), ADAPTIVE=mode == "adaptive", num_warps=num_warps)


@triton.jit
def _apply_bool_mask(
    logits_ptr, mask_ptr, indices_ptr, n_cols, n_mask_cols, logits_stride, mask_stride,
    HAS_INDICES: tl.constexpr, BLOCK: tl.constexpr,
):
    if HAS_INDICES:
        row = tl.load(indices_ptr + tl.program_id(1)).to(tl.int64)
    else:
        row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    allowed = tl.load(mask_ptr + row * mask_stride + cols, mask=cols < n_mask_cols, other=0) != 0
    ptrs = logits_ptr + row * logits_stride + cols
    in_row = cols < n_cols
    x = tl.load(ptrs, mask=in_row)
    tl.store(ptrs, tl.where(allowed, x, float("-inf")), mask=in_row)


def apply_bool_mask(
    logits: torch.Tensor,
    mask: torch.Tensor,
    indices: torch.Tensor | Sequence[int] | None = None,
) -> None:
    """Set logits to -inf in place where the bool ``mask[B, V]`` is False (columns past ``V`` too).

    Examples
    --------
    >>> import torch
    >>> logits = torch.zeros(1, 4)
    >>> apply_bool_mask(logits, torch.tensor([[True, False, True]]))
    >>> logits.tolist()
    [[0.0, -inf, 0.0, -inf]]
    """
    check_logits(logits)
    if mask.dim() != 2 or mask.dtype != torch.bool or mask.shape[0] != logits.shape[0]:
        raise TypeError(f"mask must be bool [{logits.shape[0]}, V], got {mask.dtype} {tuple(mask.shape)}")
    if mask.stride(1) != 1:
        raise ValueError("mask rows must be contiguous")
    rows = as_index_tensor(indices, logits.shape[0], logits.device, "indices")
    if not use_triton(logits, mask):
        reference.apply_bool_mask_ref(logits, mask, rows)
        return
    n_rows = logits.shape[0] if rows is None else rows.numel()
    if n_rows == 0 or logits.shape[1] == 0:
        return
    block = pick_block(n_rows, logits.shape[1], logits.device, largest=4096)
    grid = (triton.cdiv(logits.shape[1], block), n_rows)
    _apply_bool_mask[grid](logits, mask.view(torch.uint8), rows, logits.shape[1], mask.shape[1],
                           logits.stride(0), mask.stride(0), HAS_INDICES=rows is not None, BLOCK=block,
                           num_warps=4 if block <= 2048 else 8)
