"""``live`` mode's step loop, with a tiny model on the CPU standing in for the GPU forward."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cdbench.backends import create_backend
from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.harness.config import RunConfig
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.costs.hardware import ModelSpec
from cdbench.harness.executors.hybrid import HybridExecutor
from cdbench.harness.live.forward import LiveForward
from cdbench.harness.live.paged import KVCache, size_kv_pool
from cdbench.harness.live.step import (
    KVCapacityError,
    LiveShape,
    LiveStep,
    largest_step,
    profile_memory,
)
from cdbench.harness.policies import policy
from cdbench.harness.run import max_context, simulate
from cdbench.workloads.request import Request

TINY = ModelSpec(name="tiny", params_total=1e5, n_layers=2, hidden_size=64, n_heads=8, n_kv_heads=2, head_dim=16,
                 vocab_size=50, intermediate_size=96)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def backend():
    return create_backend("xgrammar", load_vocab("cl100k"))


def _requests(vocab, n: int = 8, broken: bool = False) -> list[Request]:
    eos = vocab.eos_token_ids[0]
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append(Request(i, 0.001 * i, 24, 4))  # unconstrained
            continue
        text = json.dumps({"name": f"P{i}", "age": i}) if not (broken and i == 0) else '{"name": 7}'
        tokens = tuple(vocab.encode(text)) + (eos,)
        out.append(Request(i, 0.001 * i, 24, len(tokens), ConstraintSpec("json_schema", SCHEMA), "person", tokens))
    return out


def _live(requests, vocab_size: int, slots: int = 16, name: str = "sglang") -> LiveStep:
    """A live step whose paged cache holds ``slots`` of the longest context, in the policy's blocks."""
    max_len = max_context(requests)
    return LiveStep(TINY, vocab_size, max_len, device="cpu", kv_tokens=slots * max_len, max_rows=64,
                    logits_dtype=torch.float32, block_size=policy(name).kv_block_size)


def _run(backend, requests, name: str, live: LiveStep | None, **overrides):
    executor = HybridExecutor(backend, seed=1)
    return simulate(requests, policy(name, **overrides), executor, FixedGpuCosts(forward_base_s=0.01), seed=1,
                    trace_steps=20, live=live)


@pytest.mark.parametrize("name", ["sglang", "vllm"])
@pytest.mark.parametrize("overlap", [True, False])
def test_live_steps_run_for_real_and_outputs_stay_valid(backend, name, overlap):
    requests = _requests(backend.vocab)
    live = _live(requests, backend.vocab.size, name=name)
    result = _run(backend, requests, name, live, overlap=overlap)
    frame = result.requests
    assert result.summary.completed == len(requests)
    assert frame.loc[frame["structured"], "valid"].all()
    steps = result.steps[result.steps["kind"] != "idle"]
    assert live.steps == len(steps)
    # every duration is measured, not priced: no step takes the fixed model's 10 ms forward
    assert (steps["forward_s"] > 0).all() and not np.isclose(steps["forward_s"], 0.01).any()
    # the wall clock of a step covers its parts, which ran one after another on the CPU stand-in
    parts = steps["forward_s"] + steps["copy_s"] + steps["apply_s"] + steps["sample_s"]
    assert (steps["duration_s"] >= parts).all()
    assert (steps.loc[steps["mask_rows"] > 0, "apply_s"] > 0).all()


