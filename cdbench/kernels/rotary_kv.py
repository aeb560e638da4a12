"""Rotary embedding of queries and keys fused with the keys' and values' write into a paged KV cache.

One launch a layer does what a forward otherwise runs as several kernels (the
per-head query/key RMSNorm of Qwen3, the rotate-half rotary of queries and keys,
the scatter of keys and values into their cache positions), as the engines'
fused kernels do (vLLM's ``rotary_embedding`` and ``reshape_and_cache_flash``
ops, SGLang's fused ``set_kv_buffer``): one program per (token, head) reads the
head's ``d`` values once, in fp32 normalizes and rotates them, and writes them
back in place; a key head's program also writes that key and the token's value
of the same head to the token's cache position.

A token's cache position is ``where[t]`` = ``block * block_size + offset``, the
flat index of vLLM's ``slot_mapping``, read from a device tensor (a CUDA graph
captured once serves any positions); a negative one (a padding row) writes
nothing.

Examples
--------
>>> import torch
>>> q, k, v = torch.ones(1, 2, 4), torch.ones(1, 1, 4), torch.full((1, 1, 4), 7.0)
>>> cos, sin = torch.ones(1, 2), torch.zeros(1, 2)          # position 0: no rotation
>>> k_cache, v_cache = torch.zeros(3, 1, 2, 4), torch.zeros(3, 1, 2, 4)
>>> _ = rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, torch.tensor([5]))   # block 2, offset 1
>>> v_cache[2, 0, 1].tolist(), bool(k_cache[2, 0, 1].eq(1).all())
([7.0, 7.0, 7.0, 7.0], True)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cdbench.kernels import reference
from cdbench.kernels._launch import use_triton


@triton.jit
def _rotary_kv(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr, where_ptr,
    n_heads, half, eps,
    q_tok, q_head, k_tok, k_head, v_tok, v_head, cos_tok, sin_tok,
    kc_block, kc_head, kc_pos, vc_block, vc_head, vc_pos,
    BLOCK_H: tl.constexpr, PAGE: tl.constexpr, NORM: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK_H)
    ok = i < half
    cos = tl.load(cos_ptr + tok * cos_tok + i, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * sin_tok + i, mask=ok, other=0.0).to(tl.float32)
    is_key = head >= n_heads
    if is_key:
        h = head - n_heads
        x_ptr = k_ptr + tok * k_tok + h * k_head
        norm_ptr = k_norm_ptr
    else:
        h = head
        x_ptr = q_ptr + tok * q_tok + h * q_head
        norm_ptr = q_norm_ptr
    x1 = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half + i, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        rms = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * half) + eps)
        x1 = x1 * rms * tl.load(norm_ptr + i, mask=ok, other=0.0).to(tl.float32)
        x2 = x2 * rms * tl.load(norm_ptr + half + i, mask=ok, other=0.0).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + i, y1, mask=ok)
    tl.store(x_ptr + half + i, y2, mask=ok)
    if is_key:
        where = tl.load(where_ptr + tok).to(tl.int64)
        if where >= 0:
            block, offset = where // PAGE, where % PAGE
            kc = k_cache_ptr + block * kc_block + h * kc_head + offset * kc_pos
            tl.store(kc + i, y1.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(kc + half + i, y2.to(k_cache_ptr.dtype.element_ty), mask=ok)
            v_row = v_ptr + tok * v_tok + h * v_head
            vc = v_cache_ptr + block * vc_block + h * vc_head + offset * vc_pos
            tl.store(vc + i, tl.load(v_row + i, mask=ok, other=0.0).to(v_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(vc + half + i, tl.load(v_row + half + i, mask=ok, other=0.0).to(v_cache_ptr.dtype.element_ty),
                     mask=ok)


def _check(q, k, v, cos, sin, k_cache, v_cache, where, q_norm, k_norm) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"want q [tokens, heads, d] and equal k, v [tokens, kv_heads, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    tokens, _, d = q.shape
    if k.shape[0] != tokens or k.shape[2] != d or d % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share tokens and an even head_dim")
    if cos.shape != (tokens, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{tokens}, {d // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[1:] != (k.shape[1], k_cache.shape[2], d):
        raise ValueError(f"caches must be equal [blocks, {k.shape[1]}, block_size, {d}], got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if where.dim() != 1 or where.shape[0] != tokens or where.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"where must be int32/int64 [{tokens}], got {where.dtype} {tuple(where.shape)}")
    if (q_norm is None) != (k_norm is None) or (q_norm is not None and (q_norm.shape != (d,) or k_norm.shape != (d,))):
        raise ValueError(f"q_norm and k_norm must both be [{d}] or both None")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension")
    capacity = k_cache.shape[0] * k_cache.shape[2]
    if where.device.type == "cpu" and tokens and int(where.max()) >= capacity:
        raise IndexError(f"where must lie below the cache's {capacity} positions, got {where.tolist()}")


def rotary_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, where: torch.Tensor,
                    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                    eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize (optionally) and rotate ``q`` and ``k`` in place; write ``k`` and ``v`` into the cache.

    Parameters
    ----------
    q : ``[tokens, n_heads, d]``; k, v : ``[tokens, kv_heads, d]`` (views of a fused projection's
        output are fine: only the last dimension must be contiguous).
    cos, sin : ``[tokens, d / 2]``, each token's rotary angles (rotate-half form).
    k_cache, v_cache : ``[blocks, kv_heads, block_size, d]``, the layer's pages.
    where : int32/int64 ``[tokens]``, each token's flat cache position (``block * block_size +
        offset``); negative: not written.
    q_norm, k_norm : optional ``[d]`` per-head RMSNorm weights (Qwen3), applied before the rotary.

    Returns
    -------
    ``(q, k)``, rotated in place.
    """
    _check(q, k, v, cos, sin, k_cache, v_cache, where, q_norm, k_norm)
    tokens, n_heads, d = q.shape
    if not use_triton(q, k, v, cos, sin, k_cache, v_cache, where):
        return reference.rotary_kv_reference(q, k, v, cos, sin, k_cache, v_cache, where, q_norm, k_norm, eps)
    if tokens == 0:
        return q, k
    norm = q_norm is not None
    _rotary_kv[(tokens, n_heads + k.shape[1])](
        q, k, v, cos, sin, q_norm if norm else cos, k_norm if norm else cos, k_cache, v_cache, where,
        n_heads, d // 2, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        BLOCK_H=triton.next_power_of_2(d // 2), PAGE=k_cache.shape[2], NORM=norm, num_warps=1,
    )
    return q, k
