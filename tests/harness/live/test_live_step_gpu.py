"""On a CUDA device: live steps replay captured decode graphs with per-row lengths and time every part."""

from __future__ import annotations

import json

import pytest
import torch

from cdbench.harness.costs.hardware import ModelSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SMALL = ModelSpec(name="small", params_total=1e7, n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2,
                  head_dim=64, vocab_size=1000, intermediate_size=1024, qk_norm=True)


def test_per_row_graph_replays_any_lengths() -> None:
    from cdbench.harness.live.forward import LiveForward, PrefillChunk
    from cdbench.harness.live.paged import KVCache

    fwd = LiveForward(SMALL, "cuda")
    cache = KVCache.allocate(SMALL, 4, 512, "cuda")
    fwd.step(cache, prefill=[PrefillChunk(s, 0, 400) for s in range(4)])
    inputs = fwd.decode_inputs([0] * 4, [0, 1, 2, 3], per_row=True)
    graph = fwd.capture(cache, inputs)
    for lengths in ([10, 200, 399, 1], [300, 300, 5, 77]):
        positions = torch.tensor(lengths, device="cuda")
        inputs.positions.copy_(positions)
        inputs.lengths.copy_(positions + 1)
        replayed = graph.replay().clone()
        eager = fwd.step(cache, fwd.decode_inputs(lengths, [0, 1, 2, 3], per_row=True))
        torch.testing.assert_close(replayed, eager, rtol=2e-2, atol=2e-2)


def test_balanced_decode_launch_changes_no_logit() -> None:
    from cdbench.harness.live.forward import LiveForward, PrefillChunk
    from cdbench.harness.live.paged import KVCache

    fwd = LiveForward(SMALL, "cuda")
    cache = KVCache.allocate(SMALL, 4, 512, "cuda")
    fwd.step(cache, prefill=[PrefillChunk(s, 0, 500) for s in range(4)])
    lengths = [20, 7, 480, 499]  # the long rows last: the balanced launch takes them first
    steps = {}
    for balance in (False, True):
        fwd.balance_decode = balance
        inputs = fwd.decode_inputs([0] * 4, [0, 1, 2, 3], per_row=True)
        graph = fwd.capture(cache, inputs)
        positions = torch.tensor(lengths, device="cuda")
        inputs.positions.copy_(positions)
        inputs.lengths.copy_(positions + 1)
        steps[balance] = graph.replay().clone()
    assert torch.equal(steps[False], steps[True])


def test_a_live_run_measures_its_steps() -> None:
    from cdbench.backends import create_backend
    from cdbench.backends.base import ConstraintSpec
    from cdbench.backends.vocab import load_vocab
    from cdbench.harness.costs.gpu import FixedGpuCosts
    from cdbench.harness.executors.hybrid import HybridExecutor
    from cdbench.harness.live.step import LiveStep
    from cdbench.harness.policies import policy
    from cdbench.harness.run import max_context, simulate
    from cdbench.workloads.request import Request

    backend = create_backend("xgrammar", load_vocab("cl100k"))
    eos = backend.vocab.eos_token_ids[0]
    schema = ConstraintSpec("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}},
                                            "required": ["n"]})
    requests = []
    for i in range(12):
        tokens = tuple(backend.vocab.encode(json.dumps({"n": i * 1000}))) + (eos,)
        requests.append(Request(i, 0.002 * i, 64 + 32 * i, len(tokens), schema, "n", tokens))
    for overlap in (True, False):
        config = policy("sglang", overlap=overlap)
        live = LiveStep(SMALL, backend.vocab.size, max_context(requests), kv_tokens=2**16, max_rows=64,
                        graph_sizes=config.cuda_graph_sizes, block_size=config.kv_block_size)
        result = simulate(requests, config, HybridExecutor(backend, seed=1),
                          FixedGpuCosts(), seed=1, live=live)
        steps = result.steps[result.steps["kind"] != "idle"]
        assert result.summary.completed == 12 and result.requests["valid"].all()
        assert (steps["forward_s"] > 0).all() and (steps["duration_s"] >= steps["forward_s"]).all()
        assert result.live is not None and result.live.graphs_captured  # decode steps replayed graphs
        assert set(result.live.graphs_captured) <= set(config.cuda_graph_sizes)  # at the policy's sizes
        assert result.live.device != "cpu"


def test_start_up_compiles_every_mask_and_sampling_kernel_variant_a_run_can_meet() -> None:
    from cdbench.harness.live.step import LiveStep
    from cdbench.kernels import apply_bitmask, masked_argmax
    from cdbench.kernels.bitmask import _apply_bitmask_packs
    from cdbench.kernels.sampling import _argmax_combine, _argmax_partial

    live = LiveStep(SMALL, 151_000, 256, kv_tokens=2**14, max_rows=160)
    kernels = (_apply_bitmask_packs, _argmax_partial, _argmax_combine)

    def variants() -> int:  # compiled kernels: the first item of Triton's per-device cache entry
        return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())

    compiled = variants()
    for rows in (3, 19, 37, 100, 129, 160):  # counts the start-up did not meet one by one before
        apply_bitmask(live.logits[:rows], live.mask[:rows])
        masked_argmax(live.logits[:rows], live.mask[:rows])
    torch.cuda.synchronize()
    assert variants() == compiled
