"""The KV cache in the scheduler: capacity, admission within it, each engine's victims, grammar state
across a preemption, determinism."""

from __future__ import annotations

import json
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdbench.backends import create_backend
from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.harness.batch import RunningBatch
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.costs.hardware import resolve_gpu, resolve_model
from cdbench.harness.executors.hybrid import HybridExecutor
from cdbench.harness.executors.model import FixedGrammarCosts, ModelExecutor
from cdbench.harness.kv_cache import KVCache, NoKVCacheError, capacity_tokens
from cdbench.harness.policies import policy
from cdbench.harness.records import RequestTable
from cdbench.harness.run import simulate
from cdbench.harness.scheduler import Scheduler
from cdbench.workloads.request import Request

GPU = FixedGpuCosts(forward_base_s=0.01, decode_row_s=1e-4)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_capacity_is_what_the_fraction_leaves_after_the_weights_in_whole_blocks():
    qwen, h100 = resolve_model("qwen3-8b"), resolve_gpu("h100")
    # (80e9 * 0.88 - 8.19e9 * 2) / (2 * 8 * 128 * 2 bytes * 36 layers)
    assert capacity_tokens(qwen, h100, 1, 0.88, 1, 256) == int((80e9 * 0.88 - 8.19e9 * 2) // 147456)
    assert capacity_tokens(qwen, h100, 1, 0.9, 16, 256) % 16 == 0
    # two ranks: half the weights and half the KV heads each
    assert capacity_tokens(qwen, h100, 2, 0.9, 1, 256) > 2 * capacity_tokens(qwen, h100, 1, 0.9, 1, 256)
    # linear-attention layers hold no KV per token, but a fixed state per request
    hybrid, h200 = resolve_model("qwen3.5-35b-a3b"), resolve_gpu("h200")
    assert hybrid.kv_bytes_per_token() == 2 * 2 * 256 * 2 * 10  # only its 10 full-attention layers
    free = capacity_tokens(hybrid, h200, 1, 0.9, 1, 0)
    assert free - capacity_tokens(hybrid, h200, 1, 0.9, 1, 256) == pytest.approx(
        256 * hybrid.state_bytes_per_request() / hybrid.kv_bytes_per_token(), abs=1)
    with pytest.raises(NoKVCacheError, match="qwen3-8b on h100-sxm: 0.1 of"):
        capacity_tokens(qwen, h100, 1, 0.1, 1, 256)


def test_presets_follow_the_engines_and_unbounded_is_todays_loop():
    assert (policy("vllm").kv_cache, policy("vllm").kv_memory_fraction, policy("vllm").kv_block_size) == ("vllm", 0.9, 16)
    assert (policy("sglang").kv_cache, policy("sglang").kv_memory_fraction, policy("sglang").kv_block_size) == \
        ("sglang", 0.88, 1)
    reqs = _burst(40, 300, 200)
    off = simulate(reqs, policy("vllm", kv_cache="unbounded"), ModelExecutor(FixedGrammarCosts()), GPU)
    # fixed GPU costs have no model shape: the preset's cache is unbounded there too
    preset = simulate(reqs, policy("vllm"), ModelExecutor(FixedGrammarCosts()), GPU)
    assert off.summary.kv_capacity_tokens is None and preset.summary.kv_capacity_tokens is None
    assert preset.summary.model_dump_json() == off.summary.model_dump_json()
    assert preset.requests.equals(off.requests)


def _burst(n: int, prompt: int, output: int, gap: float = 0.0005) -> list[Request]:
    return [Request(i, gap * i, prompt + 7 * (i % 5), output + 11 * (i % 3)) for i in range(n)]


class _Checked(Scheduler):
    """A scheduler that checks the cache's bound on the running batch itself after every iteration."""

    def _iterate(self, t):
        duration = super()._iterate(t)
        block = self.kv.block
        held = int(((self.batch.cached + block - 1) // block).sum())
        assert held <= self.kv.blocks, f"{held} blocks held of {self.kv.blocks}"
        return duration


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["vllm", "sglang"]), n=st.integers(2, 40), prompt=st.integers(1, 300),
       output=st.integers(1, 300), tokens=st.integers(700, 6000), block=st.sampled_from([1, 16]),
       mixed=st.booleans(), gap=st.sampled_from([0.0, 0.002]))
def test_the_running_batch_never_holds_more_than_the_cache(name, n, prompt, output, tokens, block, mixed, gap):
    reqs = _burst(n, prompt, output, gap)
    cfg = policy(name, kv_tokens=tokens, kv_block_size=block, mixed_batches=mixed, max_batched_tokens=512)
    sched = _Checked(cfg, reqs, ModelExecutor(FixedGrammarCosts()), GPU)
    sched.run()
    rec = sched.rec
    assert sched.ended == n
    done = rec.abort == 0
    assert (rec.output_tokens[done] == rec.output_len[done]).all()
    steps = sched.steps.to_frame()
    assert (steps["kv_tokens"] <= sched.kv.tokens).all()


def _former_kv(name: str, cached: list[int], decoded: list[int], prompts: list[int], tokens: int):
    """A running batch of decode rows (admitted in order) under a cache of ``tokens``."""
    n = len(cached)
    rec = RequestTable(n)
    rec.prompt_len[:] = prompts
    rec.output_len[:] = 100
    gen_total = np.full(n, 100, np.int64)
    entry = np.zeros((len(RunningBatch.INTS), n), np.int64)
    entry[0], entry[3] = np.arange(n), gen_total - decoded
    batch = RunningBatch(entry)
    batch.append(np.arange(n))
    batch.cached[:] = cached
    return KVCache(name, tokens, 1, None, rec, batch, gen_total), batch


def test_vllm_preempts_the_latest_admitted_requests_and_they_return_first_in_line():
    from cdbench.harness.admission import BatchFormer

    kv, batch = _former_kv("vllm", [10, 10, 10, 10], [5, 5, 5, 5], [5, 5, 5, 5], tokens=42)
    waiting = deque([9])
    cfg = policy("vllm", kv_tokens=42, kv_block_size=1)
    former = BatchFormer(cfg, kv.rec, batch, waiting, lambda r, t: (True, 0.0), lambda r, t: True, kv)
    plan = former.form(1.0, 1.0, 0.0, 0.0, 0.0, 0.0)
    # 4 rows of 11 tokens do not fit 42: the last admitted (row 3) is preempted, and nobody is admitted
    assert batch.rid.tolist() == [0, 1, 2] and list(waiting) == [3, 9]
    assert len(plan.dec_rows) == 3 and kv.rec.preemptions.tolist() == [0, 0, 0, 1]
    assert kv.rec.recomputed_tokens[3] == 10
    # its recompute prefills all it had computed; what it has left to generate is kept
    assert batch.entry_prefill[3] == 10


def test_sglang_retracts_the_fewest_decoded_then_the_longest_prompt():
    kv, batch = _former_kv("sglang", [30, 30, 30, 30, 30], [9, 2, 2, 5, 2], [21, 10, 28, 25, 28], tokens=152)
    victims = kv.sglang_victims(1, np.arange(5))
    # one token a row needs 5 of 2 free; retraction pops the end of the stable descending sort by
    # (decoded, -prompt) until 20 tokens a remaining row are free: rows 4 then 2 (2 decoded, prompt 28;
    # the later row of a tie first), which frees 62 >= 3 x 20; row 1 (2 decoded, prompt 10) would be next
    assert victims.tolist() == [4, 2]
    # the estimate is set from the requests kept: (decoded + 20 each) / max_new_tokens
    assert kv.ratio == pytest.approx((9 + 2 + 5 + 3 * 20) / 300)


def test_sglang_decays_its_estimate_when_decode_fits_and_resets_when_idle():
    kv, _ = _former_kv("sglang", [10, 10], [1, 1], [9, 9], tokens=1000)
    start = kv.ratio
    assert len(kv.sglang_victims(1, np.arange(2))) == 0 and kv.ratio < start
    kv.idle()
    assert kv.ratio == start


@pytest.fixture(scope="module")
def backend():
    made = create_backend("xgrammar", load_vocab("cl100k"))
    # compiled once before any run: a cold first compile (tens of ms of host time) holds every request back and
    # they are then admitted together without needing a retraction, so each run starts with xgrammar's cache
    # warm whatever ran before it in this process (a test run alone, or on another worker, saw none)
    made.compile(ConstraintSpec("json_schema", SCHEMA))
    return made


def _structured(vocab, n: int) -> list[Request]:
    eos = vocab.eos_token_ids[0]
    out = []
    for i in range(n):
        text = json.dumps({"name": f"Person number {i} " + "x" * (i % 7), "age": 1000 + i})
        tokens = tuple(vocab.encode(text)) + (eos,)
        out.append(Request(i, 0.0005 * i, 40 + i % 9, len(tokens), ConstraintSpec("json_schema", SCHEMA), "person",
                           tokens))
    return out


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_a_preempted_structured_request_resumes_with_its_grammar_and_its_output_stays_valid(backend, name):
    requests = _structured(backend.vocab, 24)
    result = simulate(requests, policy(name, kv_tokens=400, kv_block_size=1 if name == "sglang" else 16),
                      HybridExecutor(backend, seed=1), GPU, seed=1)
    frame = result.requests
    assert result.summary.completed == len(requests)
    assert frame["preemptions"].sum() > 0 and frame["recomputed_tokens"].sum() > 0
    preempted = frame[frame["preemptions"] > 0]
    assert preempted["valid"].all() and frame["valid"].all()
    assert (preempted["output_tokens"] == preempted["output_len"]).all()
    # the first token stays the first one, not the recompute's
    assert (frame["first_token_s"] < frame["finish_s"]).all()
    counted = result.summary.kv_retractions if name == "sglang" else result.summary.kv_preemptions
    assert counted == int(frame["preemptions"].sum())


def test_a_context_the_cache_can_never_hold_is_refused_and_the_rest_run():
    reqs = [Request(0, 0.0, 100, 50), Request(1, 0.0, 900, 200), Request(2, 0.001, 120, 30)]
    result = simulate(reqs, policy("vllm", kv_tokens=800), ModelExecutor(FixedGrammarCosts()), GPU)
    assert result.requests["abort_reason"].astype(str).tolist() == ["", "kv_capacity", ""]
    assert result.summary.aborts_by_reason == {"kv_capacity": 1}


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_model_mode_with_preemptions_is_deterministic(name):
    reqs = _burst(60, 200, 150)
    cfg = policy(name, kv_tokens=3000)
    runs = [simulate(reqs, cfg, ModelExecutor(FixedGrammarCosts()), GPU, seed=3) for _ in range(2)]
    assert runs[0].requests["preemptions"].sum() > 0
    assert runs[0].requests.equals(runs[1].requests)
    assert runs[0].steps.equals(runs[1].steps)
    assert runs[0].summary.mean_kv_wait_ms > 0
