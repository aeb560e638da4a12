"""Torch reference implementations of the mask kernels and of decode attention.

These are the executable specification: the Triton kernels in
:mod:`cdbench.kernels.bitmask`, :mod:`cdbench.kernels.token_filter` and
:mod:`cdbench.kernels.sampling` must produce bit-identical results;
:mod:`cdbench.kernels.decode_attention` must match
:func:`decode_attention_reference` up to bf16/fp16 rounding (its softmax sums
in another order). The public functions run them directly for CPU tensors.

Bitmask layout (as in xgrammar): ``bitmask[row, w]`` is an int32 word whose bit
``b`` (least significant first) is 1 when token ``32*w + b`` is allowed.

Examples
--------
>>> import torch
>>> logits = torch.zeros(1, 40)
>>> bitmask = torch.tensor([[0b101, 0]], dtype=torch.int32)
>>> apply_bitmask_ref(logits, bitmask)
>>> torch.isfinite(logits[0]).nonzero().flatten().tolist()
[0, 2]
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
_MASK32 = 0xFFFFFFFF


def unpack_bitmask(bitmask: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Bool ``[B, n_cols]`` view of an int32 bitmask ``[B, W]``; columns past ``32*W`` are False."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)
    if bits.shape[-1] >= n_cols:
        return bits[..., :n_cols]
    pad = torch.zeros(*bits.shape[:-1], n_cols - bits.shape[-1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=-1)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Int32 bitmask ``[B, ceil(V/32)]`` of a bool ``[B, V]`` mask (inverse of :func:`unpack_bitmask`)."""
    n_rows, n_cols = allowed.shape
    n_words = (n_cols + 31) // 32
    padded = torch.zeros(n_rows, n_words * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :n_cols] = allowed.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=allowed.device) << torch.arange(32, device=allowed.device)
    words = (padded.view(n_rows, n_words, 32) * weights).sum(-1)
    # Reinterpret the unsigned 32-bit value as int32 (bit 31 set -> negative).
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _rows(n_rows: int, indices: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if indices is None:
        return torch.arange(n_rows, device=device)
    return indices.to(device=device, dtype=torch.int64)


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None) -> None:
    """Set ``logits[r, t] = -inf`` where bit ``t`` of ``bitmask[r]`` is 0, for rows ``r`` in ``indices``."""
    rows = _rows(logits.shape[0], indices, logits.device)
    allowed = unpack_bitmask(bitmask[rows.to(bitmask.device)].to(logits.device), logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, NEG_INF)


def apply_bool_mask_ref(logits: torch.Tensor, mask: torch.Tensor, indices: torch.Tensor | None = None) -> None:
    """Set ``logits[r, t] = -inf`` where ``mask[r, t]`` is False; columns past ``mask.shape[1]`` too."""
    rows = _rows(logits.shape[0], indices, logits.device)
    allowed = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    n = min(mask.shape[1], logits.shape[1])
    allowed[:, :n] = mask[rows.to(mask.device), :n].to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, NEG_INF)


def set_token_filter_ref(
    bitmask: torch.Tensor,
    token_ids: torch.Tensor,
    rows: torch.Tensor,
    allowed: bool = True,
    reset: bool = True,
    vocab_size: int | None = None,
) -> None:
    """Set (``allowed``) or clear the bits of ``token_ids`` in ``rows``; with ``reset``, first make
    each row all-disallowed (``allowed=True``) or all-allowed below ``vocab_size`` (``allowed=False``).

    Token ids outside ``[0, 32*W)`` are ignored (the public function rejects them when it can check
    without a device sync).
    """
    n_words = bitmask.shape[1]
    rows = rows.to(device=bitmask.device, dtype=torch.int64)
    tokens = token_ids.to(device=bitmask.device, dtype=torch.int64)
    tokens = tokens[(tokens >= 0) & (tokens < 32 * n_words)]
    if reset:
        fill = torch.zeros(n_words * 32, dtype=torch.bool, device=bitmask.device)
        if not allowed:
            fill[: n_words * 32 if vocab_size is None else vocab_size] = True
        bitmask[rows] = pack_bitmask(fill.unsqueeze(0)).expand(len(rows), n_words)
    bits = unpack_bitmask(bitmask[rows], n_words * 32)
    bits[:, tokens] = allowed
    bitmask[rows] = pack_bitmask(bits)


def hash32(x: torch.Tensor | int) -> torch.Tensor | int:
    """The 32-bit integer mixer the sampling kernel uses (``lowbias32``; bijective on uint32).

    Works on Python ints and on int64 tensors holding values in ``[0, 2**32)``.
    """
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def sampling_base_key(seed: int, offset: int) -> int:
    """Per-call key of the Gumbel noise: a hash of ``(seed, offset)``."""
    return int(hash32(hash32(seed & _MASK32) ^ (offset & _MASK32)))


