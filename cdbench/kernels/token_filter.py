"""Set or clear a fixed set of tokens in bitmask rows (strict thinking, stop-token filters).

Examples
--------
>>> import torch
>>> from cdbench.kernels import set_token_filter
>>> bitmask = torch.full((2, 2), -1, dtype=torch.int32)
>>> set_token_filter(bitmask, [3, 40], rows=[1])          # row 1 = only tokens 3 and 40
>>> bitmask[1].tolist()
[8, 256]
>>> set_token_filter(bitmask, [0], rows=[0], allowed=False, reset=False)
>>> bitmask[0].tolist()
[-2, -1]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from cdbench.kernels import reference
from cdbench.kernels._launch import as_index_tensor, check_bitmask, use_triton

_ALL_BITS = -1


@triton.jit
def _token_filter(
    bitmask_ptr, token_ptr, row_ptr, n_tokens, n_words, bitmask_stride, reset_word, full_words, partial_word,
    ALLOWED: tl.constexpr, RESET: tl.constexpr, WORDS_BLOCK: tl.constexpr, TOKENS_BLOCK: tl.constexpr,
):
    row = tl.load(row_ptr + tl.program_id(0)).to(tl.int64)
    base = bitmask_ptr + row * bitmask_stride
    if RESET:
        for start in range(0, n_words, WORDS_BLOCK):
            words = start + tl.arange(0, WORDS_BLOCK)
            # Words below full_words take reset_word, the next one partial_word, the rest 0.
            value = tl.where(words < full_words, reset_word, tl.where(words == full_words, partial_word, 0))
            tl.store(base + words, tl.full([WORDS_BLOCK], 0, tl.int32) + value, mask=words < n_words)
        # The token bits below update words this program just stored.
        tl.debug_barrier()
    for start in range(0, n_tokens, TOKENS_BLOCK):
        idx = start + tl.arange(0, TOKENS_BLOCK)
        tok = tl.load(token_ptr + idx, mask=idx < n_tokens, other=-1)
        valid = (idx < n_tokens) & (tok >= 0) & (tok < n_words * 32)
        bit = (tl.full([TOKENS_BLOCK], 1, tl.uint32) << (tok % 32).to(tl.uint32)).to(tl.int32, bitcast=True)
        # Atomics: several tokens of one call may share a word.
        if ALLOWED:
            tl.atomic_or(base + tok // 32, bit, mask=valid)
        else:
            tl.atomic_and(base + tok // 32, ~bit, mask=valid)


def set_token_filter(
    bitmask: torch.Tensor,
    token_ids: torch.Tensor | Sequence[int],
    rows: torch.Tensor | Sequence[int],
    allowed: bool = True,
    reset: bool = True,
    vocab_size: int | None = None,
) -> None:
    """Allow (``allowed=True``) or disallow ``token_ids`` in the given bitmask ``rows``, in place.

    With ``reset``, each row is first cleared: ``allowed=True`` makes the row exactly these tokens,
    ``allowed=False`` makes it every token below ``vocab_size`` (default ``32 * W``) except these.
    Without ``reset``, the other bits are kept.

    Token and row ids given on the host are range-checked (``IndexError``); ids already on the GPU
    are not (that would synchronize), and out-of-range token ids are then ignored.
    """
    check_bitmask(bitmask)
    n_words = bitmask.shape[1]
    if vocab_size is not None and not 0 <= vocab_size <= 32 * n_words:
        raise ValueError(f"vocab_size {vocab_size} outside [0, {32 * n_words}] for a {n_words}-word bitmask")
    tokens = as_index_tensor(token_ids, 32 * n_words, bitmask.device, "token_ids")
    row_ids = as_index_tensor(rows, bitmask.shape[0], bitmask.device, "rows")
    if not use_triton(bitmask, tokens, row_ids):
        reference.set_token_filter_ref(bitmask, tokens, row_ids, allowed, reset, vocab_size)
        return
    if row_ids.numel() == 0:
        return
    limit = 32 * n_words if vocab_size is None else vocab_size
    if allowed:
        reset_word, full_words, partial_word = 0, n_words, 0
    else:
        reset_word, full_words, partial_word = _ALL_BITS, limit // 32, _as_int32((1 << (limit % 32)) - 1)
    _token_filter[(row_ids.numel(),)](
        bitmask, tokens, row_ids, tokens.numel(), n_words, bitmask.stride(0), reset_word, full_words, partial_word,
        ALLOWED=allowed, RESET=reset, WORDS_BLOCK=1024, TOKENS_BLOCK=128,
    )


def _as_int32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value
