"""End-to-end hybrid runs: the real xgrammar backend on cl100k, outputs validated."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cdbench.backends import create_backend
from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.executors.hybrid import HybridExecutor
from cdbench.harness.policies import policy
from cdbench.harness.run import simulate
from cdbench.workloads.drafts import DraftSource
from cdbench.workloads.request import Request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


@pytest.fixture(scope="module")
def backend():
    return create_backend("xgrammar", load_vocab("cl100k"))


def _requests(vocab, n=12, broken: bool = False):
    eos = vocab.eos_token_ids[0]
    out = []
    for i in range(n):
        if i % 4 == 3:
            out.append(Request(i, 0.002 * i, 40, 5))
            continue
        if i % 4 == 2:
            spec, sid, text = ConstraintSpec("regex", r"\d{3}-\d{4}"), "phone", f"555-{i:04d}"
        elif i % 4 == 1:
            spec, sid, text = ConstraintSpec("choice", ["yes", "no", "maybe"]), "yn", ["yes", "no", "maybe"][i % 3]
        else:
            spec, sid = ConstraintSpec("json_schema", SCHEMA), "person"
            text = json.dumps({"name": f"Person {i}", "age": i, "tags": ["a", f"t{i}"]})
        if broken and i == 0:
            text = '{"name": 7}'
        tokens = tuple(vocab.encode(text)) + (eos,)
        out.append(Request(i, 0.002 * i, 40, len(tokens), spec, sid, tokens))
    return out


def _run(backend, requests, name, **overrides):
    executor = HybridExecutor(backend, alpha=overrides.pop("alpha", 0.0), seed=1)
    return simulate(requests, policy(name, **overrides), executor, FixedGpuCosts(forward_base_s=0.01), seed=1,
                    trace_steps=50)


@pytest.mark.parametrize("name", ["sglang", "vllm"])
def test_hybrid_outputs_are_valid_and_backend_time_is_measured(backend, name):
    result = _run(backend, _requests(backend.vocab), name)
    frame = result.requests
    assert (frame["abort_reason"] == "").all()
    assert frame.loc[frame["structured"], "valid"].all()
    assert frame.loc[~frame["structured"], "valid"].isna().all()
    assert (frame["output_tokens"] == frame["output_len"]).all()
    assert result.summary.validity_rate == 1.0
    assert 0 < result.backend_call_s < result.wall_s
    assert result.steps["fill_s"].sum() > 0
    assert any(s.track == "rank0/compile0" for s in result.timeline.spans)


def test_hybrid_spec_decoding_rolls_back_and_stays_valid(backend):
    result = _run(backend, _requests(backend.vocab), "vllm", spec_tokens=3, alpha=0.6)
    frame = result.requests
    structured = frame[frame["structured"]]
    assert structured["valid"].all()
    assert structured["rolled_back"].sum() > 0
    assert (structured["rolled_back"] <= structured["drafted"] - structured["accepted"]).all()
    assert (frame["output_tokens"] == frame["output_len"]).all()


def test_hybrid_jump_forward_emits_forced_tokens_and_stays_valid(backend):
    result = _run(backend, _requests(backend.vocab), "sglang", jump_forward=True)
    frame = result.requests
    assert frame.loc[frame["spec_key"] == 0, "jump_forward_tokens"].min() > 0  # JSON keys are forced
    assert frame.loc[frame["structured"], "valid"].all()


def test_grammar_rejection_aborts_under_sglang_and_marks_invalid_under_vllm(backend):
    requests = _requests(backend.vocab, n=4, broken=True)
    assert row_of(_run(backend, requests, "sglang"), 0)["abort_reason"] == "grammar_rejected"
    vllm = row_of(_run(backend, requests, "vllm"), 0)
    assert vllm["abort_reason"] == ""
    assert not vllm["valid"]


def test_compile_error_aborts_and_the_rest_of_the_run_finishes(backend):
    requests = _requests(backend.vocab, n=4)
    requests.append(Request(9, 0.0, 10, 2, ConstraintSpec("regex", "(unclosed"), "bad", (1, 2)))
    result = _run(backend, requests, "vllm")
    assert row_of(result, 9)["abort_reason"] == "compile_error"
    assert result.summary.completed == 4
    (key, reason), = result.compile_errors.items()
    assert key == "regex:bad" and reason


def test_requests_without_oracle_tokens_random_walk_until_the_grammar_terminates(backend):
    specs = [ConstraintSpec("regex", r"\d{3}-\d{4}"), ConstraintSpec("choice", ["yes", "no"])]
    requests = [Request(i, 0.001 * i, 10, 40, specs[i % 2], f"walk{i % 2}") for i in range(6)]
    result = _run(backend, requests, "vllm", spec_tokens=2, alpha=0.5)
    frame = result.requests
    assert (frame["abort_reason"] == "").all()
    assert frame["valid"].all()
    assert (frame["output_tokens"] < frame["output_len"]).all()  # ended by the grammar, not the cap
    assert (frame["drafted"] == 0).all()  # no oracle, no drafts


def test_random_walk_rows_propose_no_drafts_and_pay_no_forward_for_them(backend):
    # k = 2 is scheduled, but a random walk has no drafts: the forward verifies the row's token alone
    request = Request(0, 0.0, 10, 12, ConstraintSpec("regex", r"\d{3}-\d{4}"), "walk")
    executor = HybridExecutor(backend, alpha=0.5, seed=1)
    gpu = FixedGpuCosts(forward_base_s=0.01, decode_row_s=0.001)
    result = simulate([request], policy("vllm", spec_tokens=2, overlap=False), executor, gpu, seed=1, trace_steps=0)
    decode = result.steps[result.steps["kind"] == "decode"]
    assert len(decode) > 0
    assert decode["forward_s"].tolist() == pytest.approx([0.011] * len(decode), abs=1e-12)
    assert result.requests["drafted"].tolist() == [0]


class _EndingDrafts(DraftSource):
    """Drafts the end of the answer first: EOS, then the answer's first token."""

    def propose_block(self, requests, oracle, rows, positions, ks):
        eos = self.vocab.eos_token_ids[0]
        block = np.array([[eos, int(oracle.tokens[oracle.start[r]])] for r in rows.tolist()]).reshape(-1, 2)
        counts = np.minimum(ks, 2)
        return block[:, :int(counts.max(initial=0))], counts