def gumbel_noise(base_key: int, row: int, n_cols: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Float32 Gumbel(0, 1) noise for tokens ``0..n_cols-1`` of logits row ``row``.

    Uniforms take the top 24 bits of ``hash32(hash32(base_key ^ row) ^ token)`` and sit at bin
    centres, so they lie strictly inside (0, 1).
    """
    row_key = int(hash32(base_key ^ (row & _MASK32)))
    tokens = torch.arange(n_cols, dtype=torch.int64, device=device)
    h = hash32(tokens ^ row_key)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))


def masked_argmax_ref(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> torch.Tensor:
    """Token per row: the allowed token with the largest score, lowest id on ties, -1 if none allowed.

    Score is the logit (greedy, ``temperature`` None or a row's temperature 0) or
    ``logit * (1/T) + gumbel`` (a sample from ``softmax(logit / T)`` over the allowed tokens).
    ``temperature`` holds one float32 value per selected row.
    """
    rows = _rows(logits.shape[0], indices, logits.device)
    n_cols = logits.shape[1]
    base_key = sampling_base_key(seed, offset)
    out = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    for i, row in enumerate(rows.tolist()):
        allowed = unpack_bitmask(bitmask[row : row + 1].to(logits.device), n_cols)[0]
        score = logits[row].to(torch.float32)
        if temperature is not None and float(temperature[i]) > 0:
            inv_t = (1.0 / temperature[i : i + 1].to(torch.float32)).to(logits.device)
            score = score * inv_t + gumbel_noise(base_key, row, n_cols, logits.device)
        if not bool(allowed.any()):
            out[i] = -1
            continue
        best = score.masked_fill(~allowed, NEG_INF).max()
        out[i] = int((allowed & (score == best)).nonzero()[0, 0])
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor | None = None,
    scale: float | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention in fp32 (:func:`cdbench.kernels.decode_attention.decode_attention`'s oracle).

    Row ``r``'s query heads attend to keys ``0..lengths[r]-1`` of request ``slots[r]``: its pages
    ``block_table[slots[r]]`` of ``[blocks, kv_heads, block_size, d]`` caches laid end to end, or
    without a table the single block ``slots[r]``; query head ``h`` uses KV head
    ``h // (n_heads // kv_heads)``. A row of length 0 gets zeros. Every row is gathered up to the
    longest length and masked, so memory grows with rows × longest length.
    """
    rows, n_heads, d = q.shape
    kv_heads = k_cache.shape[1]
    scale = d**-0.5 if scale is None else scale
    lengths = lengths.to(device=q.device, dtype=torch.int64)
    attend = int(lengths.max()) if rows else 0
    slots = slots.to(device=k_cache.device, dtype=torch.int64)
    if block_table is None:
        keys, values = k_cache[slots], v_cache[slots]
    else:  # [rows, pages, kv_heads, block, d] -> [rows, kv_heads, pages * block, d]
        pages = block_table.to(device=k_cache.device, dtype=torch.int64)[slots]
        keys, values = (c[pages].transpose(1, 2).flatten(2, 3) for c in (k_cache, v_cache))
    keys = keys[:, :, :attend].to(q.device, torch.float32)      # [rows, kv_heads, attend, d]
    values = values[:, :, :attend].to(q.device, torch.float32)
    queries = q.to(torch.float32).view(rows, kv_heads, n_heads // kv_heads, d)
    scores = queries @ keys.transpose(-1, -2) * scale                   # [rows, kv_heads, group, attend]
    valid = torch.arange(attend, device=q.device)[None, :] < lengths[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], NEG_INF)
    # A row with no keys softmaxes all -inf to NaN; its weights are zero instead.
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    result = (weights @ values).view(rows, n_heads, d).to(q.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def rotary_kv_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    where: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cdbench.kernels.rotary_kv.rotary_kv_write` in fp32 torch: optional per-head RMSNorm, the
    rotate-half rotary of ``q`` and ``k`` (in place), and ``k``, ``v`` written at the flat cache positions
    ``where`` of ``[blocks, kv_heads, block_size, d]`` caches (negative positions skipped)."""

    def rotate(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        y = x.float()
        if weight is not None:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        first, second = y.chunk(2, dim=-1)
        c, s = cos.float()[:, None, :], sin.float()[:, None, :]
        return torch.cat([first * c - second * s, second * c + first * s], dim=-1).to(x.dtype)

    q.copy_(rotate(q, q_norm))
    k.copy_(rotate(k, k_norm))
    keep = where >= 0
    at = where[keep].to(device=k_cache.device, dtype=torch.int64)
    block_size = k_cache.shape[2]
    for cache, x in ((k_cache, k), (v_cache, v)):
        cache[at // block_size, :, at % block_size] = x[keep.to(x.device)].to(cache.dtype)
    return q, k
