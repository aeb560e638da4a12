"""Profile outputs: parquet tables, GrammarProfile files, the report's numbers and plots."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.profile.outputs import items_frame, tokens_frame, write_outputs
from cdbench.profile.runner import ProfileConfig
from cdbench.backends.measure_worker import ItemResult, TokenTimes
from cdbench.reports.profile_report import summarize, token_costs


def _tokens(fills: list[float], rollback_at: int = 1, forced_at: int = 0) -> TokenTimes:
    n = len(fills)
    return TokenTimes(
        instance=[0] * n,
        position=list(range(n)),
        fill_us=fills,
        accept_us=[2.0] * n,
        rollback_us=[5.0 if i == rollback_at else None for i in range(n)],
        forced_tokens=[3 if i == forced_at else 0 for i in range(n)],
    )


@pytest.fixture
def results() -> list[ItemResult]:
    return [
        ItemResult("easy", "a", "json_schema", "fast", "ok", compile_ms=1.0, n_valid=1, n_invalid=2,
                   tokens=_tokens([10.0, 20.0, 30.0, 40.0])),
        ItemResult("easy", "b", "json_schema", "fast", "ok", compile_ms=3.0, n_valid=1, false_rejects=1,
                   first_reject_position=1, first_reject_text="{[[\"x]] (refused by accept)",
                   n_invalid=2, false_accepts=1, false_accept_labels=["drop_key"],
                   warnings=["not: ignored"], tokens=_tokens([100.0, 200.0])),
        ItemResult("regex", "r", "regex", "fast", "timeout", message="compile exceeded 3 s"),
        ItemResult("easy", "a", "json_schema", "slow", "ok", compile_ms=50.0, n_valid=1,
                   tokens=_tokens([1000.0, 1000.0, 1000.0, 1000.0])),
        ItemResult("easy", "b", "json_schema", "slow", "unsupported", message="no such keyword"),
        ItemResult("regex", "r", "regex", "slow", "crash", message="worker killed by SIGSEGV"),
        ItemResult("regex", "w", "regex", "slow", "timeout", message="instance walk exceeded 3 s", compile_ms=4.0),
    ]


def test_summary_matches_hand_computed_values(results):
    items, tokens = items_frame(results), tokens_frame(results)
    table = summarize(items, tokens)
    fast, slow = table.loc["fast"], table.loc["slow"]
    assert fast["items"] == 3
    assert fast["TBM avg µs"] == pytest.approx(400 / 6)
    assert fast["TBM p50 µs"] == pytest.approx(35.0)
    assert fast["TBM max µs"] == 200.0
    assert fast["TTFM p50 ms"] == pytest.approx(2.0)
    assert fast["declared coverage"] == pytest.approx(2 / 3)
    assert fast["empirical coverage"] == pytest.approx(1 / 3)
    assert (fast["false rejects"], fast["false accepts"], fast["warned items"]) == (1, 1, 1)
    # A compile timeout has no compile time; a walk timeout compiled first.
    assert (fast["compile timeouts"], fast["walk timeouts"]) == (1, 0)
    assert (slow["compile timeouts"], slow["walk timeouts"]) == (0, 1)
    assert (slow["declared coverage"], slow["unsupported"], slow["crashes"]) == (pytest.approx(1 / 4), 1, 1)
    assert slow["TTFM p50 ms"] == 50.0  # the walk timeout's compile is not a TTFM sample
    by_corpus = summarize(items, tokens, ("corpus", "kind", "backend"))
    assert by_corpus.loc[("regex", "regex", "fast"), "items"] == 1
    assert math.isnan(by_corpus.loc[("regex", "regex", "fast"), "TBM p50 µs"])
    costs = token_costs(tokens)
    assert costs.loc["fast", "rollback(1) avg µs"] == 5.0
    assert costs.loc["fast", "steps with forced tokens"] == pytest.approx(2 / 6)


def test_write_outputs_writes_tables_profiles_report_and_plots(results, tmp_path):
    config = ProfileConfig(backends=["fast", "slow"], corpora=["easy", "regex"], vocab="cl100k")
    files = write_outputs(results, config, tmp_path, command="cdbench profile --example")
    names = {f.name for f in files}
    assert {"items.parquet", "tokens.parquet", "profile_fast.parquet", "profile_slow.parquet", "report.md",
            "tbm_cdf.png", "ttfm_cdf.png", "tbm_by_position.png"} <= names
    items = pd.read_parquet(tmp_path / "items.parquet")
    tokens = pd.read_parquet(tmp_path / "tokens.parquet")
    assert len(items) == 7 and len(tokens) == 10
    assert items.set_index(["item_id", "backend"]).loc[("b", "fast"), "first_reject_position"] == 1

    profile = GrammarProfile.load(tmp_path / "profile_fast.parquet")
    assert profile.vocab == "cl100k" and profile.backend == "fast"
    assert profile.overall.fill_s.count == 6
    assert profile.overall.fill_s.max == pytest.approx(200e-6)
    assert profile.kinds["regex"].statuses == {"timeout": 1}
    assert GrammarProfile.load(tmp_path / "profile_slow.parquet").kinds["regex"].statuses == {"crash": 1, "timeout": 1}
    assert profile.compile_by_spec == {"a": pytest.approx(1e-3), "b": pytest.approx(3e-3)}
    assert profile.overall.rollback_s.count == 2
    assert profile.overall.jump_forward_fraction == pytest.approx(2 / 6)

    report = (tmp_path / "report.md").read_text()
    assert "cdbench profile --example" in report
    assert "| fast | 3 |" in report and "| slow | 4 |" in report
    assert "| compile timeouts | walk timeouts |" in report
    assert "walk timeout s=600.0" in report
    assert "compare them within a backend, not across backends." in report
    assert "worker killed by SIGSEGV" in report
    assert "drop_key 1" in report
    for png in ("tbm_cdf.png", "ttfm_cdf.png", "tbm_by_position.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_tokens_frame_keeps_every_timed_token(results):
    tokens = tokens_frame(results)
    assert tokens.groupby("backend", observed=True).size().to_dict() == {"fast": 6, "slow": 4}
    assert np.isnan(tokens.rollback_us).sum() == 10 - 3


def test_report_states_each_backends_forced_token_rule(results, tmp_path):
    from cdbench.reports.profile_report import (
        FORCED_TOKEN_RULES,
        ProfileReportInfo,
        write_report,
    )

    items, tokens = items_frame(results), tokens_frame(results)
    renamed = {"fast": "outlines", "slow": "xgrammar"}
    items["backend"] = items.backend.map(renamed)
    tokens["backend"] = tokens.backend.map(renamed)
    write_report(items, tokens, tmp_path, ProfileReportInfo())
    report = (tmp_path / "report.md").read_text()
    assert "not across backends:" in report
    for backend in ("outlines", "xgrammar"):
        assert f"  - {backend}: {FORCED_TOKEN_RULES[backend]}." in report
    assert "llguidance:" not in report  # only the backends in the report
