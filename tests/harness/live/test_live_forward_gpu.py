"""On a CUDA device: a captured step replays to the eager step's logits."""

from __future__ import annotations

import pytest
import torch

from cdbench.harness.costs.hardware import ModelSpec
from cdbench.harness.live.forward import KVCache, LiveForward, PrefillChunk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_graph_replay_matches_eager() -> None:
    spec = ModelSpec(name="small", params_total=1e7, n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2,
                     head_dim=64, vocab_size=1000, intermediate_size=1024, qk_norm=True)
    fwd = LiveForward(spec, "cuda")
    cache = KVCache.allocate(spec, 9, 300, "cuda")
    fwd.step(cache, prefill=[PrefillChunk(s, 0, 256) for s in range(9)])
    decode = fwd.decode_inputs([256] * 8)
    eager = fwd.step(cache, decode, [PrefillChunk(8, 256, 32)]).clone()
    graph = fwd.capture(cache, decode, [PrefillChunk(8, 256, 32)])
    torch.testing.assert_close(graph.replay(), eager, rtol=2e-2, atol=2e-2)


def test_live_gpu_costs_time_graph_replays() -> None:
    import numpy as np

    from cdbench.harness.live.gpu import LiveGpuCosts

    spec = ModelSpec(name="small", params_total=1e7, n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2,
                     head_dim=64, vocab_size=1000, intermediate_size=1024)
    live = LiveGpuCosts(spec, vocab_size=4096, kv_tokens=2**16, max_rows=64)
    decode = [live.forward_s(np.zeros(0), np.zeros(0), 8, 8 * 500) for _ in range(3)]
    assert all(t > 0 for t in decode) and len(live._graphs) == 1  # one capture, replayed
    assert live.forward_s(np.array([128, 64]), np.array([0, 256]), 8, 8 * 500) > 0
    assert 0 < live.apply_s(16) == live.apply_s(16)


def test_measure_grid_times_steps_after_an_idle_gpu() -> None:
    from cdbench.harness.live.measure import StepShape, measure_grid

    spec = ModelSpec(name="small", params_total=1e7, n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2,
                     head_dim=64, vocab_size=1000, intermediate_size=1024)
    shapes = [StepShape(rows=4, kv=300)]
    alone = measure_grid(spec, shapes, per_row=True, cache_len=1024, idle_s=1e-3, min_reps=5, min_time_s=0.0)
    packed = measure_grid(spec, shapes, per_row=True, cache_len=1024, min_reps=5, min_time_s=0.0)
    assert alone[0].reps == 5 and alone[0].median_s > 0 and packed[0].median_s > 0
