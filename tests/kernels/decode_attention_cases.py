"""Checks of the decode-attention kernel against its fp32 torch reference, for any device.

Imported by ``decode_attention_interpreted.py`` (Triton's CPU interpreter, tiny
shapes) and ``test_decode_attention.py`` (CUDA, Llama-3.1-8B shapes). Cache
positions at and past each row's length hold large values, so a kernel that
reads one key too many is far off, and the error bound is relative to the
output's largest value, so a kernel that drops a split's keys is off too.
"""

from __future__ import annotations

import torch

from cdbench.kernels.decode_attention import decode_attention
from cdbench.kernels.reference import decode_attention_reference

#: Largest error allowed, as a fraction of the row's largest reference output: the kernel
#: rounds the softmax weights to the input dtype before multiplying the values.
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
POISON = 1000.0
#: Rows the reference processes at once (it gathers every row up to the longest length in fp32).
REFERENCE_ROWS = 32


def decode_inputs(gen: torch.Generator, lengths: list[int], kv_heads: int, group: int, head_dim: int,
                  max_len: int, dtype: torch.dtype, device, spare_slots: int = 3):
    """Queries, caches and scattered slots for rows of ``lengths``; keys/values past each length poisoned.

    Drawn on ``device`` (a generator seeded from ``gen``), so GPU-sized caches need no host copy.
    """
    rows = len(lengths)
    n_slots = rows + spare_slots
    slots = torch.randperm(n_slots, generator=gen)[:rows].to(device)
    lengths_t = torch.tensor(lengths, dtype=torch.int32).to(device)
    draw = torch.Generator(device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    q = torch.randn(rows, kv_heads * group, head_dim, generator=draw, device=device, dtype=dtype)
    k = torch.randn(n_slots, kv_heads, max_len, head_dim, generator=draw, device=device, dtype=dtype)
    v = torch.randn(n_slots, kv_heads, max_len, head_dim, generator=draw, device=device, dtype=dtype)
    slot_length = torch.full((n_slots,), max_len, dtype=torch.int32, device=device)
    slot_length[slots] = lengths_t
    past = (torch.arange(max_len, device=device)[None, :] >= slot_length[:, None])[:, None, :, None]
    k.masked_fill_(past, POISON)
    v.masked_fill_(past, POISON)
    return q, k, v, slots, lengths_t


def reference_output(q, k, v, slots, lengths, scale=None) -> torch.Tensor:
    parts = [decode_attention_reference(q[i:i + REFERENCE_ROWS], k, v, slots[i:i + REFERENCE_ROWS],
                                        lengths[i:i + REFERENCE_ROWS], scale=scale)
             for i in range(0, q.shape[0], REFERENCE_ROWS)]
    return torch.cat(parts)


def assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Each row within ``TOLERANCE`` of its own largest output (long rows average to small outputs)."""
    scale = expected.float().abs().flatten(1).amax(dim=1).clamp_min(1e-3)
    error = (got.float() - expected.float()).abs().flatten(1).amax(dim=1) / scale
    worst = int(error.argmax())
    assert float(error[worst]) <= TOLERANCE[expected.dtype], (
        f"{what}: row {worst} off by {float(error[worst]):.3g} of its largest output")


def check_decode_attention(gen: torch.Generator, lengths: list[int], kv_heads: int, group: int, head_dim: int,
                           max_len: int, dtype: torch.dtype, splits: int | None, device,
                           index_dtype: torch.dtype = torch.int32, min_split_keys: int | None = None) -> None:
    q, k, v, slots, lengths_t = decode_inputs(gen, lengths, kv_heads, group, head_dim, max_len, dtype, device)
    got = decode_attention(q, k, v, slots, lengths_t.to(index_dtype), splits=splits, min_split_keys=min_split_keys)
    what = (f"lengths={lengths} kv_heads={kv_heads} G={group} d={head_dim} max_len={max_len} {dtype} splits={splits} "
            f"min_split_keys={min_split_keys}")
    assert_close(got, reference_output(q, k, v, slots, lengths_t), what)
    empty = [i for i, length in enumerate(lengths) if length == 0]
    assert not got[empty].any(), f"{what}: rows of length 0 must be zeros"


def paged(k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator, spare_blocks: int = 5):
    """The slot caches ``[slots, kv_heads, max_len, d]`` cut into pages of ``block_size`` keys, each slot's
    pages scattered over a shuffled pool with spare (poisoned) pages: ``(k_pages, v_pages, block_table)``."""
    n_slots, kv_heads, max_len, d = k.shape
    per_slot = max_len // block_size
    n_blocks = n_slots * per_slot + spare_blocks
    table = torch.randperm(n_blocks, generator=gen)[: n_slots * per_slot].view(n_slots, per_slot).to(k.device)
    pages = []
    for cache in (k, v):
        pool = torch.full((n_blocks, kv_heads, block_size, d), POISON, dtype=cache.dtype, device=cache.device)
        pool[table.flatten()] = cache.view(n_slots, kv_heads, per_slot, block_size, d).transpose(1, 2).flatten(0, 1)
        pages.append(pool)
    return pages[0], pages[1], table.to(torch.int32)


def check_paged_decode_attention(gen: torch.Generator, lengths: list[int], kv_heads: int, group: int,
                                 head_dim: int, max_len: int, block_size: int, dtype: torch.dtype,
                                 splits: int | None, device, min_split_keys: int | None = None) -> None:
    """The paged kernel equals the slotted one bit for bit and the reference within ``TOLERANCE``."""
    q, k, v, slots, lengths_t = decode_inputs(gen, lengths, kv_heads, group, head_dim, max_len, dtype, device)
    k_pages, v_pages, table = paged(k, v, block_size, gen)
    got = decode_attention(q, k_pages, v_pages, slots, lengths_t, splits=splits, min_split_keys=min_split_keys,
                           block_table=table)
    slotted = decode_attention(q, k, v, slots, lengths_t, splits=splits, min_split_keys=min_split_keys)
    what = f"paged: lengths={lengths} G={group} d={head_dim} max_len={max_len} block={block_size} splits={splits}"
    assert_close(got, reference_output(q, k, v, slots, lengths_t), what)
    assert torch.equal(got, slotted), what
