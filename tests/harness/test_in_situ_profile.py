"""A hybrid run keeps the grammar costs it measured as a GrammarProfile, which ``model`` mode replays."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cdbench.backends import create_backend
from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.costs.grammar_profile import CompileMeasurement, GrammarProfile, WalkMeasurement
from cdbench.harness.costs.spec_profile import base_key_text, instance_key, spec_key_hash
from cdbench.harness.executors.base import SpecKeys, StepRows
from cdbench.harness.executors.hybrid import HybridExecutor
from cdbench.harness.executors.in_situ import InSituRecorder, compile_status
from cdbench.harness.executors.model import ModelExecutor, ProfileGrammarCosts
from cdbench.harness.policies import policy
from cdbench.harness.run import simulate
from cdbench.workloads.request import Request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def backend():
    return create_backend("xgrammar", load_vocab("cl100k"))


def _requests(vocab, n: int = 12) -> list[Request]:
    eos = vocab.eos_token_ids[0]
    out = []
    for i in range(n):
        if i % 3 == 0:
            spec, sid, text = ConstraintSpec("regex", r"\d{3}-\d{4}"), f"c/phone{i}", f"555-{i:04d}"
        else:
            spec, sid = ConstraintSpec("json_schema", {**SCHEMA, "title": f"p{i}"}), f"c/person{i}"
            text = json.dumps({"name": f"Person {i}", "age": i})
        tokens = tuple(vocab.encode(text)) + (eos,)
        out.append(Request(i, 0.003 * i, 40, len(tokens), spec, sid, tokens))
    return out


def _hybrid(backend, requests, name="sglang", **overrides):
    executor = HybridExecutor(backend, alpha=overrides.pop("alpha", 0.0), seed=1)
    return simulate(requests, policy(name, **overrides), executor, FixedGpuCosts(forward_base_s=0.01), seed=1,
                    trace_steps=0)


def test_hybrid_profile_round_trips_and_covers_every_spec(backend, tmp_path) -> None:
    requests = _requests(backend.vocab)
    result = _hybrid(backend, requests)
    profile = result.grammar_profile
    assert profile is not None and profile.backend == "xgrammar" and profile.vocab == "cl100k"
    path = tmp_path / "grammar_profile.json"
    profile.save(path)
    assert GrammarProfile.load(path) == profile
    assert len(profile.specs) == len(requests)
    for r in requests:
        spec = profile.specs[spec_key_hash(f"{r.spec.kind}:{r.spec_id}")]
        assert spec.status == "ok" and spec.compile_s > 0 and spec.corpus == "c"
        assert spec.fills == r.output_len  # one fill per answer token, positions 0..len-1
        assert spec.fill_scale_s > 0 and spec.fill_curve[0] > 0 and spec.accept_s > 0
    assert profile.kinds["json_schema"].fill_s.count == sum(r.output_len for r in requests if r.spec.kind == "json_schema")
    assert profile.kinds["regex"].fill_residual.count > 0
    # the steps' fill seconds are the profile's samples
    assert profile.overall.fill_s.count == int(result.steps["mask_rows"].sum())
    # and each walked text keeps its own fills by position, found by its spec and tokens
    assert len(profile.instances) == len(requests)
    for r in requests:
        text = f"{r.spec.kind}:{r.spec_id}"
        walked = profile.instances[instance_key(base_key_text(text, r.spec.kind, r.spec_id), r.output_tokens)]
        assert walked.walks == 1 and len(walked.fill_s) == r.output_len and all(v > 0 for v in walked.fill_s)


def test_hybrid_profile_with_drafts_measures_rollbacks(backend) -> None:
    result = _hybrid(backend, _requests(backend.vocab), "vllm", spec_tokens=3, alpha=0.6)
    profile = result.grammar_profile
    assert result.requests["rolled_back"].sum() > 0
    assert profile.overall.rollback_s.count > 0 and profile.overall.rollback_s.mean >= 0


def test_model_mode_replays_the_hybrid_profile(backend) -> None:
    requests = _requests(backend.vocab)
    profile = _hybrid(backend, requests).grammar_profile
    costs = ProfileGrammarCosts(profile, 0)
    replay = simulate(requests, policy("sglang"), ModelExecutor(costs), FixedGpuCosts(forward_base_s=0.01), seed=1,
                      trace_steps=0)
    frame = replay.requests.sort_values("request_id")
    measured = [profile.specs[spec_key_hash(f"{r.spec.kind}:{r.spec_id}")].compile_s for r in requests]
    assert (frame["compile_end_s"] - frame["compile_start_s"]).tolist() == pytest.approx(measured)


def test_compile_status_of_backend_reasons() -> None:
    assert [compile_status(r) for r in (None, "unsupported", "timeout", "invalid")] == [
        "ok", "unsupported", "timeout", "error"]


def test_a_refused_token_is_measured_and_replayed(backend) -> None:
    requests = _requests(backend.vocab)
    eos = backend.vocab.eos_token_ids[0]
    bad = requests[1]  # a JSON request whose oracle breaks its schema at "7"
    tokens = tuple(backend.vocab.encode('{"name": 7}')) + (eos,)
    requests[1] = Request(bad.request_id, bad.arrival_s, 40, len(tokens), bad.spec, bad.spec_id, tokens)
    hybrid = _hybrid(backend, requests)
    aborted = hybrid.requests.set_index("request_id")["abort_reason"]
    assert aborted[1] == "grammar_rejected" and (aborted.drop(1) == "").all()
    spec = hybrid.grammar_profile.specs[spec_key_hash(f"json_schema:{bad.spec_id}")]
    assert spec.walks == 1 and spec.rejected == 1
    refused_at = int(hybrid.requests.set_index("request_id").loc[1, "output_tokens"]) - 1
    assert spec.rejected_at == refused_at
    replay = simulate(requests, policy("sglang"), ModelExecutor(ProfileGrammarCosts(hybrid.grammar_profile, 0)),
                      FixedGpuCosts(forward_base_s=0.01), seed=1, trace_steps=0)
    frame = replay.requests.set_index("request_id")
    assert frame.loc[1, "abort_reason"] == "grammar_rejected" and (frame["abort_reason"].drop(1) == "").all()
    assert frame.loc[1, "output_tokens"] == hybrid.requests.set_index("request_id").loc[1, "output_tokens"]


def test_draft_accepts_recorded_in_fills_are_charged_once_in_model_mode() -> None:
    # hybrid's fill seconds of a drafted row cover 1 + k fills and the k drafts' accepts; model mode
    # charges 1 + k profiled fills plus k accepts, so the recorded fill must be one fill alone
    fill, accept, k = 10e-6, 3e-6, 3
    spec = ConstraintSpec("regex", r"\d+")
    requests = [Request(i, 0.0, 4, 40, spec, f"c/n{i}", tuple(range(40))) for i in range(2)]
    keys = SpecKeys.of(requests)
    recorder = InSituRecorder()
    recorder.compiled(0, 0.01, None)
    recorder.compiled(1, 0.01, None)
    rids = np.arange(2)
    for step in range(10):
        cursor = np.full(2, 4 * step)
        drafted = step % 2 == 1  # alternating: steps without drafts measure the accept
        rows = np.full(2, 1 + k if drafted else 1)
        recorder.step(rids, cursor, rows * fill + (rows - 1) * accept, rows, round(2 * accept * 1e9),
                      None, None)
    profile = recorder.profile("xgrammar", "cl100k", keys, np.zeros(2, np.int64), "test")
    assert profile.overall.fill_s.mean == pytest.approx(fill)
    assert profile.overall.accept_s.mean == pytest.approx(accept)
    model = ModelExecutor(ProfileGrammarCosts(profile, 0), alpha=1.0)
    model.prepare(requests, keys)
    for rid in range(len(requests)):  # each request arrives: its cost pools are built
        model.arrive(rid)
    rows = StepRows(rids, np.ones(2, bool), np.full(2, k), np.full(2, 20), np.zeros(2, np.int64))
    work = model.step(rows, np.random.default_rng(0))
    assert work.fill_s.tolist() == pytest.approx([(1 + k) * fill + k * accept] * 2)


def _steps_of(result) -> tuple[int, int]:
    return int(result.steps["mask_rows"].sum()), int(result.requests["rolled_back"].sum())


def test_draft_validity_is_measured_and_model_mode_builds_only_the_valid_rows(backend) -> None:
    requests = _requests(backend.vocab, 24)
    hybrid = _hybrid(backend, requests, "vllm", spec_tokens=3, alpha=0.6)
    profile = hybrid.grammar_profile
    mask_rows, rolled = _steps_of(hybrid)
    # the valid drafts past the accepted ones are the ones rolled back; some drafts the grammar refused
    chains = [s for s in profile.specs.values() if s.draft_tried]
    assert sum(sum(s.draft_valid) for s in chains) == rolled
    assert sum(s.draft_valid[0] for s in chains) < sum(s.draft_tried[0] for s in chains)
    replays = [simulate(requests, policy("vllm", spec_tokens=3), ModelExecutor(ProfileGrammarCosts(profile, seed), 0.6),
                        FixedGpuCosts(forward_base_s=0.01), seed=seed, trace_steps=0) for seed in range(4)]
    model_rows = np.mean([_steps_of(r)[0] for r in replays])
    assert model_rows == pytest.approx(mask_rows, rel=0.1)  # (1 + k rows per drafted row: +50 % and more)
    for r in replays:  # a draft the grammar refused is never accepted nor rolled back
        assert (r.requests["accepted"] + r.requests["rolled_back"] <= r.requests["drafted"]).all()


def test_model_mode_accepts_no_draft_the_grammar_refuses() -> None:
    spec, k, n = ConstraintSpec("regex", r"\d+"), 3, 64
    walk = WalkMeasurement("c/n", "regex", fill_s=np.full(40, 1e-5), accept_s=np.full(40, 2e-6),
                           rollback_s=np.full(4, 3e-6), drafts_past=np.full(20, k), valid_past=np.zeros(20, np.int64))
    profile = GrammarProfile.from_measurements("t", "cl100k", [CompileMeasurement("c/n", "regex", "ok", 0.01)], [walk])
    assert profile.specs[spec_key_hash("regex:c/n")].draft_tried == [20] and profile.kinds["regex"].draft_valid == [0]
    requests = [Request(i, 0.0, 4, 40, spec, "c/n") for i in range(n)]
    model = ModelExecutor(ProfileGrammarCosts(profile, 0), alpha=0.5)
    model.prepare(requests, SpecKeys.of(requests))
    for rid in range(len(requests)):  # each request arrives: its cost pools are built
        model.arrive(rid)
    rows = StepRows(np.arange(n), np.ones(n, bool), np.full(n, k), np.full(n, 20), np.zeros(n, np.int64))
    work = model.step(rows, np.random.default_rng(0))
    # only the accepted drafts were grammar-valid: no row past them, nothing valid to roll back
    assert work.accepted.max() > 0
    assert (work.mask_rows == work.accepted + 1).all() and not work.rolled_back.any()


def test_random_walk_ends_are_measured_and_replayed(backend) -> None:
    spec = ConstraintSpec("regex", r"\d{3}-\d{4}")
    requests = [Request(i, 0.003 * i, 40, 40, spec, f"c/phone{i}") for i in range(6)]  # no oracle: random walks
    hybrid = _hybrid(backend, requests)
    ended = hybrid.requests.sort_values("request_id")["output_tokens"].to_numpy()
    assert (ended < 40).all()  # the grammar terminated every walk early
    for i, r in enumerate(requests):
        s = hybrid.grammar_profile.specs[spec_key_hash(f"regex:{r.spec_id}")]
        assert s.random_walks == 1 and s.walk_ends == [ended[i]]
    replay = simulate(requests, policy("sglang"), ModelExecutor(ProfileGrammarCosts(hybrid.grammar_profile, 0)),
                      FixedGpuCosts(forward_base_s=0.01), seed=1, trace_steps=0)
    frame = replay.requests.sort_values("request_id")
    assert frame["output_tokens"].tolist() == ended.tolist() and (frame["abort_reason"] == "").all()


def test_thinking_accepts_are_measured_and_charged() -> None:
    spec, per_token = ConstraintSpec("regex", r"\d+"), 5e-6
    requests = [Request(i, 0.0, 4, 10, spec, f"c/n{i}", tuple(range(10)), think_len=64) for i in range(2)]
    keys = SpecKeys.of(requests)
    recorder = InSituRecorder()
    rids = np.arange(2)
    for rid in (0, 1):
        recorder.compiled(rid, 0.01, None)
        recorder.thought(rid, 64, round(64 * per_token * 1e9))
    recorder.step(rids, np.zeros(2, np.int64), np.full(2, 1e-5), np.ones(2, np.int64), 4000, None, None)
    profile = recorder.profile("reasoner", "cl100k", keys, np.zeros(2, np.int64), "test")
    assert profile.specs[spec_key_hash("regex:c/n0")].think_accept_s == pytest.approx(per_token)
    model = ModelExecutor(ProfileGrammarCosts(profile, 0))
    model.prepare(requests, keys)
    for rid in range(len(requests)):  # each request arrives: its cost pools are built
        model.arrive(rid)
    rows = StepRows(rids, np.zeros(2, bool), np.zeros(2, np.int64), np.full(2, 10), np.array([30, 0]))
    work = model.step(rows, np.random.default_rng(0))
    assert work.process_s == pytest.approx(per_token)  # the thinking row's one token; the other is not thinking


def test_reasoner_hybrid_measures_thinking_accepts() -> None:
    vocab = load_vocab("qwen3.6")
    reasoner = create_backend("reasoner", vocab, inner="xgrammar")
    requests = [Request(r.request_id, r.arrival_s, r.prompt_len, r.output_len, r.spec, r.spec_id, r.output_tokens,
                        think_len=16) for r in _requests(vocab, 4)]
    result = simulate(requests, policy("sglang"), HybridExecutor(reasoner, seed=1), FixedGpuCosts(forward_base_s=0.01),
                      seed=1, trace_steps=0)
    thinking = [s.think_accept_s for s in result.grammar_profile.specs.values()]
    assert all(t is not None and t > 0 for t in thinking)
