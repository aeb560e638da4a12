"""cdbench fit-predictor: the spec-cost predictors fitted on a store's entries of this host.

A store of a few real xgrammar measurements (cl100k vocabulary, seconds), the host benchmark replaced by a
constant as in test_fill_store.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.harness.costs import host as host_module
from cdbench.harness.costs.spec_predictor import SpecCostPredictor
from cdbench.profile.fill_store import fill_store

runner = CliRunner()

ITEMS = [
    *({"id": f"t/re{i}", "kind": "regex", "spec": f"[A-Z]{{{i + 1}}}-[0-9]{{{i + 2}}}"} for i in range(4)),
    *({"id": f"t/obj{i}", "kind": "json_schema",
       "spec": {"type": "object", "properties": {f"f{j}": {"type": "string"} for j in range(i + 1)},
                "required": [f"f{j}" for j in range(i + 1)]}} for i in range(4)),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setattr(host_module, "run_benchmark", lambda: 1.0)
    root = tmp_path_factory.mktemp("fit")
    corpus = root / "tiny.jsonl"
    corpus.write_text("".join(json.dumps({**item, "source": "tests", "license": "MIT"}) + "\n" for item in ITEMS))
    fill_store([str(corpus)], ["xgrammar"], "cl100k", root / "store")
    yield root / "store"
    patch.undo()


def test_the_predictor_is_fitted_on_the_stores_entries_and_written_with_its_table(store, tmp_path):
    result = runner.invoke(app, ["fit-predictor", "--store", str(store), "--vocab", "cl100k",
                                 "--out-dir", str(tmp_path / "out"), "--table", str(tmp_path / "errors.md")])
    assert result.exit_code == 0, result.output
    predictor = SpecCostPredictor.load(tmp_path / "out" / "xgrammar__cl100k.json")
    assert predictor.backend == "xgrammar" and predictor.vocab == "cl100k"
    assert predictor.source.startswith(f"cdbench fit-predictor over the spec-cost store {store} (entries of host")
    assert {kind: m.specs for kind, m in predictor.kinds.items()} == {"regex": 4, "json_schema": 4}
    table = (tmp_path / "errors.md").read_text()
    assert "| xgrammar | regex | 4 (0) |" in table and "| xgrammar | json_schema | 4 (0) |" in table
    assert f"wrote {tmp_path / 'out' / 'xgrammar__cl100k.json'}" in result.output


def test_nothing_to_fit_on_is_one_line(store, tmp_path):
    result = runner.invoke(app, ["fit-predictor", "--store", str(store), "--vocab", "qwen3.6",
                                 "--out-dir", str(tmp_path), "--table", str(tmp_path / "t.md")])
    assert result.exit_code == 2 and "no entry of vocabulary qwen3.6 measured on this host" in result.output
    result = runner.invoke(app, ["fit-predictor", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "give a spec-cost store (--store)" in result.output
    assert not list(tmp_path.glob("*.json"))
