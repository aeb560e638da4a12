"""GrammarProfile: building from measurements, files, and the seeded vectorized sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdbench.harness.costs.grammar_profile import (
    EXACT_SAMPLES,
    KIND_CODES,
    CompileMeasurement,
    Distribution,
    GrammarProfile,
    ProfileError,
    WalkMeasurement,
)


def _profile(seed: int = 0, n_tokens: int = 20_000) -> GrammarProfile:
    rng = np.random.default_rng(seed)
    compiles = [CompileMeasurement(f"js{i}", "json_schema", "ok", float(rng.lognormal(-4, 1))) for i in range(40)]
    compiles += [CompileMeasurement("js-bad", "json_schema", "unsupported"),
                 CompileMeasurement("js-err", "json_schema", "error"),
                 CompileMeasurement("js-slow", "json_schema", "timeout")]
    compiles += [CompileMeasurement(f"re{i}", "regex", "ok", 1e-4 * (i + 1)) for i in range(10)]
    compiles += [CompileMeasurement("re-bad", "regex", "error")]
    walks = [
        WalkMeasurement("js0", "json_schema", fill_s=rng.lognormal(-10, 1.5, n_tokens),
                        accept_s=rng.lognormal(-12, 0.5, n_tokens), rollback_s=rng.lognormal(-12, 0.5, 100),
                        forced_tokens=np.where(rng.random(n_tokens) < 0.25, rng.integers(1, 5, n_tokens), 0)),
        WalkMeasurement("re0", "regex", fill_s=np.full(50, 5e-6), accept_s=np.full(50, 1e-6),
                        rollback_s=np.full(3, 2e-6)),
    ]
    return GrammarProfile.from_measurements("test", "qwen3.6", compiles, walks, source="unit test")


@pytest.fixture(scope="module")
def profile() -> GrammarProfile:
    return _profile()


def test_from_measurements_counts_outcomes_by_kind(profile: GrammarProfile) -> None:
    js = profile.kinds["json_schema"]
    assert js.statuses == {"ok": 40, "unsupported": 1, "error": 1, "timeout": 1}
    assert js.items == 43 and js.rate("unsupported") == pytest.approx(1 / 43)
    assert js.failure_rate == pytest.approx(3 / 43)
    assert profile.kinds["regex"].failure_rate == pytest.approx(1 / 11)
    assert profile.overall.items == 54
    assert profile.failed_specs == {"js-bad": "unsupported", "js-err": "error", "js-slow": "timeout", "re-bad": "error"}
    assert profile.compile_by_spec["re3"] == pytest.approx(4e-4)
    assert set(profile.kinds) == {"json_schema", "regex"}
    assert profile.kinds["regex"].fill_s.count == 50 and profile.overall.fill_s.count == 20_050


def test_jump_forward_statistics(profile: GrammarProfile) -> None:
    js = profile.kinds["json_schema"]
    assert js.jump_forward_fraction == pytest.approx(0.25, abs=0.02)
    assert js.jump_forward_mean_tokens == pytest.approx(2.5, abs=0.1)
    assert profile.kinds["regex"].jump_forward_fraction == 0.0


def test_repeated_compiles_keep_the_median() -> None:
    compiles = [CompileMeasurement("a", "regex", "ok", t) for t in (1.0, 5.0, 2.0)]
    p = GrammarProfile.from_measurements("b", "v", compiles, [])
    assert p.compile_by_spec == {"a": 2.0}


@pytest.mark.parametrize(
    ("compile_", "walk", "match"),
    [
        (CompileMeasurement("x1", "sql", "ok", 1.0), None, "x1.*unknown constraint kind 'sql'"),
        (CompileMeasurement("x2", "regex", "ok", None), None, "x2.*needs a time"),
        (CompileMeasurement("x3", "regex", "ok", float("nan")), None, "x3"),
        (CompileMeasurement("x4", "regex", "exploded", 1.0), None, "x4.*unknown compile status"),
        (None, WalkMeasurement("w1", "regex", fill_s=np.array([1e-6, -1.0])), "w1.*fill_s"),
        (None, WalkMeasurement("w2", "regex", fill_s=np.ones(3), forced_tokens=np.ones(2)), "w2.*forced_tokens"),
    ],
)
def test_bad_measurements_name_the_item(compile_, walk, match) -> None:
    with pytest.raises(ProfileError, match=match):
        GrammarProfile.from_measurements("b", "v", [compile_] if compile_ else [], [walk] if walk else [])


def test_save_load_round_trip(profile: GrammarProfile, tmp_path) -> None:
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = GrammarProfile.load(path)
    assert loaded == profile
    assert json.loads(path.read_text())["format_version"] == 2
    a = profile.sampler(3).fill_s(1000, "json_schema")
    b = loaded.sampler(3).fill_s(1000, "json_schema")
    np.testing.assert_array_equal(a, b)


def test_bad_files_name_the_file_and_field(profile: GrammarProfile, tmp_path) -> None:
    data = json.loads(profile.model_dump_json())
    data["kinds"]["regex"]["fill_s"]["values"] = list(reversed(data["kinds"]["regex"]["fill_s"]["values"]))
    data["kinds"]["regex"]["fill_s"]["values"][0] = 1.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"bad\.json.*kinds\.regex\.fill_s"):
        GrammarProfile.load(bad)
    data = json.loads(profile.model_dump_json())
    data["format_version"] = 7
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="format_version"):
        GrammarProfile.load(bad)
    bad.write_text("{truncated")
    with pytest.raises(ProfileError, match=r"bad\.json.*not JSON"):
        GrammarProfile.load(bad)
    with pytest.raises(ProfileError, match="cannot read"):
        GrammarProfile.load(tmp_path / "missing.json")


def test_sampler_is_deterministic_by_seed(profile: GrammarProfile) -> None:
    def draws(seed: int) -> list[np.ndarray]:
        s = profile.sampler(seed)
        return [s.fill_s(100, "json_schema"), s.accept_s(np.array([0, 1, 0])), s.rollback_s(5),
                s.jump_forward(50, "json_schema"), s.compile_s(["js0", "new", None], ["json_schema"] * 3)]

    for a, b in zip(draws(1), draws(1)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(draws(1)[0], draws(2)[0])


def test_tail_is_preserved(profile: GrammarProfile) -> None:
    fill = profile.kinds["json_schema"].fill_s
    x = profile.sampler(0).fill_s(400_000, "json_schema")
    assert np.quantile(x, 0.5) == pytest.approx(fill.p50, rel=0.05)
    assert np.quantile(x, 0.99) == pytest.approx(fill.p99, rel=0.05)
    assert np.quantile(x, 0.999) == pytest.approx(fill.p999, rel=0.15)
    assert x.max() <= fill.max * (1 + 1e-4)
    assert x.mean() == pytest.approx(fill.mean, rel=0.05)


def test_large_sample_sketch_keeps_extremes() -> None:
    rng = np.random.default_rng(5)
    samples = rng.pareto(1.5, 1_000_000) * 1e-5  # heavy tail
    d = Distribution.from_samples(samples)
    assert len(d.values) < 700  # compact
    assert d.max == samples.max() and d.values[-1] == pytest.approx(samples.max(), rel=1e-4)
    assert d.quantile(0.999) == pytest.approx(np.quantile(samples, 0.999), rel=1e-3)
    assert d.quantile(0.9999) == pytest.approx(np.quantile(samples, 0.9999), rel=1e-3)
    assert d.quantile(0.99999) == pytest.approx(np.quantile(samples, 0.99999), rel=0.05)
    assert len(set(d.probs)) == len(d.probs)  # no tail point collapsed onto another
    assert sum(d.hist_counts) == np.count_nonzero(samples)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), min_size=1, max_size=EXACT_SAMPLES))
def test_small_samples_are_stored_exactly(values: list[float]) -> None:
    d = Distribution.from_samples(values)
    assert d.count == len(values)
    assert d.values[0] == pytest.approx(min(values), rel=1e-4) and d.values[-1] == pytest.approx(max(values), rel=1e-4)
    assert d.max == max(values)
    Distribution.model_validate(d.model_dump())  # what it writes, it reads back


def test_vectorized_shapes_and_kind_forms(profile: GrammarProfile) -> None:
    s = profile.sampler(0)
    assert s.fill_s(0, "regex").shape == (0,)
    assert s.fill_s(7, "regex").shape == (7,)
    codes = np.array([KIND_CODES["regex"], KIND_CODES["json_schema"], -1, KIND_CODES["choice"]])
    assert s.fill_s(codes).shape == (4,)
    assert s.accept_s(["regex", "json_schema"]).shape == (2,)
    assert s.jump_forward(codes).dtype.kind == "i"
    np.testing.assert_allclose(s.fill_s(np.full(20, KIND_CODES["regex"])), 5e-6)
    with pytest.raises(ProfileError, match="unknown constraint kind 'sql'"):
        s.fill_s(["sql"])
    with pytest.raises(ProfileError, match="unknown constraint kind"):
        s.fill_s(3, "sql")


def test_unmeasured_kind_draws_from_the_pooled_profile(profile: GrammarProfile) -> None:
    s = profile.sampler(0)
    choice = s.fill_s(50_000, "choice")
    pooled = s.fill_s(50_000)
    assert np.median(choice) == pytest.approx(np.median(pooled), rel=0.1)
    assert np.median(choice) == pytest.approx(profile.overall.fill_s.p50, rel=0.1)


def test_compile_draws(profile: GrammarProfile) -> None:
    s = profile.sampler(0)
    ids = ["js3", "unseen-a", "unseen-a", "unseen-b", None, "re-bad", "js-bad"]
    kinds = ["json_schema"] * 5 + ["regex", "json_schema"]
    t = s.compile_s(ids, kinds)
    assert t[0] == profile.compile_by_spec["js3"]
    assert t[1] == t[2]  # same spec, same cost
    status = s.compile_status(ids, kinds)
    assert status[0] == "ok" and status[5] == "error" and status[6] == "unsupported"
    assert status[1] == status[2]
    with pytest.raises(ValueError, match="one kind per spec id"):
        s.compile_s(["a", "b"], ["regex"])


def test_compile_one_matches_the_array_forms(profile: GrammarProfile) -> None:
    s = profile.sampler(4)
    ids = ["js3", "js-err", "fresh-1", "fresh-2", "fresh-3"]
    kinds = ["json_schema", "json_schema", "regex", "json_schema", "choice"]
    seconds, status = s.compile_s(ids, kinds), s.compile_status(ids, kinds)
    for i, (spec_id, kind) in enumerate(zip(ids, kinds)):
        one_s, one_status = s.compile_one(spec_id, kind)
        assert one_s == pytest.approx(seconds[i], rel=1e-12) and one_status == status[i]
    assert s.compile_one(None, "regex")[0] > 0
    with pytest.raises(ProfileError, match="unknown constraint kind"):
        s.compile_one("x", "sql")


def test_unseen_spec_failure_rate_follows_the_kind(profile: GrammarProfile) -> None:
    s = profile.sampler(0)
    ids = [f"new{i}" for i in range(20_000)]
    status = s.compile_status(ids, np.full(len(ids), KIND_CODES["json_schema"]))
    assert np.mean(status != "ok") == pytest.approx(3 / 43, abs=0.01)
    assert set(status) == {"ok", "unsupported", "error", "timeout"}


def test_zero_profile() -> None:
    p = GrammarProfile.zero("none", "qwen3.6")
    s = p.sampler(0)
    assert not s.fill_s(5, "json_schema").any() and not s.compile_s(["a"], ["regex"]).any()
    assert list(s.compile_status(["a"], ["regex"])) == ["ok"]
    assert not s.jump_forward(5).any()


def test_missing_metric_is_reported_when_drawn() -> None:
    p = GrammarProfile.from_measurements("b", "v", [], [WalkMeasurement("w", "regex", fill_s=np.ones(3))])
    s = p.sampler(0)
    assert s.fill_s(2, "regex").tolist() == [1.0, 1.0]
    with pytest.raises(ProfileError, match="no compile_s measurements"):
        s.compile_s(["a"], ["regex"])


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines", "none"])
def test_shipped_default_profiles_load_and_sample(backend: str) -> None:
    p = GrammarProfile.builtin(backend)
    assert p.backend == backend and p.vocab == "qwen3.6"
    s = p.sampler(0)
    kinds = ["json_schema", "regex", "choice", "ebnf", "structural_tag"]
    for draw in (s.fill_s, s.accept_s, s.rollback_s, s.jump_forward):
        assert draw(kinds).shape == (5,)
    assert np.all(s.compile_s([f"new-{k}" for k in kinds], kinds) >= 0)
    if backend != "none":
        assert p.overall.fill_s.count > 100 and p.overall.compile_s.count > 5


def test_unknown_builtin_lists_known() -> None:
    with pytest.raises(ProfileError, match="no default grammar profile for backend 'nope'"):
        GrammarProfile.builtin("nope")


@pytest.mark.parametrize("samples", [1, 2, 40, 512, 513, 100_000])
def test_quantiles_of_uniform_draws_are_numpys_interpolation_bit_for_bit(samples: int) -> None:
    """Model mode draws its cost pools through ``quantile_of_uniform``: the same values as ``quantile``
    (``numpy.interp``), bit for bit, for distributions of every size (the dense tail searched)."""
    rng = np.random.default_rng(samples)
    dist = Distribution.from_samples(rng.lognormal(-11, 1.5, samples))
    for _ in range(50):
        u = rng.random(2048)
        assert dist.quantile_of_uniform(u).tobytes() == dist.quantile(u).tobytes()
    edges = np.array([0.0, np.nextafter(1.0, 0.0), *np.asarray(dist.probs[:-1])])  # at the points themselves
    assert dist.quantile_of_uniform(edges).tobytes() == dist.quantile(edges).tobytes()


def test_quantiles_of_uniform_draws_step_over_repeated_points() -> None:
    """A hand-made distribution may repeat a quantile point: the draws interpolate as ``numpy.interp`` does."""
    dist = Distribution(count=4, probs=[0.0, 0.5, 0.5, 0.5, 0.75, 1.0], values=[1e-6, 2e-6, 3e-6, 4e-6, 5e-6, 9e-6])
    u = np.concatenate((np.random.default_rng(0).random(4096), [0.5, 0.75, 0.0]))
    assert dist.quantile_of_uniform(u).tobytes() == dist.quantile(u).tobytes()
