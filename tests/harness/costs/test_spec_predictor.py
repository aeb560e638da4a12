"""Spec features and the spec-cost predictor: features from the spec alone, the fit, the held-out split, files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdbench.backends.base import CONSTRAINT_KINDS, ConstraintSpec
from cdbench.harness.costs.spec_features import FEATURE_NAMES, SpecFeatureError, spec_features
from cdbench.harness.costs.spec_predictor import (
    PredictorError,
    SpecCostPredictor,
    SpecCostRow,
    UnknownPredictorError,
    shipped_predictors,
    split_by_corpus,
)

GBNF = 'root ::= item ("," item)*  # a list\nitem ::= [a-z]{1,8} | "x" | "y"\n'
LARK = 'start: pair+\npair: KEY ":" VALUE\nKEY: /[a-z]+/\nVALUE: "yes" | "no"\n%import common.WS\n%ignore WS\n'
WELL_FORMED = [
    ConstraintSpec("json_schema", {"type": "object", "properties": {"a": {"type": "string", "maxLength": 40}},
                                   "required": ["a"], "additionalProperties": False}),
    ConstraintSpec("json_schema", True),
    ConstraintSpec("json_schema", '{"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 4}'),
    ConstraintSpec("regex", r"^\d{3}-[A-Z]{2,4}(?:x|y|z)*$"),
    ConstraintSpec("ebnf", GBNF, {"dialect": "gbnf", "start": "root"}),
    ConstraintSpec("ebnf", LARK, {"dialect": "lark", "start": "start"}),
    ConstraintSpec("choice", ["red", "green", "blue"]),
    ConstraintSpec("structural_tag", {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}),
    ConstraintSpec("structural_tag", {"tags": [{"begin": "<a>", "schema": {"type": "integer"}, "end": "</a>"},
                                               {"begin": "<b>", "schema": {"type": "string"}, "end": "</b>"}]}),
]
MALFORMED = [
    ConstraintSpec("json_schema", '{"type": "object", '),
    ConstraintSpec("json_schema", "[1, 2]"),
    ConstraintSpec("regex", "((a|b"),
    ConstraintSpec("regex", "[abc"),
    ConstraintSpec("ebnf", 'root ::= "unterminated\n', {"dialect": "gbnf"}),
    ConstraintSpec("ebnf", "start: /never closed\n", {"dialect": "lark"}),
    ConstraintSpec("structural_tag", {"tags": "not a list"}),
    ConstraintSpec("structural_tag", {"tags": [{"begin": "<a>"}, 7]}),
]


def _check(features: dict[str, float], kind: str) -> None:
    assert tuple(features) == FEATURE_NAMES[kind]
    assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in features.values())


def test_feature_names_cover_every_kind() -> None:
    assert set(FEATURE_NAMES) == set(CONSTRAINT_KINDS)


@pytest.mark.parametrize("spec", WELL_FORMED + MALFORMED, ids=lambda s: f"{s.kind}:{str(s.spec)[:20]}")
def test_features_are_deterministic_and_finite(spec: ConstraintSpec) -> None:
    features = spec_features(spec)
    _check(features, spec.kind)
    assert spec_features(ConstraintSpec(spec.kind, spec.spec, spec.options)) == features


@pytest.mark.parametrize("spec", WELL_FORMED, ids=lambda s: f"{s.kind}:{str(s.spec)[:20]}")
def test_well_formed_specs_are_not_flagged(spec: ConstraintSpec) -> None:
    assert spec_features(spec).get("malformed", 0.0) == 0.0


@pytest.mark.parametrize("spec", MALFORMED, ids=lambda s: f"{s.kind}:{str(s.spec)[:20]}")
def test_malformed_content_gives_features_flagged(spec: ConstraintSpec) -> None:
    assert spec_features(spec)["malformed"] == 1.0


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (ConstraintSpec("regex", 12345), "regex spec must be a string, got int: .*12345"),
        (ConstraintSpec("choice", ["a", 3]), "choice spec must be a list of strings, got list: .*\\[\"a\",3\\]"),
        (ConstraintSpec("json_schema", 3.5), "json_schema spec must be .*, got float: .*3.5"),
        (ConstraintSpec("ebnf", None, {"dialect": "gbnf"}), "ebnf spec must be a string, got NoneType"),
        (ConstraintSpec("structural_tag", ["x"]), "structural_tag spec must be an object, got list"),
    ],
)
def test_a_spec_of_the_wrong_type_is_an_error_naming_it(spec: ConstraintSpec, expected: str) -> None:
    with pytest.raises(SpecFeatureError, match=expected):
        spec_features(spec)


def test_features_count_what_engines_expand() -> None:
    regex = spec_features(ConstraintSpec("regex", "(a{10}){10}|b"))
    assert regex["log_repeat_product"] == pytest.approx(math.log1p(100))
    assert regex["log_repeat_bound"] == pytest.approx(math.log1p(20))
    assert regex["log_alternations"] == pytest.approx(math.log1p(1))
    schema = spec_features(ConstraintSpec("json_schema", {
        "type": "object",
        "properties": {"a": {"enum": [1, 2, 3]}, "b": {"anyOf": [{"type": "string", "pattern": "^x+$"},
                                                                  {"$ref": "#/definitions/c"}]},
                       "enum": {"type": "string"}},  # a property named like a keyword is a property
        "definitions": {"c": {"type": "integer", "minimum": 0}},
    }))
    assert schema["log_properties"] == pytest.approx(math.log1p(3))
    assert schema["log_enums"] == pytest.approx(math.log1p(1))
    assert schema["log_enum_values"] == pytest.approx(math.log1p(3))
    assert schema["log_branches"] == pytest.approx(math.log1p(2))
    assert schema["log_patterns"] == pytest.approx(math.log1p(1))
    assert schema["log_refs"] == pytest.approx(math.log1p(1))
    assert schema["log_open_objects"] == pytest.approx(math.log1p(1))
    assert schema["log_nodes"] == pytest.approx(math.log1p(7))
    grammar = spec_features(ConstraintSpec("ebnf", GBNF, {"dialect": "gbnf"}))
    assert grammar["log_rules"] == pytest.approx(math.log1p(2))
    assert grammar["log_literals"] == pytest.approx(math.log1p(3))  # the comment's text is not counted
    assert grammar["log_terminal_regexes"] == pytest.approx(math.log1p(1))
    lark = spec_features(ConstraintSpec("ebnf", LARK, {"dialect": "lark"}))
    assert (lark["log_rules"], lark["log_terminal_defs"]) == (pytest.approx(math.log1p(2)),
                                                              pytest.approx(math.log1p(2)))


_JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_KEYS = st.sampled_from(["type", "properties", "items", "prefixItems", "anyOf", "oneOf", "allOf", "enum", "const",
                         "pattern", "patternProperties", "minLength", "maxLength", "minItems", "maxItems",
                         "required", "additionalProperties", "$ref", "definitions", "$defs", "format", "not",
                         "if", "then", "else", "dependencies", "minimum"]) | st.text(max_size=6)
_JSON_VALUES = st.recursive(_JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(_KEYS, inner, max_size=5), max_leaves=40)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(_KEYS, _JSON_VALUES, max_size=6))
def test_features_never_raise_on_json_like_schemas(schema: dict) -> None:
    _check(spec_features(ConstraintSpec("json_schema", schema)), "json_schema")
    _check(spec_features(ConstraintSpec("structural_tag", {"begin": "<t>", "schema": schema, "end": "</t>"})),
           "structural_tag")


def _choices(rng: np.random.Generator, n: int) -> list[str]:
    return ["x" * int(rng.integers(1, 30)) + str(i) for i in range(n)]


def _synthetic_rows(rng: np.random.Generator, count: int, corpus: str, factor: float = 1.0) -> list[SpecCostRow]:
    """Choice specs whose costs follow a known log-linear relation in their features (times ``factor``)."""
    rows = []
    for _ in range(count):
        spec = ConstraintSpec("choice", _choices(rng, int(rng.integers(2, 60))))
        f = spec_features(spec)
        compile_s = factor * math.exp(-9.0 + 0.8 * f["log_choices"] + 0.3 * f["log_total_bytes"])
        fill_s = factor * math.exp(-11.0 + 0.5 * f["log_max_bytes"])
        rows.append(SpecCostRow(spec, corpus, "ok", compile_s, fill_s))
    return rows


def test_fit_recovers_a_known_log_linear_relation() -> None:
    rng = np.random.default_rng(0)
    rows = _synthetic_rows(rng, 60, "a") + _synthetic_rows(rng, 30, "b")
    predictor = SpecCostPredictor.fit(rows, "test", "v", held_out_corpora=["b"])
    model = predictor.kinds["choice"]
    assert model.compile.method == "ridge" and model.fill.method == "ridge"
    assert model.held_out_compile.n == model.held_out_fill.n == 30
    assert model.held_out_compile.median < 0.01 and model.held_out_fill.median < 0.01
    for row in _synthetic_rows(rng, 10, "new"):
        got = predictor.predict(row.spec)
        assert got.compile_s == pytest.approx(row.compile_s, rel=0.02)
        assert got.fill_mean_s == pytest.approx(row.fill_mean_s, rel=0.02)
        assert got.median_error_compile == model.held_out_compile.median


def test_held_out_corpora_are_never_fitted_on() -> None:
    rng = np.random.default_rng(1)
    train, held = _synthetic_rows(rng, 60, "a"), _synthetic_rows(rng, 30, "b", factor=10.0)
    assert split_by_corpus(train + held, ["b"]) == (train, held)
    model = SpecCostPredictor.fit(train + held, "test", "v", held_out_corpora=["b"]).kinds["choice"]
    # Fitted on "a" alone, every prediction of "b" is 10 times too small: |0.1 - 1| = 0.9. Had "b" leaked
    # into the fit, its predictions would have moved towards it.
    assert model.held_out_compile.median == pytest.approx(0.9, abs=0.01)
    assert model.held_out_fill.p90 == pytest.approx(0.9, abs=0.01)
    # The shipped model is refitted on every corpus.
    assert model.compile.n == 90


def test_held_out_corpus_must_exist_and_leave_something() -> None:
    rows = _synthetic_rows(np.random.default_rng(2), 20, "a")
    with pytest.raises(ValueError, match="held-out corpora without rows: nope"):
        SpecCostPredictor.fit(rows, "test", "v", ["nope"])
    with pytest.raises(ValueError, match="every row is in a held-out corpus"):
        SpecCostPredictor.fit(rows, "test", "v", ["a"])


def test_predict_clips_features_to_the_training_range() -> None:
    predictor = SpecCostPredictor.fit(_synthetic_rows(np.random.default_rng(3), 40, "a"), "test", "v", [])
    fit = predictor.kinds["choice"].compile
    # Far past every training spec: the prediction is the model at the training maxima, however far past.
    big, bigger = (ConstraintSpec("choice", ["y" * 500 + str(i) for i in range(n)]) for n in (2_000, 50_000))
    at_high = math.exp(fit.predict_log(np.array([fit.high]))[0])
    assert predictor.predict(big).compile_s == pytest.approx(at_high)
    assert predictor.predict(bigger).compile_s == pytest.approx(at_high)


def test_too_few_specs_fall_back_to_the_kind_median_and_say_so() -> None:
    rows = [SpecCostRow(ConstraintSpec("regex", "a" * n), "a", "ok", 1e-3 * n, 1e-5) for n in (1, 2, 3, 50)]
    rows += [SpecCostRow(ConstraintSpec("regex", "b"), "b", "ok", 4e-3, 1e-5),
             SpecCostRow(ConstraintSpec("regex", "(?=x)"), "a", "unsupported")]
    model = SpecCostPredictor.fit(rows, "test", "v", ["b"]).kinds["regex"]
    assert model.compile.method == "median" and model.compile.features == []
    assert model.held_out_compile.method == "median"
    assert model.held_out_compile.median == pytest.approx(abs(math.sqrt(2e-3 * 3e-3) / 4e-3 - 1))  # log-space median
    assert model.failure_rate == pytest.approx(1 / 6) and model.statuses == {"ok": 5, "unsupported": 1}
    predictor = SpecCostPredictor.fit(rows, "test", "v", ["b"])
    assert predictor.predict(ConstraintSpec("regex", "a" * 1000)).compile_s == pytest.approx(3e-3)


def test_predict_names_a_kind_without_measurements() -> None:
    predictor = SpecCostPredictor.fit(_synthetic_rows(np.random.default_rng(4), 5, "a"), "test", "v", [])
    with pytest.raises(PredictorError, match="no measured regex spec .* it predicts: choice"):
        predictor.predict(ConstraintSpec("regex", "a+"))
    assert math.isnan(predictor.predict(ConstraintSpec("choice", ["a", "b"])).median_error_compile)


def test_rows_are_checked() -> None:
    spec = ConstraintSpec("regex", "a")
    with pytest.raises(ValueError, match="only when its status is ok"):
        SpecCostRow(spec, "a", "ok")
    with pytest.raises(ValueError, match="only when its status is ok"):
        SpecCostRow(spec, "a", "timeout", 1.0)
    with pytest.raises(ValueError, match="unknown compile status 'late'"):
        SpecCostRow(spec, "a", "late")
    with pytest.raises(ValueError, match="fill_mean_s must be a positive finite time"):
        SpecCostRow(spec, "a", "ok", 1.0, float("nan"))


def test_save_load_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    predictor = SpecCostPredictor.fit(_synthetic_rows(rng, 40, "a") + _synthetic_rows(rng, 10, "b"),
                                      "test", "v", ["b"], source="unit test")
    path = tmp_path / "p.json"
    predictor.save(path)
    loaded = SpecCostPredictor.load(path)
    assert loaded == predictor
    spec = ConstraintSpec("choice", ["one", "two", "three"])
    assert loaded.predict(spec) == predictor.predict(spec)


def test_load_names_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"backend": "x"}))
    with pytest.raises(PredictorError, match="bad.json: invalid spec-cost predictor"):
        SpecCostPredictor.load(path)
    with pytest.raises(PredictorError, match="missing.json: cannot read"):
        SpecCostPredictor.load(tmp_path / "missing.json")


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_builtin_loads_the_shipped_predictors(backend: str) -> None:
    predictor = SpecCostPredictor.builtin(backend, "qwen3.6")
    assert (predictor.backend, predictor.vocab) == (backend, "qwen3.6")
    assert {"json_schema", "regex", "ebnf", "choice"} <= set(predictor.kinds)
    assert predictor.held_out_corpora
    for spec in WELL_FORMED:
        if spec.kind == "structural_tag":
            continue
        got = predictor.predict(spec)
        assert got.compile_s > 0 and got.fill_mean_s > 0 and got.kind == spec.kind
        assert math.isfinite(got.median_error_compile) and math.isfinite(got.median_error_fill)


def test_unknown_backend_error_names_it_and_lists_the_shipped() -> None:
    assert set(shipped_predictors()) >= {"xgrammar__qwen3.6", "llguidance__qwen3.6"}
    with pytest.raises(UnknownPredictorError, match="backend 'outlines' with vocabulary 'qwen3.6'.*xgrammar__qwen3.6"):
        SpecCostPredictor.builtin("outlines", "qwen3.6")
    with pytest.raises(UnknownPredictorError, match="vocabulary 'cl100k'"):
        SpecCostPredictor.builtin("xgrammar", "cl100k")
