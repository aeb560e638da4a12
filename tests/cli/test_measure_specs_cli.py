"""``cdbench measure-specs``: fills a store from a corpus file, skips what it holds on a rerun, and turns
unknown names into one line (real xgrammar compiles of two specs; the host benchmark replaced by a constant)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.harness.costs import host as host_module
from cdbench.harness.costs.spec_store import SpecCostStore

runner = CliRunner()
ITEMS = [
    {"id": "t/colors", "kind": "choice", "spec": ["red", "green", "blue"]},
    {"id": "t/digits", "kind": "regex", "spec": "[0-9]{3}"},
]


@pytest.fixture(autouse=True)
def quick_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_module, "run_benchmark", lambda: 1.0)


def test_fills_the_store_and_a_rerun_skips_it(tmp_path: Path) -> None:
    corpus, store = tmp_path / "tiny.jsonl", tmp_path / "store"
    corpus.write_text("".join(json.dumps({**item, "source": "tests", "license": "MIT"}) + "\n" for item in ITEMS))
    args = ["measure-specs", "--corpus", str(corpus), "--backend", "xgrammar", "--vocab", "cl100k",
            "--instances", "1", "--store", str(store), "--no-progress"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "xgrammar" in first.output and "2 specs, 0 skipped" in first.output and "2 measured" in first.output
    assert "ok 2" in first.output and len(SpecCostStore(store)) == 2
    second = runner.invoke(app, args)
    assert second.exit_code == 0, second.output
    assert "2 specs, 2 skipped (already stored for this host), 0 measured" in second.output


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--corpus", "no_such_corpus", "unknown corpus 'no_such_corpus'"),
    ("--backend", "nope", "unknown backend 'nope'"),
    ("--vocab", "nope", "nope"),
])
def test_unknown_names_are_one_line(tmp_path: Path, option: str, value: str, message: str) -> None:
    args = {"--corpus": "embedded", "--backend": "xgrammar", "--vocab": "cl100k", option: value}
    result = runner.invoke(app, ["measure-specs", *[x for kv in args.items() for x in kv],
                                 "--store", str(tmp_path / "store"), "--no-progress"])
    assert result.exit_code == 2 and result.output.startswith("error:") and message in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists()


def test_help_has_an_example() -> None:
    result = runner.invoke(app, ["measure-specs", "--help"])
    assert result.exit_code == 0 and "Example: cdbench measure-specs --corpus" in result.output
