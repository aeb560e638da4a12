"""Checks of the fused rotary + KV-write kernel against its torch reference, for any device."""

from __future__ import annotations

import torch

from cdbench.kernels.reference import rotary_kv_reference
from cdbench.kernels.rotary_kv import rotary_kv_write

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rotary_kv_inputs(gen: torch.Generator, tokens: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                     norm: bool, dtype: torch.dtype, device):
    """A fused QKV output's views, angles, caches poisoned with NaN, shuffled positions (one padding token)."""
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 3, generator=gen).to(device, dtype)  # 3 spare columns: strided views
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:width].view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 50
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    blocks = -(-tokens // block_size) + 2
    k_cache = torch.full((blocks, kv_heads, block_size, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    where = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    where[tokens // 2] = -1
    weights = [torch.rand(head_dim, generator=gen).to(device, dtype) + 0.5 for _ in range(2)] if norm else [None, None]
    return qkv, q, k, v, cos, sin, k_cache, v_cache, where.to(device), weights


def check_rotary_kv(gen, tokens, heads, kv_heads, head_dim, block_size, norm, dtype, device) -> None:
    qkv, q, k, v, cos, sin, k_cache, v_cache, where, (qn, kn) = rotary_kv_inputs(
        gen, tokens, heads, kv_heads, head_dim, block_size, norm, dtype, device)
    ref_qkv, ref_kc, ref_vc = qkv.clone(), k_cache.clone(), v_cache.clone()
    hq, hk = heads * head_dim, kv_heads * head_dim
    ref_q = ref_qkv[:, :hq].view(tokens, heads, head_dim)
    ref_k = ref_qkv[:, hq:hq + hk].view(tokens, kv_heads, head_dim)
    ref_v = ref_qkv[:, hq + hk:hq + 2 * hk].view(tokens, kv_heads, head_dim)
    rotary_kv_reference(ref_q, ref_k, ref_v, cos, sin, ref_kc, ref_vc, where, qn, kn)
    got = rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, where, qn, kn)
    assert got[0].data_ptr() == q.data_ptr() and got[1].data_ptr() == k.data_ptr(), "rotated in place"
    tol = TOLERANCE[dtype]
    what = f"tokens={tokens} heads={heads}/{kv_heads} d={head_dim} block={block_size} norm={norm} {dtype}"
    torch.testing.assert_close(qkv.float(), ref_qkv.float(), rtol=tol, atol=tol, msg=what)
    # written positions equal; the rest (and the padding token's) still NaN
    torch.testing.assert_close(k_cache.float(), ref_kc.float(), rtol=tol, atol=tol, equal_nan=True, msg=what)
    torch.testing.assert_close(v_cache.float(), ref_vc.float(), rtol=0, atol=0, equal_nan=True, msg=what)
    written = where[where >= 0].to(torch.int64)
    assert not k_cache[written // block_size, :, written % block_size].isnan().any(), what
    assert int((~k_cache.isnan()).any(-1).sum()) == len(written) * kv_heads, f"{what}: wrote elsewhere"
