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
    inputs = fwd.decode_inputs([0] * 4, [0] * 4, per_row=True)
    graph = fwd.capture(cache, inputs)
    # refilled lengths and rows: the graph feeds each row its request's token there (as the eager step does)
    for lengths, slots in (([10, 200, 399, 1], [0, 1, 2, 3]), ([300, 300, 5, 77], [3, 1, 0, 2])):
        positions = torch.tensor(lengths, device="cuda")
        inputs.positions.copy_(positions)
        inputs.lengths.copy_(positions + 1)
        inputs.slots.copy_(torch.tensor(slots, device="cuda"))
        replayed = graph.replay().clone()
        eager = fwd.step(cache, fwd.decode_inputs(lengths, slots, per_row=True))
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


# the seed's family at a small size: Gated DeltaNet and full-attention layers, MoE FFNs, an MTP head
HYBRID_MTP = ModelSpec(name="small-hybrid-mtp", params_total=2e7, params_active=1e7, n_layers=4, hidden_size=512,
                       n_heads=8, n_kv_heads=2, head_dim=64, vocab_size=4096, n_experts=16, experts_per_token=4,
                       moe_intermediate_size=256, shared_expert_intermediate_size=256, qk_norm=True,
                       full_attention_interval=2, attention_output_gate=True, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                       linear_conv_kernel_dim=4, mtp_layers=1)
MIB = 2**20


def _graph_pools() -> int:
    """Bytes in the CUDA graphs' private memory pools (the allocator's segments outside its default pool)."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0))


def test_the_default_pool_takes_its_share_and_the_largest_step_and_every_graph_fit_beside_it() -> None:
    import numpy as np

    from cdbench.harness.live.step import GPU_MEMORY_UTILIZATION, LiveStep, largest_step

    sizes, max_len, requests, max_rows, max_tokens, k = (1, 2, 4, 8, 16, 32), 1024, 32, 128, 2048, 2
    live = LiveStep(HYBRID_MTP, 4096, max_len, max_rows=max_rows, graph_sizes=sizes, max_requests=requests,
                    mtp_drafts=k, max_tokens=max_tokens)
    sizing = live.kv_sizing
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    assert (sizing.memory_fraction, sizing.total_bytes) == (GPU_MEMORY_UTILIZATION, total)
    assert sizing.activation_peak_bytes > 0 and sizing.graph_bytes > 0 and sizing.state_bytes > 0
    assert live.kv_tokens == sizing.tokens and live.info().kv_sizing == sizing
    # the pool took the share the sizing gave it: in use now is what was before, the pages and the linear state
    # (and what the profile and the warm-up keep: library workspaces of the streams they ran on, loaded kernels)
    pool = sizing.tokens * sizing.token_bytes + sizing.state_bytes
    room = int(total * sizing.memory_fraction) - sizing.in_use_bytes - sizing.activation_peak_bytes - sizing.graph_bytes
    assert room - sizing.token_bytes * live.kv_block_size < pool <= room
    assert 0 <= (total - free) - (sizing.in_use_bytes + pool) < 256 * MIB, (total - free, sizing)

    # the largest step through the run's own path (a captured mixed step, the head's drafting graph)
    step = largest_step(max_tokens, max_len, requests, max_rows, k)
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    live.begin(np.full(step.rows, max_len - 2 * k - 1), np.full(step.rows, k),
               np.array([new for _, new in step.chunks]), np.array([cached for cached, _ in step.chunks]),
               sync=True, host_s=0.0)
    live.end(mask_rows=max_rows, sample_rows=max_rows, host_s=0.0, sync=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    assert peak <= sizing.activation_peak_bytes * 1.1 + 64 * MIB, (peak, sizing)
    # every decode and drafting graph the run can capture, one decode-only step a size
    for rows in range(1, min(requests, max_rows // (1 + k)) + 1):
        live.begin(np.full(rows, 100), np.full(rows, k), np.zeros(0, np.int64), np.zeros(0, np.int64),
                   sync=True, host_s=0.0)
        live.end(mask_rows=rows * (1 + k), sample_rows=rows * (1 + k), host_s=0.0, sync=True)
    for rows in sizes:  # drafts 0: every decode size
        live.begin(np.full(rows, 100), np.zeros(rows, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                   sync=True, host_s=0.0)
        live.end(mask_rows=rows, sample_rows=rows, host_s=0.0, sync=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert live.info().graphs_captured == list(sizes)
    assert _graph_pools() <= sizing.graph_bytes * 1.2, (_graph_pools(), sizing)
    free, _ = torch.cuda.mem_get_info()
    assert total - free <= total * sizing.memory_fraction, (total - free, sizing)