def test_a_draft_that_ends_the_answer_builds_no_mask_row_after_it(backend):
    # "1234567" is [123, 456, 7]; EOS is grammar-valid after any digit, so each decode step's
    # first draft terminates the matcher: one mask row, and both drafts rolled back or never applied
    vocab = backend.vocab
    tokens = tuple(vocab.encode("1234567")) + (vocab.eos_token_ids[0],)
    request = Request(0, 0.0, 10, len(tokens), ConstraintSpec("regex", r"\d+"), "digits", tokens)
    executor = HybridExecutor(backend, drafts=_EndingDrafts(0.0, vocab, 0))
    result = simulate([request], policy("vllm", spec_tokens=2, overlap=False), executor,
                      FixedGpuCosts(forward_base_s=0.01), trace_steps=0)
    r = row_of(result, 0)
    assert (r["abort_reason"], r["valid"], r["output_tokens"]) == ("", True, len(tokens))
    assert (r["accepted"], r["rolled_back"]) == (0, 2)  # EOS entered the grammar and was rolled back, twice
    decode = result.steps[result.steps["kind"] == "decode"]
    assert decode["mask_rows"].tolist() == [1] * len(decode)


def row_of(result, request_id):
    frame = result.requests
    return frame[frame["request_id"] == request_id].iloc[0].to_dict()


@pytest.mark.slow
def test_hybrid_reasoner_thinks_then_answers_validly():
    vocab = load_vocab("qwen3.6")
    backend = create_backend("reasoner", vocab, inner="xgrammar")
    eos = vocab.eos_token_ids[0]
    requests = []
    for i in range(6):
        tokens = tuple(vocab.encode(f"555-{i:04d}")) + (eos,)
        requests.append(Request(i, 0.001 * i, 50, len(tokens), ConstraintSpec("regex", r"\d{3}-\d{4}"), "p", tokens,
                                think_len=10 if i % 2 else 0, thinking_budget=4 if i % 3 == 0 else None))
    result = _run(backend, requests, "sglang", spec_tokens=2, alpha=0.5)
    frame = result.requests
    assert frame["valid"].all()
    assert frame["think_tokens"].tolist() == [0, 11, 0, 5, 0, 11]
    assert (frame["output_tokens"] == frame["output_len"] + frame["think_tokens"]).all()
