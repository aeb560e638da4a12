"""A hybrid run keeps the grammar costs it measured as a GrammarProfile, which ``model`` mode replays."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cdbench.backends import create_backend
from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.harness.costs.spec_profile import spec_key_hash
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
    rows = StepRows(rids, np.ones(2, bool), np.full(2, k), np.full(2, 20), np.zeros(2, np.int64))
    work = model.step(rows, np.random.default_rng(0))
    assert work.fill_s.tolist() == pytest.approx([(1 + k) * fill + k * accept] * 2)
