"""``cdbench profile`` with the real engines on a few embedded items (slow: engine builds, outlines indexes)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from cdbench.profile.runner import ProfileConfig, run_profile
from cdbench.profile.sources import load_items

pytestmark = pytest.mark.slow


def test_real_engines_on_regex_and_choice_items(tmp_path):
    items, _ = load_items("embedded", None)
    chosen = [i for i in items if i.spec.kind in ("regex", "choice")][:4]
    corpus = tmp_path / "four.jsonl"
    corpus.write_text("".join(
        json.dumps({"id": i.item_id, "kind": i.spec.kind, "spec": i.spec.spec, "source": "embedded",
                    "license": "MIT"}) + "\n"
        for i in chosen
    ))
    config = ProfileConfig(backends=["xgrammar", "llguidance", "outlines"], corpora=[str(corpus)],
                           vocab="cl100k", compile_timeout_s=60)
    run = run_profile(config, tmp_path / "out", progress=False)

    assert run.results == 12
    results = pd.read_parquet(tmp_path / "out" / "items.parquet")
    tokens = pd.read_parquet(tmp_path / "out" / "tokens.parquet")
    assert (results[results.backend == "xgrammar"].status == "ok").all()
    assert set(tokens.backend.unique()) == {"xgrammar", "llguidance", "outlines"}
    assert (tokens.fill_us > 0).all()
    # Mutations are invalid by construction, and these simple specs are enforced exactly.
    ok = results[results.status == "ok"]
    assert ok.n_invalid.sum() > 0
    assert ok.false_accepts.sum() == 0