@pytest.mark.parametrize("name", ["sglang", "vllm"])
def test_more_requests_than_the_live_cache_holds_wait_for_memory_instead_of_failing(backend, name):
    requests = _requests(backend.vocab, n=12)
    live = _live(requests, backend.vocab.size, slots=3, name=name)
    result = _run(backend, requests, name, live)
    frame, steps = result.requests, result.steps
    assert result.summary.completed == len(requests) and frame.loc[frame["structured"], "valid"].all()
    # the scheduler's cache is the live one's: never more tokens held than its pages, the others waited
    assert result.summary.kv_capacity_tokens == live.kv_tokens
    assert (steps["kv_tokens"] <= live.kv_tokens).all()
    assert result.summary.mean_kv_wait_ms > 0
    assert live.paged.allocator.free == live.paged.pool.blocks - sum(map(len, live.paged._blocks.values()))
    # a cache of fewer tokens than the live one: vLLM preempts live too (its recomputes get fresh blocks);
    # SGLang's admission reserves each request's output (short here), so it waits instead of retracting
    live = _live(requests, backend.vocab.size, slots=3, name=name)
    block = policy(name).kv_block_size
    tight = _run(backend, requests, name, live, kv_tokens=2 * live.max_len - 8)
    frame = tight.requests
    assert tight.summary.completed == len(requests) and frame.loc[frame["structured"], "valid"].all()
    assert (frame["preemptions"].sum() > 0) == (name == "vllm")
    assert (tight.steps["kv_tokens"] <= (2 * live.max_len - 8) // block * block).all()


def test_a_live_cache_of_other_blocks_than_the_policy_is_refused(backend):
    requests = _requests(backend.vocab, n=2)
    with pytest.raises(ValueError, match="blocks of 16 tokens; the policy's kv_block_size is 1"):
        _run(backend, requests, "sglang", _live(requests, backend.vocab.size, name="vllm"))


def test_without_overlap_accepts_run_after_sampling_and_refusals_still_abort(backend):
    requests = _requests(backend.vocab, broken=True)
    result = _run(backend, requests, "sglang", _live(requests, backend.vocab.size), overlap=False)
    frame = result.requests.set_index("request_id")
    assert frame.loc[0, "abort_reason"] == "grammar_rejected"  # refused in the deferred accept
    assert (frame.drop(index=0)["abort_reason"] == "").all()
    grammar_steps = result.steps[result.steps["mask_rows"] > 0]
    assert (grammar_steps["process_s"] > 0).all()


def test_modelled_host_work_is_done_on_the_step_path(backend):
    requests = _requests(backend.vocab, n=3)
    result = _run(backend, requests, "sglang", _live(requests, backend.vocab.size), overlap=False, schedule_s=0.004)
    steps = result.steps[result.steps["kind"] != "idle"]
    assert (steps["duration_s"] >= 0.004).all()  # the busy wait holds the step for at least its length


@pytest.mark.parametrize("overlap", [True, False])
def test_live_mode_measures_the_launch_instead_of_pricing_it(backend, overlap):
    requests = _requests(backend.vocab, n=3)
    result = _run(backend, requests, "sglang", _live(requests, backend.vocab.size), overlap=overlap, launch_s=5.0)
    steps = result.steps[result.steps["kind"] != "idle"]
    # the policy's 5 s launch is not waited out: the launch is the step's measured wall time beyond
    # its timed parts
    assert (steps["duration_s"] < 5.0).all()
    assert not np.isclose(steps["launch_s"], 5.0).any()
    if not overlap:
        pre = steps[["schedule_s", "poll_s", "sync_s", "check_s"]].sum(axis=1)
        parts = pre + np.maximum(steps["forward_s"], steps["fill_s"] + steps["copy_s"]) + steps["apply_s"] \
            + steps["sample_s"] + steps["process_s"]
        assert steps["launch_s"].to_numpy() == pytest.approx((steps["duration_s"] - parts).to_numpy(), abs=1e-12)
        assert (steps["launch_s"] >= 0).all()


def test_drafts_are_query_tokens_of_their_row_and_requests_keep_their_blocks():
    live = LiveStep(TINY, 64, max_len=100, device="cpu", kv_tokens=320, max_rows=8, logits_dtype=torch.float32,
                    block_size=4)
    empty = np.zeros(0, np.int64)
    shape = LiveShape(np.array([5, 9]), np.array([2, 0]), empty, empty)
    (slots, positions), chunks, drafting = live._place(shape, np.array([7, 3]), empty)
    assert slots[0] == slots[1] == slots[2] != slots[3] and positions.tolist() == [5, 6, 7, 9]
    assert shape.decode_tokens == 4 and chunks == []
    assert drafting[0].tolist() == [slots[0], slots[3]] and drafting[1].tolist() == [8, 10]  # after the drafts
    paged = live.paged
    assert [len(paged._blocks[rid]) for rid in (7, 3)] == [2, 3]  # 8 and 10 tokens in blocks of 4
    table = live.cache.block_table
    assert table[slots[0], :2].tolist() == paged._blocks[7] and table[slots[3], :3].tolist() == paged._blocks[3]
    # request 7 grows into a third block; request 3 keeps its row and blocks; a new one takes freed blocks
    before = list(paged._blocks[3])
    live._place(LiveShape(np.array([8, 10]), np.zeros(2, np.int64), empty, empty), np.array([7, 3]), empty)
    assert len(paged._blocks[7]) == 3 and paged._blocks[3] == before
    paged.keep_only(np.array([3]))
    freed = set(range(paged.pool.blocks)) - set(before)
    assert paged.allocator.free == len(freed)
    _, chunks, _ = live._place(LiveShape(empty, empty, np.array([12]), np.array([0])), empty, np.array([9]))
    assert set(paged._blocks[9]) <= freed and table[chunks[0].slot, :3].tolist() == paged._blocks[9]


def test_a_step_beyond_the_cache_is_refused_by_name():
    live = LiveStep(TINY, 64, max_len=100, device="cpu", kv_tokens=300, max_rows=8, logits_dtype=torch.float32)
    assert (live.kv_tokens, live.kv_requests, live.kv_block_size) == (288, 8, 16)
    empty = np.zeros(0, np.int64)
    # 4 rows of 91 tokens need 24 blocks of 16; the cache has 18
    with pytest.raises(KVCapacityError, match=r"4 decode rows and 0 prefill chunks does not fit the live KV cache "
                                              r"\(288 tokens in blocks of 16, 8 requests, contexts up to 100\)"):
        live.begin(np.full(4, 90), np.zeros(4, np.int64), empty, empty, True, 0.0)
    with pytest.raises(KVCapacityError, match="a context of 150 tokens"):
        live.begin(empty, empty, np.array([50]), np.array([100]), True, 0.0)
    with pytest.raises(KVCapacityError, match="all 8 rows of the live KV cache's block table are taken"):
        live.begin(np.full(9, 1), np.zeros(9, np.int64), empty, empty, True, 0.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gives")
def test_live_mode_without_a_gpu_says_so():
    from cdbench.harness.run import run

    config = RunConfig.model_validate({"mode": "live", "workload": {"num_requests": 2}})
    with pytest.raises(ValueError, match="mode 'live' runs every step on a CUDA GPU; this machine has none"):
        run(config)


def test_live_mode_refuses_gpu_pricing_options():
    with pytest.raises(ValueError, match="live_gpu measures the GPU parts in hybrid mode; live mode runs whole"):
        RunConfig.model_validate({"mode": "live", "costs": {"live_gpu": True}})
    with pytest.raises(ValueError, match="fixed_gpu prices the GPU; live mode runs every step"):
        RunConfig.model_validate({"mode": "live", "costs": {"fixed_gpu": {}}})


def test_a_live_run_dying_mid_way_leaves_its_finished_requests_to_cdbench_report(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cdbench.cli.app import app
    from cdbench.harness.config import CostConfig
    from cdbench.results.stopped_run import STOPPED_SUMMARY_FILE

    # live mode on the CPU: the tiny model stands in for the GPU forward, and the 60th step fails as a GPU can
    monkeypatch.setattr(CostConfig, "live_step", lambda self, max_len, graph_sizes, block_size,
                        max_requests, mtp_drafts, **sizing: LiveStep(TINY, self.logits_width(), max_len, device="cpu",
                                                                    kv_tokens=8 * max_len, max_rows=64,
                                                                    logits_dtype=torch.float32,
                                                                    block_size=block_size))
    end = LiveStep.end

    def failing(self, *args, **kwargs):
        if self.steps == 60:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return end(self, *args, **kwargs)

    monkeypatch.setattr(LiveStep, "end", failing)
    out = tmp_path / "live"
    runner = CliRunner()
    result = runner.invoke(app, ["run", "--mode", "live", "-n", "40", "--rate", "200", "--out", str(out),
                                 "--set", "scheduler.max_running_requests=8"])
    assert result.exit_code == 1
    status = json.loads((out / STOPPED_SUMMARY_FILE).read_text())["run_status"]
    assert status["status"] == "failed" and "illegal memory access" in status["reason"]
    assert 0 < status["requests_done"] < 40
    reported = runner.invoke(app, ["report", str(out)])
    assert reported.exit_code == 0, reported.output
    report = (out / "report.md").read_text()
    assert "failed" in report and "kv_capacity_tokens" in report


def test_balance_decode_is_the_forwards_and_each_setting_replays_its_own_graphs():
    live = LiveStep(TINY, 64, max_len=100, device="cpu", kv_tokens=300, max_rows=8, logits_dtype=torch.float32)
    assert live.balance_decode and live.forward.balance_decode
    live._graphs[4] = None  # stands in for a graph captured with the balanced launch (CPU steps capture none)
    live.balance_decode = True
    assert live.info().graphs_captured == [4], "unchanged: the graph is kept"
    live.balance_decode = False
    assert not live.forward.balance_decode and live.info().graphs_captured == []
    live.balance_decode = True
    assert live.forward.balance_decode and live.info().graphs_captured == [4]
    assert not LiveStep(TINY, 64, max_len=100, device="cpu", kv_tokens=300, max_rows=8,
                        balance_decode=False).forward.balance_decode


# ---- the pool sized as an engine sizes it -----------------------------------------------------------------------

# a hybrid with an MTP head: every 2nd layer full attention, the others Gated DeltaNet (a fixed state a request)
HEAD = TINY.model_copy(update={
    "name": "tiny-hybrid-mtp", "n_layers": 4, "full_attention_interval": 2, "mtp_layers": 1,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4})
GIB = 2**30


def _sized(spec=TINY, **change):
    args = dict(total_bytes=80 * GIB, memory_fraction=0.9, in_use_bytes=20 * GIB, activation_peak_bytes=3 * GIB,
                graph_bytes=GIB, requests=256, max_len=4096, block_size=16)
    args.update(change)
    return size_kv_pool(spec, **args)


def test_the_pool_takes_the_fraction_less_what_is_in_use_the_peak_and_the_graphs() -> None:
    sized = _sized()
    per_token = KVCache.bytes_per_token(TINY)
    assert sized.token_bytes == per_token and sized.state_bytes == 0
    assert sized.tokens == int(80 * GIB * 0.9 - 24 * GIB) // per_token // 16 * 16
    assert sized.tokens % 16 == 0 and (sized.memory_fraction, sized.activation_peak_bytes) == (0.9, 3 * GIB)


def test_the_pool_grows_with_the_fraction_and_shrinks_with_the_peak_and_the_graphs() -> None:
    by_fraction = [_sized(memory_fraction=f).tokens for f in (0.5, 0.7, 0.88, 0.9, 1.0)]
    assert by_fraction == sorted(by_fraction) and len(set(by_fraction)) == len(by_fraction)
    by_peak = [_sized(activation_peak_bytes=p * GIB).tokens for p in (0, 1, 5, 20)]
    assert by_peak == sorted(by_peak, reverse=True) and len(set(by_peak)) == len(by_peak)
    by_graphs = [_sized(graph_bytes=g * GIB).tokens for g in (0, 2, 8)]
    assert by_graphs == sorted(by_graphs, reverse=True) and len(set(by_graphs)) == len(by_graphs)


def test_the_heads_pages_and_the_linear_state_come_out_of_the_pool() -> None:
    plain, with_head = _sized(HEAD), _sized(HEAD, extra_layers=1)
    full = HEAD.n_full_attention_layers
    assert with_head.token_bytes * full == plain.token_bytes * (full + 1)  # the head's layer paged beside the model's
    room = int(80 * GIB * 0.9) - 24 * GIB
    state = 256 * KVCache.bytes_per_slot(HEAD)
    assert state > 0 and plain.state_bytes == with_head.state_bytes == state
    assert plain.tokens == (room - state) // plain.token_bytes // 16 * 16
    assert with_head.tokens == (room - state) // with_head.token_bytes // 16 * 16 < plain.tokens
    assert _sized(HEAD, requests=64).tokens > plain.tokens  # fewer request rows, less state


def test_a_pool_that_holds_no_context_is_refused_naming_the_numbers() -> None:
    with pytest.raises(KVCapacityError, match=r"tiny: a KV pool of 0 tokens holds no context of 4096: 0.3 of "
                                              r"80.00 GiB less 20.00 GiB in use .*3.00 GiB activation peak, "
                                              r"1.00 GiB of CUDA graphs"):
        _sized(memory_fraction=0.3)
    just = _sized(activation_peak_bytes=int(80 * GIB * 0.9) - 21 * GIB - 4096 * KVCache.bytes_per_token(TINY))
    assert just.tokens == 4096  # room for one context, in whole blocks
    with pytest.raises(KVCapacityError, match="a KV pool of 4080 tokens holds no context of 4096"):
        _sized(activation_peak_bytes=just.activation_peak_bytes + 1)  # a byte less: a block less
    with pytest.raises(ValueError, match="memory_fraction must be in"):
        _sized(memory_fraction=1.5)


@pytest.mark.parametrize(("max_tokens", "max_len", "requests", "max_rows", "drafts"),
                         [(8192, 4096, 256, 1024, 2), (8192, 100_000, 256, 1024, 0), (8192, 300, 4, 1024, 0),
                          (100, 300, 256, 1024, 2), (2048, 512, 1024, 1024, 3), (64, 40, 8, 8, 1)])
def test_the_largest_step_fills_the_budget_within_the_rows_and_the_contexts(max_tokens, max_len, requests, max_rows,
                                                                          drafts) -> None:
    step = largest_step(max_tokens, max_len, requests, max_rows, drafts)
    per_row, chunks = 1 + drafts, len(step.chunks)
    assert step.rows + chunks <= requests and step.rows * per_row + chunks <= max_rows
    assert all(0 < new and cached + new <= max_len for cached, new in step.chunks)
    assert all(cached == 0 for cached, _ in step.chunks[:-1])
    if step.chunks:
        assert sum(step.chunks[-1]) == max_len  # the last chunk's attention reads a cached prefix
    # the budget filled, unless the rows or the contexts leave less; then every row of the table takes part
    assert step.tokens == max_tokens or step.rows * per_row >= max_tokens or step.rows + chunks == requests
    assert step.rows == min(requests, max_rows // per_row) or chunks  # as many decode rows as can sample


def test_the_profile_runs_the_largest_step_the_heads_drafts_and_the_sampling_on_a_temporary_pool(monkeypatch):
    """The profile's path on the CPU at tiny shapes: only the memory readings are injected."""
    import cdbench.harness.live.step as step_module

    forward = LiveForward(HEAD, "cpu", dtype=torch.bfloat16, mtp=True)
    step = largest_step(max_tokens=48, max_len=40, requests=6, max_rows=16, drafts=2)
    assert step.rows == 5 and step.chunks == ((7, 33),)
    ran = []

    class Readings:
        def start(self) -> int:
            ran.append("start")
            return 1000

        def peak(self) -> int:
            ran.append("peak")
            return 5000

        def reserved(self) -> int:
            raise AssertionError("no graphs on a CPU")

    def spy(name, run):
        def called(*args, **kwargs):
            ran.append((name, args, kwargs))
            return run(*args, **kwargs)
        return called

    monkeypatch.setattr(forward, "step", spy("step", forward.step))
    monkeypatch.setattr(forward, "draft", spy("draft", forward.draft))
    monkeypatch.setattr(step_module, "apply_bitmask", spy("apply", step_module.apply_bitmask))
    logits, mask = torch.randn(16, 64), torch.ones((16, 2), dtype=torch.int32)
    profiled = profile_memory(forward, step, 40, 6, 4, 2, logits, mask, Readings(), graph_sizes=(1, 2, 4))
    assert (profiled.step, profiled.peak_bytes, profiled.graph_bytes) == (step, 4000, 0)
    assert [r if isinstance(r, str) else r[0] for r in ran] == ["start", "step", "draft", "apply", "peak"]
    (_, (cache, decode, chunks), _), (_, (_, draft, passes), _), (_, (rows, _), _) = ran[1:4]
    assert len(decode.positions) == 5 * 3 and [(c.cached, c.new) for c in chunks] == [(7, 33)]
    assert len(draft.slots) == 5 and passes == 2 and len(rows) == 16
    assert cache.state and len(cache.k) == HEAD.n_full_attention_layers + 1  # linear state, the head's pages
    # the temporary pool held the step's blocks only: 5 rows of 1 + 3 + 2 tokens, one context of 40
    assert cache.k[0].shape[0] == 5 * 2 + 10


def test_a_live_step_with_its_kv_tokens_given_records_no_sizing() -> None:
    live = LiveStep(TINY, 64, max_len=100, device="cpu", kv_tokens=300, max_rows=8)
    assert live.kv_sizing is None and live.info().kv_sizing is None
    with pytest.raises(ValueError, match="kv_tokens is required on a CPU device"):
        LiveStep(TINY, 64, max_len=100, device="cpu", max_rows=8)
