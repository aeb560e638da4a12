from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdbench.workloads.corpora import (
    EMBEDDED_SAMPLE,
    UnknownCorpusError,
    known_corpora,
    load_corpora,
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


def test_invalid_utf8_line_is_a_skipped_line_and_the_rest_loads(tmp_path):
    path = tmp_path / "c.jsonl"
    good = json.dumps(GOOD[0]).encode()
    path.write_bytes(good + b"\n" + b'{"id": "\xff\xfe", "kind": "regex"}\n' + json.dumps(GOOD[1]).encode() + b"\n")
    load = read_corpus(path)
    assert [i.id for i in load.items] == ["a", "b"]
    assert [(s.path, s.line) for s in load.skipped] == [(str(path), 2)] and load.skipped_count == 1
    assert "invalid UTF-8" in load.skipped[0].reason


@pytest.mark.parametrize("field, value, shown", [
    ("id", None, "null"), ("id", "", "''"), ("id", 7, "7"), ("source", None, "null"), ("license", "", "''"),
])
def test_id_source_and_license_must_be_non_empty_strings(tmp_path, field, value, shown):
    load = read_corpus(write(tmp_path, [dict(GOOD[0], **{field: value}), GOOD[1]]))
    assert [i.id for i in load.items] == ["b"]
    assert [(s.line, s.reason) for s in load.skipped] == [(1, f"field {field} must be a non-empty string, got {shown}")]


def test_duplicate_ids_are_skipped_lines_within_a_file_and_across_files(tmp_path):
    path = write(tmp_path, [GOOD[0], dict(GOOD[1], id="a"), GOOD[1]])
    load = read_corpus(path)
    assert [i.id for i in load.items] == ["a", "b"] and load.items[0].spec == "[0-9]+"
    assert [(s.line, s.reason) for s in load.skipped] == [(2, "duplicate id 'a' (first on line 1)")]

    other = tmp_path / "d.jsonl"
    other.write_text(json.dumps(dict(GOOD[1], id="b", spec=["p", "q"])) + "\n" + json.dumps(dict(GOOD[0], id="c")) + "\n")
    merged = load_corpora([path, other])
    assert [i.id for i in merged.items] == ["a", "b", "c"]
    assert [(s.path, s.line) for s in merged.skipped] == [(str(path), 2), (str(other), 1)]
    assert merged.skipped[1].reason == f"duplicate id 'b' (first in {path}:3)"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.binary(max_size=40), st.sampled_from([json.dumps(g).encode() for g in GOOD])),
                max_size=12))
def test_any_bytes_load_without_raising_and_every_line_is_accounted_for(tmp_path, lines):
    path = tmp_path / "fuzz.jsonl"
    lines = [line.replace(b"\n", b" ") for line in lines]
    path.write_bytes(b"\n".join(lines) + b"\n")
    load = read_corpus(path, include_library=True)
    blank = sum(not line.decode("utf-8", "replace").strip() for line in lines)
    assert len(load.items) + load.skipped_count + blank == len(lines)
    assert len({i.id for i in load.items}) == len(load.items)
    assert all(1 <= s.line <= len(lines) for s in load.skipped)


def test_embedded_sample_and_its_provenance_readme_are_package_data():
    """The wheel must carry the sample's license texts with it (setuptools matches these globs)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["cdbench"]
    package = root / "cdbench"
    shipped = {p for pattern in patterns for p in package.glob(pattern)}
    readme = EMBEDDED_SAMPLE.parent / "README.md"
    assert EMBEDDED_SAMPLE in shipped and readme in shipped
    assert "MIT License" in readme.read_text() and "Apache" in readme.read_text()


def test_a_schema_off_every_metaschema_is_a_named_skipped_line_and_real_world_drafts_load(tmp_path):
    def schema(item_id, spec):
        return {"id": item_id, "kind": "json_schema", "spec": spec, "source": "s", "license": "MIT"}

    draft4 = "http://json-schema.org/draft-04/schema#"
    path = write(tmp_path, [
        schema("nonsense", {"type": "nonsense"}),
        schema("negative", {"properties": {"name": {"type": "string", "minLength": -1}}}),
        # What real corpora hold and engines accept: draft-04 booleans with no $schema, duplicate enum
        # values in a draft-04 schema, a pattern that is no ECMA-262 regex, an unknown format.
        schema("old_exclusive", {"type": "number", "minimum": 0, "exclusiveMinimum": True}),
        schema("duplicate_enum", {"$schema": draft4, "enum": ["a", "a", "b"]}),
        schema("python_pattern", {"$schema": draft4, "type": "string", "pattern": "^PUBMED:\\{d}"}),
        schema("unknown_format", {"type": "string", "format": "no-such-format"}),
    ])
    load = read_corpus(path)
    assert [i.id for i in load.items] == ["old_exclusive", "duplicate_enum", "python_pattern", "unknown_format"]
    assert [str(s) for s in load.skipped] == [
        f"{path}:1: invalid JSON Schema: keyword type at /type: 'nonsense' is not valid under any of the given schemas",
        (f"{path}:2: invalid JSON Schema: keyword minLength at /properties/name/minLength: -1 is less than the "
         "minimum of 0"),
    ]


def test_no_schema_of_the_embedded_sample_is_refused():
    load = read_corpus(EMBEDDED_SAMPLE)
    assert not [s for s in load.skipped if "invalid JSON Schema" in s.reason]


def test_a_gzipped_corpus_reads_as_the_plain_one_and_is_named_without_its_suffixes(tmp_path, monkeypatch):
    plain = tmp_path / "mine.jsonl"
    plain.write_bytes(gzip.decompress(EMBEDDED_SAMPLE.read_bytes()) + b"{broken\n")
    zipped = tmp_path / "zipped.jsonl.gz"
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = read_corpus(plain), read_corpus(zipped)
    assert [i.to_json() for i in a.items] == [i.to_json() for i in b.items] and len(a.items) > 200
    assert [(s.line, s.reason) for s in a.skipped] == [(s.line, s.reason) for s in b.skipped] and len(a.skipped) == 1
    monkeypatch.setenv("CDBENCH_CORPORA", str(tmp_path))
    assert {"mine", "zipped"} <= set(known_corpora()) and resolve_corpus("zipped") == zipped
