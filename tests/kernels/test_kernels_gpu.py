"""The interpreter checks again at full vocabulary sizes on a CUDA device."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DTYPES,
    MODES,
    check_apply_bitmask,
    check_apply_bool_mask,
    check_masked_argmax,
    check_set_token_filter,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
VOCABS = [(129280, 129280), (151936, 152064), (248077, 248320), (1000, 1000)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,n_cols", VOCABS)
@pytest.mark.parametrize("n_rows", [1, 8, 64])
def test_apply_bitmask_gpu(n_rows, vocab, n_cols, dtype, mode):
    gen = torch.Generator().manual_seed(n_rows * 7 + vocab)
    for allowed in (0.05, 0.95):
        for with_indices in (False, True):
            check_apply_bitmask(gen, n_rows, vocab, n_cols, dtype, allowed, mode, "cuda", with_indices)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,n_cols", VOCABS)
def test_apply_bool_mask_gpu(vocab, n_cols, dtype):
    gen = torch.Generator().manual_seed(vocab)
    for with_indices in (False, True):
        check_apply_bool_mask(gen, 8, vocab, n_cols, dtype, 0.3, "cuda", with_indices)


@pytest.mark.parametrize("vocab", [129280, 248077])
@pytest.mark.parametrize("allowed", [True, False])
@pytest.mark.parametrize("reset", [True, False])
def test_set_token_filter_gpu(vocab, allowed, reset):
    gen = torch.Generator().manual_seed(vocab)
    check_set_token_filter(gen, 16, vocab, 300, allowed, reset, "cuda")


@pytest.mark.parametrize("temperature", [None, 0.7, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,n_cols", VOCABS)
def test_masked_argmax_gpu(vocab, n_cols, dtype, temperature):
    gen = torch.Generator().manual_seed(vocab + 3)
    for allowed in (0.0, 0.05, 0.95):
        check_masked_argmax(gen, 4, vocab, n_cols, dtype, allowed, temperature, "cuda", allowed > 0.5)
