"""Checks that each Triton kernel equals its torch reference exactly, for any device.

Imported by ``interpreted_cases.py`` (Triton's CPU interpreter, tiny shapes) and
``test_kernels_gpu.py`` (CUDA, full shapes). Every check draws fresh inputs from
a seeded generator and compares with ``torch.equal`` (so -inf positions and
untouched values must match bit for bit).
"""

from __future__ import annotations

import torch

from cdbench.kernels import (
    apply_bitmask,
    apply_bool_mask,
    masked_argmax,
    reference,
    set_token_filter,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MODES = ("auto", "adaptive", "skip", "rmw", "store")


def random_bitmask(gen: torch.Generator, n_rows: int, vocab: int, allowed: float, device) -> torch.Tensor:
    """Bitmask with about ``allowed`` of the tokens set; row 0 all-masked and row -1 all-allowed when B > 2."""
    bits = torch.rand(n_rows, vocab, generator=gen) < allowed
    if n_rows > 2:
        bits[0] = False
        bits[-1] = True
    return reference.pack_bitmask(bits).to(device)


def random_logits(gen: torch.Generator, n_rows: int, n_cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Normal logits with a few already at -inf (and, in fp32, one +inf)."""
    logits = torch.randn(n_rows, n_cols, generator=gen)
    flat = logits.view(-1)
    flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=gen)] = float("-inf")
    return logits.to(dtype).to(device)


def check_apply_bitmask(gen, n_rows, vocab, n_cols, dtype, allowed, mode, device, with_indices) -> None:
    logits = random_logits(gen, n_rows, n_cols, dtype, device)
    bitmask = random_bitmask(gen, n_rows, vocab, allowed, device)
    indices = None
    if with_indices:
        indices = torch.randperm(n_rows, generator=gen)[: max(1, n_rows // 2)].to(device)
    expected = logits.clone()
    reference.apply_bitmask_ref(expected, bitmask, indices)
    apply_bitmask(logits, bitmask, indices, mode=mode)
    assert torch.equal(logits, expected), f"apply_bitmask mode={mode} {dtype} B={n_rows} V={vocab} V'={n_cols}"


def check_apply_bool_mask(gen, n_rows, vocab, n_cols, dtype, allowed, device, with_indices) -> None:
    logits = random_logits(gen, n_rows, n_cols, dtype, device)
    mask = (torch.rand(n_rows, vocab, generator=gen) < allowed).to(device)
    indices = torch.arange(0, n_rows, 2).to(device) if with_indices else None
    expected = logits.clone()
    reference.apply_bool_mask_ref(expected, mask, indices)
    apply_bool_mask(logits, mask, indices)
    assert torch.equal(logits, expected), f"apply_bool_mask {dtype} B={n_rows} V={vocab} V'={n_cols}"


def check_set_token_filter(gen, n_rows, vocab, n_tokens, allowed, reset, device) -> None:
    bitmask = random_bitmask(gen, n_rows, vocab, 0.5, device)
    tokens = torch.randint(0, vocab, (n_tokens,), generator=gen)  # duplicates on purpose
    rows = torch.randperm(n_rows, generator=gen)[: max(1, n_rows // 2)]
    expected = bitmask.clone()
    reference.set_token_filter_ref(expected, tokens, rows, allowed, reset, vocab)
    set_token_filter(bitmask, tokens.to(device), rows.to(device), allowed=allowed, reset=reset, vocab_size=vocab)
    assert torch.equal(bitmask, expected), f"set_token_filter allowed={allowed} reset={reset} V={vocab}"


def check_masked_argmax(gen, n_rows, vocab, n_cols, dtype, allowed, temperature, device, with_indices) -> None:
    logits = random_logits(gen, n_rows, n_cols, dtype, device)
    bitmask = random_bitmask(gen, n_rows, vocab, allowed, device)
    indices = torch.arange(n_rows - 1, -1, -2).to(device) if with_indices else None
    n_sel = n_rows if indices is None else len(indices)
    temps = None if temperature is None else torch.full((n_sel,), temperature, dtype=torch.float32)
    seed, offset = (int(v) for v in torch.randint(0, 2**31, (2,), generator=gen))
    before = logits.clone()
    got = masked_argmax(logits, bitmask, indices, temperature=temperature, seed=seed, offset=offset)
    expected = reference.masked_argmax_ref(logits, bitmask, indices, temps, seed, offset)
    assert torch.equal(logits, before), "masked_argmax modified the logits"
    assert torch.equal(got.cpu(), expected.cpu()), f"masked_argmax T={temperature} {dtype}: {got} vs {expected}"
