from __future__ import annotations

import json

import pytest

from cdbench.workloads.corpora import (
    EMBEDDED_SAMPLE,
    UnknownCorpusError,
    known_corpora,
    load_corpus,
    read_corpus,
    resolve_corpus,
)

GOOD = [
    {"id": "a", "kind": "regex", "spec": "[0-9]+", "source": "s", "license": "MIT"},
    {"id": "b", "kind": "choice", "spec": ["x", "y"], "source": "s", "license": "MIT"},
    {"id": "g", "kind": "ebnf", "dialect": "gbnf", "spec": 'root ::= "a"', "source": "s", "license": "MIT", "start": "root"},
    {"id": "lib", "kind": "ebnf", "dialect": "lark", "spec": "X: /x/", "source": "s", "license": "MIT", "start": None,
     "library": True},
    {"id": "j", "kind": "json_schema", "spec": {"type": "string"}, "source": "s", "license": "MIT", "tools": [1]},
]


def write(tmp_path, lines):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_bad_lines_are_reported_with_line_numbers_and_the_rest_loads(tmp_path):
    path = write(tmp_path, [GOOD[0], "{broken", {"id": "z", "kind": "sql", "spec": "", "source": "s", "license": "x"},
                            {"id": "m", "kind": "regex", "spec": "a"}, GOOD[1],
                            {"id": "n", "kind": "regex", "spec": 3, "source": "s", "license": "x"}])
    load = read_corpus(path)
    assert [i.id for i in load.items] == ["a", "b"]
    assert [(s.line, s.reason.split(":")[0].split(" (")[0]) for s in load.skipped] == [
        (2, "broken JSON"), (3, "unknown kind 'sql'"), (4, "missing field(s) source, license"),
        (6, "spec of a regex item must be str, got int")]
    assert all(s.path == str(path) for s in load.skipped)


def test_library_grammars_are_set_aside_by_default(tmp_path):
    path = write(tmp_path, GOOD)
    load = read_corpus(path)
    assert "lib" not in [i.id for i in load.items] and load.library_ids == ["lib"]
    assert "lib" in [i.id for i in read_corpus(path, include_library=True).items]


def test_filters_and_seeded_sampling(tmp_path):
    lines = [dict(GOOD[0], id=f"r{i}") for i in range(50)] + [dict(GOOD[1], id="c0")]
    path = write(tmp_path, lines)
    assert [i.id for i in read_corpus(path, kinds=["choice"]).items] == ["c0"]
    assert len(read_corpus(path, id_prefix="r1").items) == 11
    assert len(read_corpus(path, limit=3).items) == 3
    a = [i.id for i in read_corpus(path, sample=10, seed=3).items]
    assert a == [i.id for i in read_corpus(path, sample=10, seed=3).items]
    assert a != [i.id for i in read_corpus(path, sample=10, seed=4).items]
    assert len(set(a)) == 10


def test_items_convert_to_specs_and_back_to_lines(tmp_path):
    load = read_corpus(write(tmp_path, GOOD))
    by_id = {i.id: i for i in load.items}
    spec = by_id["g"].to_spec()
    assert spec.kind == "ebnf" and dict(spec.options) == {"dialect": "gbnf", "start": "root"}
    assert by_id["j"].extra == {"tools": [1]}
    assert by_id["j"].to_json() == GOOD[4]


def test_embedded_sample_has_every_kind_and_provenance():
    load = load_corpus("embedded")
    assert not load.skipped and len(load.items) >= 200
    kinds = {(i.kind, i.dialect) for i in load.items}
    assert {("json_schema", None), ("regex", None), ("choice", None), ("ebnf", "gbnf"), ("ebnf", "lark")} <= kinds
    assert all(i.source and i.license for i in load.items)
    assert any(i.id.startswith("bfcl/") for i in load.items)


def test_resolve_unknown_name_lists_known_names():
    with pytest.raises(UnknownCorpusError, match="known: embedded"):
        resolve_corpus("no-such-corpus")
    assert resolve_corpus("embedded") == EMBEDDED_SAMPLE


def test_shared_corpora_are_named_by_stem(corpora_dir, monkeypatch):
    monkeypatch.setenv("CDBENCH_CORPORA", str(corpora_dir))
    names = known_corpora()
    assert "jsonschemabench_github_easy" in names
    load = load_corpus("lark_lark_parser")
    assert not load.skipped and "lark/lark-parser/lark/grammars/common" in load.library_ids


def test_module_examples_run():
    """The docstring examples of the workloads modules are executed (they double as documentation)."""
    import doctest
    import importlib

    for name in ("arrivals", "lengths", "regex_instances", "json_instances", "grammar_instances", "corpora",
                 "config", "token_sources", "validate"):
        module = importlib.import_module(f"cdbench.workloads.{name}")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, name
