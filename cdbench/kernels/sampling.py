"""Fused mask + token choice: greedy argmax or a Gumbel-max sample over the allowed tokens.

Unlike apply-then-sample, the logits are only read (never written back as
-inf), and packs whose tokens are all disallowed are not even read. The
bitmask layout is the one :func:`~cdbench.kernels.apply_bitmask` takes.

Sampling uses the Gumbel-max trick: ``argmax(logit / T + g)`` with ``g`` i.i.d.
Gumbel(0, 1) is a draw from ``softmax(logit / T)`` restricted to the allowed
tokens. The noise is a counter-based hash of ``(seed, offset, row, token)``
(:func:`cdbench.kernels.reference.gumbel_noise`), so a call is reproducible and
independent of the launch shape; advance ``offset`` each decoding step.

Examples
--------
>>> import torch
>>> from cdbench.kernels import masked_argmax
>>> logits = torch.tensor([[5.0, 1.0, 3.0, 9.0]])
>>> bitmask = torch.tensor([[0b0110]], dtype=torch.int32)   # tokens 1 and 2 allowed
>>> masked_argmax(logits, bitmask).tolist()
[2]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
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

_NO_TOKEN = 2**31 - 1


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _hash32_scalar(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _argmax_partial(
    logits_ptr, bitmask_ptr, indices_ptr, inv_temp_ptr, best_val_ptr, best_idx_ptr,
    n_cols, n_words, logits_stride, bitmask_stride, n_chunks, inv_temp, base_key,
    HAS_INDICES: tl.constexpr, SAMPLE: tl.constexpr, TEMP_PER_ROW: tl.constexpr,
    PACK: tl.constexpr, BLOCK: tl.constexpr,
):
    slot = tl.program_id(1)
    if HAS_INDICES:
        row = tl.load(indices_ptr + slot).to(tl.int64)
    else:
        row = slot.to(tl.int64)
    pack_start = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK // PACK) * PACK
    word_idx = pack_start // 32
    word = tl.load(bitmask_ptr + row * bitmask_stride + word_idx, mask=word_idx < n_words, other=0)
    pack_bits = (word.to(tl.uint32, bitcast=True) >> (pack_start % 32).to(tl.uint32)) & ((1 << PACK) - 1)
    lane = tl.arange(0, PACK)
    cols = pack_start[:, None] + lane[None, :]
    allowed = (((pack_bits[:, None] >> lane[None, :].to(tl.uint32)) & 1) != 0) & (cols < n_cols)
    # Packs with no allowed token are not read.
    x = tl.load(logits_ptr + row * logits_stride + cols, mask=allowed & (pack_bits != 0)[:, None], other=0.0)
    score = x.to(tl.float32)
    if SAMPLE:
        if TEMP_PER_ROW:
            inv_t = tl.load(inv_temp_ptr + slot)
        else:
            inv_t = inv_temp
        row_key = _hash32_scalar(base_key.to(tl.uint32) ^ row.to(tl.uint32))
        h = _hash32(cols.to(tl.uint32) ^ row_key)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(inv_t > 0, score * inv_t + gumbel, score)
    masked = tl.where(allowed, score, float("-inf"))
    best = tl.max(tl.max(masked, axis=1), axis=0)
    first = tl.min(tl.min(tl.where(allowed & (score == best), cols, 2147483647), axis=1), axis=0)
    out = slot * n_chunks + tl.program_id(0)
    tl.store(best_val_ptr + out, best)
    tl.store(best_idx_ptr + out, first)


@triton.jit
def _argmax_combine(best_val_ptr, best_idx_ptr, out_ptr, n_chunks, CHUNKS: tl.constexpr):
    slot = tl.program_id(0)
    chunk = tl.arange(0, CHUNKS)
    in_range = chunk < n_chunks
    idx = tl.load(best_idx_ptr + slot * n_chunks + chunk, mask=in_range, other=2147483647)
    has_token = idx != 2147483647
    val = tl.load(best_val_ptr + slot * n_chunks + chunk, mask=in_range, other=float("-inf"))
    best = tl.max(tl.where(has_token, val, float("-inf")), axis=0)
    first = tl.min(tl.where(has_token & (val == best), idx, 2147483647), axis=0)
    tl.store(out_ptr + slot, tl.where(first == 2147483647, -1, first).to(tl.int64))


def masked_argmax(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | Sequence[int] | None = None,
    *,
    temperature: float | torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> torch.Tensor:
    """Choose one token per row among the tokens the bitmask allows, without modifying ``logits``.

    Parameters
    ----------
    logits, bitmask, indices : as for :func:`~cdbench.kernels.apply_bitmask`.
    temperature : None or 0 for greedy (largest logit); ``T > 0`` samples from ``softmax(logit / T)``
        over the allowed tokens. A tensor gives one temperature per selected row (0 = greedy).
    seed, offset : select the random stream (ignored when greedy).

    Returns
    -------
    int64 tensor with one token id per selected row (ties go to the lowest id); -1 for a row with
    no allowed token.
    """
    check_logits(logits)
    check_bitmask(bitmask, logits.shape[0])
    rows = as_index_tensor(indices, logits.shape[0], logits.device, "indices")
    n_rows = logits.shape[0] if rows is None else rows.numel()
    temps = _temperatures(temperature, n_rows, logits.device)
    if not use_triton(logits, bitmask):
        return reference.masked_argmax_ref(logits, bitmask, rows, temps, seed, offset)
    out = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    if n_rows == 0:
        return out
    n_cols = logits.shape[1]
    if n_cols == 0:
        return out.fill_(-1)
    block = pick_block(n_rows, n_cols, logits.device, largest=4096)
    n_chunks = triton.cdiv(n_cols, block)
    best_val = torch.empty(n_rows, n_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(n_rows, n_chunks, dtype=torch.int32, device=logits.device)
    sample = temps is not None
    per_row = isinstance(temperature, torch.Tensor)
    inv_temp = torch.where(temps > 0, 1.0 / temps, torch.zeros_like(temps)) if per_row else None
    scalar_inv = float(np.float32(1.0) / np.float32(temperature)) if sample and not per_row else 0.0
    _argmax_partial[(n_chunks, n_rows)](
        logits, bitmask, rows, inv_temp, best_val, best_idx, n_cols, bitmask.shape[1], logits.stride(0),
        bitmask.stride(0), n_chunks, scalar_inv, reference.sampling_base_key(seed, offset),
        HAS_INDICES=rows is not None, SAMPLE=sample, TEMP_PER_ROW=per_row,
        PACK=16 // logits.element_size(), BLOCK=block, num_warps=4 if block <= 2048 else 8,
    )
    _argmax_combine[(n_rows,)](best_val, best_idx, out, n_chunks, CHUNKS=triton.next_power_of_2(n_chunks))
    return out


def _temperatures(temperature: float | torch.Tensor | None, n_rows: int, device: torch.device) -> torch.Tensor | None:
    """Float32 temperature per selected row, or None when every row is greedy."""
    if temperature is None:
        return None
    if isinstance(temperature, torch.Tensor):
        if temperature.shape != (n_rows,):
            raise ValueError(f"temperature tensor must have shape ({n_rows},), got {tuple(temperature.shape)}")
        return temperature.to(device=device, dtype=torch.float32)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return None
    return torch.full((n_rows,), float(temperature), dtype=torch.float32, device=device)
