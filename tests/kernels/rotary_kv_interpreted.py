"""The fused rotary + KV-write kernel vs its torch reference under ``TRITON_INTERPRET=1``, at tiny shapes.

Not collected directly: ``test_rotary_kv.py`` runs this file in a subprocess.
"""

from __future__ import annotations

import os

import pytest
import torch
from rotary_kv_cases import check_rotary_kv

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_rotary_kv.py"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 16, 4), (3, 1, 24, 16), (2, 2, 8, 1)])
def test_rotary_kv_matches_reference(heads, kv_heads, head_dim, block_size, norm, dtype):
    check_rotary_kv(torch.Generator().manual_seed(heads * head_dim + norm), 7, heads, kv_heads, head_dim, block_size,
                    norm, dtype, "cpu")
