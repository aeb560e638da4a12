"""Shared pieces of the live-forward tests."""

from __future__ import annotations

import pytest
import torch

from cdbench.harness.live.forward import PrefillChunk
from cdbench.harness.live.paged import KVCache


def _decode_and_prefill_one_at_a_time(fwd, spec, prompts) -> torch.Tensor:
    """The reference for a mixed step: slots 0 and 1 prefill their prompts then decode tokens 3 and 4, each in
    a step of its own, and slot 2 prefills alone, in a fresh cache; the logits of those three steps."""
    alone = KVCache.allocate(spec, 3, 16, "cpu", torch.float32)
    expected = []
    for slot, token in ((0, 3), (1, 4)):
        fwd.step(alone, prefill=[PrefillChunk(slot, 0, len(prompts[slot]))], prefill_tokens=prompts[slot])
        expected.append(fwd.step(alone, decode=fwd.decode_inputs([len(prompts[slot])], [slot], [token])))
    expected.append(fwd.step(alone, prefill=[PrefillChunk(2, 0, len(prompts[2]))], prefill_tokens=prompts[2]))
    return torch.cat(expected)


@pytest.fixture
def one_at_a_time():
    return _decode_and_prefill_one_at_a_time
