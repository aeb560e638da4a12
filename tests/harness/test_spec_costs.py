"""Per-spec grammar costs in ``model`` mode: each spec replays its own measured costs, an unseen spec
takes a whole profiled spec, draws are per request and deterministic."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cdbench.backends.base import ConstraintSpec
from cdbench.harness.costs.cost_tables import ROW, SpecIndex
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.costs.grammar_profile import CompileMeasurement, GrammarProfile, WalkMeasurement
from cdbench.harness.costs.spec_profile import spec_key_hash
from cdbench.harness.executors.base import SpecKeys, StepRows
from cdbench.harness.executors.model import ModelExecutor, ProfileGrammarCosts
from cdbench.harness.policies import HOST_COST_FIELDS, policy
from cdbench.harness.run import simulate
from cdbench.workloads.request import Request

SPEC = ConstraintSpec("regex", "[a-z]+")
NO_HOST_COSTS = dict.fromkeys(HOST_COST_FIELDS, 0.0)  # the fills alone set the step times compared here
SLOW_FILL, FAST_FILL, FIRST_FACTOR = 1e-3, 1e-6, 10.0
SLOW_COMPILE, FAST_COMPILE = 0.5, 0.001


def _walk(spec_id: str, fill: float, rng: np.random.Generator, n: int = 64) -> WalkMeasurement:
    fills = fill * rng.uniform(0.95, 1.05, n)
    fills[0] *= FIRST_FACTOR  # the first fill of a fresh matcher costs more
    return WalkMeasurement(spec_id, "regex", fill_s=fills, accept_s=np.full(n, 2e-6), rollback_s=np.full(4, 3e-6))


def _profile(slow: str = "corp/slow", fast: str = "other/fast") -> GrammarProfile:
    rng = np.random.default_rng(0)
    compiles = [CompileMeasurement(slow, "regex", "ok", SLOW_COMPILE), CompileMeasurement(fast, "regex", "ok", FAST_COMPILE)]
    walks = [_walk(slow, SLOW_FILL, rng), _walk(slow, SLOW_FILL, rng), _walk(fast, FAST_FILL, rng)]
    return GrammarProfile.from_measurements("test", "qwen3.6", compiles, walks)


def _apart(spec_ids: list[str], out: int = 20) -> list[Request]:
    """One request at a time (10 s apart), so each step's grammar row is one known request."""
    return [Request(i, 10.0 * i, 50, out, SPEC, s) for i, s in enumerate(spec_ids)]


def _per_request_fills(spec_ids: list[str], seed: int = 0, profile: GrammarProfile | None = None):
    requests = _apart(spec_ids)
    result = simulate(requests, policy("vllm", **NO_HOST_COSTS, overlap=False), ModelExecutor(ProfileGrammarCosts(profile or _profile(), seed)),
                      FixedGpuCosts(forward_base_s=0.01), seed=seed, trace_steps=0)
    steps = result.steps[result.steps["grammar_rows"] > 0]
    owner = (steps["start_s"] // 10.0).astype(int)
    fills = [steps.loc[owner == i, "fill_s"].to_numpy() for i in range(len(requests))]
    frame = result.requests.sort_values("request_id")
    compile_s = (frame["compile_end_s"] - frame["compile_start_s"]).to_numpy()
    return fills, compile_s, result


def test_profile_keeps_each_specs_scale_and_position_curve() -> None:
    profile = _profile()
    slow = profile.specs[spec_key_hash("regex:corp/slow")]
    assert slow.compile_s == SLOW_COMPILE and slow.status == "ok" and slow.fills == 128
    by_bin = slow.fill_by_bin_s()  # mean fill per position bin: the first fill, then the rest
    assert by_bin[0] == pytest.approx(FIRST_FACTOR * SLOW_FILL, rel=0.06) and by_bin[5] == pytest.approx(SLOW_FILL, rel=0.06)
    assert slow.fill_scale_s == pytest.approx(SLOW_FILL * (63 + FIRST_FACTOR) / 64, rel=0.06)  # the mean
    assert slow.corpus == "corp" and slow.accept_s == pytest.approx(2e-6)
    fast = profile.specs[spec_key_hash("regex:other/fast")]
    assert fast.fill_by_bin_s()[5] == pytest.approx(FAST_FILL, rel=0.06)


def test_each_spec_replays_its_own_costs() -> None:
    # (a second request of a spec would hit the cache: copies are cache-distinct and cost as their item)
    fills, compile_s, result = _per_request_fills(["corp/slow", "other/fast", "corp/slow#copy1", "other/fast#copy1"])
    assert (result.requests["abort_reason"] == "").all()
    np.testing.assert_allclose(compile_s, [SLOW_COMPILE, FAST_COMPILE, SLOW_COMPILE, FAST_COMPILE])
    for i, scale in enumerate([SLOW_FILL, FAST_FILL, SLOW_FILL, FAST_FILL]):
        later = fills[i][1:]
        assert len(fills[i]) == 20
        # every token of the request costs its spec's fill (within the measured 5 % spread, times the
        # residual's spread), never the other spec's
        assert np.all((later > 0.8 * scale) & (later < 1.25 * scale)), (i, later / scale)
        assert fills[i][0] == pytest.approx(FIRST_FACTOR * scale, rel=0.25)


def test_unseen_specs_take_a_whole_profiled_spec_of_their_corpus_first() -> None:
    unseen = [f"new{i}" for i in range(24)]
    fills, compile_s, _ = _per_request_fills(unseen)
    chosen = []
    for f, c in zip(fills, compile_s):
        is_slow = c == pytest.approx(SLOW_COMPILE)
        assert is_slow or c == pytest.approx(FAST_COMPILE)
        scale = SLOW_FILL if is_slow else FAST_FILL
        assert np.all((f[1:] > 0.8 * scale) & (f[1:] < 1.25 * scale))  # compile and fills from one spec
        chosen.append(is_slow)
    assert 0 < sum(chosen) < len(chosen)  # both specs are drawn
    # a spec of a profiled corpus takes that corpus's spec; a copy of a profiled item takes the item's
    _, compile_s, _ = _per_request_fills(["corp/other", "other/x", "other/fast#copy3", "corp/slow#copy1"])
    np.testing.assert_allclose(compile_s, [SLOW_COMPILE, FAST_COMPILE, FAST_COMPILE, SLOW_COMPILE])


def test_spec_index_draw_is_stable_per_seed_and_spec() -> None:
    profile = _profile()
    a, b = SpecIndex(profile, 0), SpecIndex(profile, 0)
    texts = [f"regex:n{i}" for i in range(30)]
    assert [a.resolve(t, t[6:], "regex") for t in texts] == [b.resolve(t, t[6:], "regex") for t in reversed(texts)][::-1]
    assert SpecIndex(profile, 0).resolve("json_schema:n1", "n1", "json_schema") is None  # no spec of that kind


def test_same_seed_same_results_and_seed_changes_draws() -> None:
    ids = [f"new{i}" for i in range(6)] + ["corp/slow", "other/fast"]
    a, _, ra = _per_request_fills(ids, seed=1)
    b, _, rb = _per_request_fills(ids, seed=1)
    c, _, _ = _per_request_fills(ids, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert ra.requests.equals(rb.requests)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_a_requests_draws_do_not_depend_on_row_order() -> None:
    requests = [Request(i, 0.0, 50, 30, SPEC, s) for i, s in enumerate(["corp/slow", "other/fast", "new1", "new2"])]
    keys = SpecKeys.of(requests)

    def fills(order: list[int]) -> dict[int, float]:
        ex = ModelExecutor(ProfileGrammarCosts(_profile(), 3))
        ex.prepare(requests, keys)
        for rid in range(len(requests)):  # each request arrives: its cost pools are built
            ex.arrive(rid)
        rid = np.array(order)
        n = len(rid)
        work = ex.step(StepRows(rid, np.ones(n, bool), np.zeros(n, np.int64), np.full(n, 17), np.zeros(n, np.int64)),
                       np.random.default_rng(0))
        return dict(zip(order, work.fill_s.tolist()))

    assert fills([0, 1, 2, 3]) == fills([3, 1, 0, 2])


def test_format_1_profiles_without_spec_sections_still_load_and_draw_per_kind(tmp_path) -> None:
    data = _profile().model_dump(mode="json")
    data["format_version"] = 1  # a file written before per-spec sections existed
    del data["specs"]
    for section in [*data["kinds"].values(), data["overall"]]:
        del section["fill_residual"], section["fill_curve"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = GrammarProfile.load(path)
    assert old.format_version == 1 and not old.specs
    fills, compile_s, result = _per_request_fills(["corp/slow", "other/fast", "new1"], profile=old)
    assert (result.requests["abort_reason"] == "").all()
    np.testing.assert_allclose(compile_s[:2], [SLOW_COMPILE, FAST_COMPILE])  # compile_by_spec still serves
    pooled = np.concatenate(fills)
    # per kind: every request draws from the kind's pooled fills (both specs' costs mixed)
    assert all(len(f) == 20 for f in fills) and pooled.min() < 0.1 * SLOW_FILL and pooled.max() > 0.5 * SLOW_FILL


BODY_FILL, SPIKE_FILL = 10e-6, 0.1


def _spiky_profile() -> GrammarProfile:
    """A spec whose fills are ~10 µs but for three of 640 at 100 ms (xgrammar's C-like grammars)."""
    rng = np.random.default_rng(0)
    walks = []
    for i in range(10):
        fills = BODY_FILL * rng.uniform(0.9, 1.1, 64)
        if i == 0:
            fills[[20, 21, 40]] = SPIKE_FILL
        walks.append(WalkMeasurement("corp/spiky", "regex", fill_s=fills, accept_s=np.full(64, 2e-6)))
    return GrammarProfile.from_measurements("test", "qwen3.6", [CompileMeasurement("corp/spiky", "regex", "ok", 0.01)],
                                            walks)


def test_rare_outlier_fills_are_kept_apart_with_their_frequency() -> None:
    spec = _spiky_profile().specs[spec_key_hash("regex:corp/spiky")]
    assert sorted(spec.fill_outliers_s) == [SPIKE_FILL] * 3 and spec.fill_outlier_rate == pytest.approx(3 / 640)
    # the body's curve and residual no longer carry the spikes
    assert max(spec.fill_by_bin_s()) < 1.2 * BODY_FILL and max(spec.fill_residual) < 1.2


def test_outliers_replay_as_rare_spikes_not_spread_over_every_fill() -> None:
    n, out = 400, 64
    requests = [Request(i, 0.0, 50, out, SPEC, "corp/spiky") for i in range(n)]
    ex = ModelExecutor(ProfileGrammarCosts(_spiky_profile(), 0))
    ex.prepare(requests, SpecKeys.of(requests))
    for rid in range(len(requests)):  # each request arrives: its cost pools are built
        ex.arrive(rid)
    rid = np.arange(n)
    fills = np.concatenate([
        ex.step(StepRows(rid, np.ones(n, bool), np.zeros(n, np.int64), np.full(n, out - p), np.zeros(n, np.int64)),
                np.random.default_rng(p)).fill_s for p in range(out)])
    spikes = fills > 1e-3
    # the body stays the body at p99; the spikes keep their size and, in distribution, their frequency
    assert np.quantile(fills, 0.99) < 1.5 * BODY_FILL
    assert fills.max() == pytest.approx(SPIKE_FILL, rel=0.01)
    assert 0.5 * 3 / 640 < spikes.mean() < 2 * 3 / 640
    assert fills.sum() == pytest.approx(len(fills) * (BODY_FILL * (1 - 3 / 640) + SPIKE_FILL * 3 / 640), rel=0.5)


def _fills_at_positions(profile: GrammarProfile, spec_id: str, out: int, seed: int, n: int = 1) -> np.ndarray:
    """Model-mode fill seconds of ``n`` requests of ``spec_id`` at each answer position (rows: requests)."""
    requests = [Request(i, 0.0, 50, out, SPEC, spec_id) for i in range(n)]
    ex = ModelExecutor(ProfileGrammarCosts(profile, seed))
    ex.prepare(requests, SpecKeys.of(requests))
    for rid in range(len(requests)):  # each request arrives: its cost pools are built
        ex.arrive(rid)
    rid = np.arange(n)
    return np.stack([
        ex.step(StepRows(rid, np.ones(n, bool), np.zeros(n, np.int64), np.full(n, out - p), np.zeros(n, np.int64)),
                np.random.default_rng(p)).fill_s for p in range(out)], axis=1)


def test_a_short_answers_fills_replay_at_the_positions_measured() -> None:
    # one walk of a regex whose fills follow its grammar states (heavy at its character classes, cheap at
    # its literal and its end): a log2 bin's mean with that spread drawn as noise moved heavy fills elsewhere
    measured = np.full(16, 8e-3)
    measured[[0, 6, 13, 14, 15]] = [1e-3, 1e-3, 2e-4, 2e-4, 3e-4]
    measured[9] = 0.2  # once at one position: the grammar's state there for all we know, not an outlier
    walk = WalkMeasurement("corp/short", "regex", fill_s=measured, accept_s=np.full(16, 2e-6))
    profile = GrammarProfile.from_measurements("test", "qwen3.6", [CompileMeasurement("corp/short", "regex", "ok", 0.01)],
                                               [walk])
    for seed in range(5):
        np.testing.assert_allclose(_fills_at_positions(profile, "corp/short", 16, seed)[0], measured, rtol=1e-4)


def test_a_requests_fills_add_up_to_its_specs_mean_whatever_the_seed() -> None:
    # fills of one level but bimodal at every position: a request's total is 64 times the mean, not a
    # draw of 64 independent residuals (which left one heavy spec's replayed total to the seed)
    rng = np.random.default_rng(0)
    walks = [WalkMeasurement("corp/bimodal", "regex", fill_s=1e-3 * np.where(rng.random(64) < 0.5, 0.4, 1.6),
                             accept_s=np.full(64, 2e-6)) for _ in range(8)]
    profile = GrammarProfile.from_measurements("test", "qwen3.6", [CompileMeasurement("corp/bimodal", "regex", "ok", 0.01)],
                                               walks)
    spec = profile.specs[spec_key_hash("regex:corp/bimodal")]
    expected = 64 * spec.fill_scale_s  # (every position measured as often)
    totals = np.concatenate([_fills_at_positions(profile, "corp/bimodal", 64, seed, n=4).sum(axis=1)
                             for seed in range(10)])
    np.testing.assert_allclose(totals, expected, rtol=0.05)


def test_outliers_replay_evenly_spaced_so_no_request_takes_several_by_chance() -> None:
    fills = _fills_at_positions(_spiky_profile(), "corp/spiky", 64, 0, n=400)
    spikes = (fills > 1e-3).sum(axis=1)  # the rate is 3 in 640 fills: 0.3 per 64-token request
    assert spikes.max() == 1 and 0.2 < spikes.mean() < 0.4


def test_a_heavy_stretch_past_the_first_positions_replays_where_it_was_measured() -> None:
    # one walk of a grammar that turns slow for a stretch of its answer (e.g. an Earley parser inside one
    # rule): the stretch stays together, so its requests' steps run slow back to back as in the measured run;
    # a position bin with its values in another order spread it over the bin and out of phase
    measured = np.full(80, 2e-5)
    measured[40:60] = 0.15
    walk = WalkMeasurement("corp/stretch", "regex", fill_s=measured, accept_s=np.full(80, 2e-6))
    profile = GrammarProfile.from_measurements("test", "qwen3.6",
                                               [CompileMeasurement("corp/stretch", "regex", "ok", 0.01)], [walk])
    for seed in range(3):
        np.testing.assert_allclose(_fills_at_positions(profile, "corp/stretch", 80, seed)[0], measured, rtol=1e-4)


def test_a_text_the_profile_walked_replays_its_own_fills_and_an_unwalked_one_its_specs() -> None:
    """Fills depend on the text walked, not only the spec: two texts of one spec, one cheap and one a
    hundred times dearer at positions 5-9, each replay their own measured fills; a third, unwalked
    text takes the spec's curve (the mean of the two)."""
    from cdbench.harness.costs.spec_profile import base_key_text, instance_key

    out = 20
    texts = {"cheap": tuple(range(100, 100 + out)), "dear": tuple(range(200, 200 + out))}
    measured = {"cheap": np.full(out, 1e-5), "dear": np.full(out, 1e-5)}
    measured["dear"][5:10] = 1e-3
    base = base_key_text("regex:corp/one", "regex", "corp/one")
    walks = [WalkMeasurement("corp/one", "regex", fill_s=measured[t], accept_s=np.full(out, 2e-6),
                             instance=instance_key(base, texts[t])) for t in texts]
    profile = GrammarProfile.from_measurements("test", "qwen3.6", [CompileMeasurement("corp/one", "regex", "ok", 0.001)],
                                               walks)
    assert len(profile.instances) == 2
    assert profile.instances[instance_key(base, texts["dear"])].fill_s[7] == pytest.approx(1e-3)
    tokens = [texts["cheap"], texts["dear"], tuple(range(300, 300 + out))]
    requests = [Request(i, 10.0 * i, 50, out, SPEC, "corp/one" if i == 0 else f"corp/one#copy{i}", t, instance_index=i)
                for i, t in enumerate(tokens)]
    result = simulate(requests, policy("vllm", **NO_HOST_COSTS, overlap=False),
                      ModelExecutor(ProfileGrammarCosts(profile, 0)), FixedGpuCosts(forward_base_s=0.01), seed=0,
                      trace_steps=0)
    steps = result.steps[result.steps["grammar_rows"] > 0]
    owner = (steps["start_s"] // 10.0).astype(int)
    fills = [steps.loc[owner == i, "fill_s"].to_numpy() for i in range(3)]
    np.testing.assert_allclose(fills[0], measured["cheap"][:len(fills[0])], rtol=1e-4)
    np.testing.assert_allclose(fills[1], measured["dear"][:len(fills[1])], rtol=1e-4)
    spec_mean = (measured["cheap"] + measured["dear"]) / 2
    assert fills[2][5:10].mean() == pytest.approx(spec_mean[5:10].mean(), rel=0.3)


def _pools(tables, rid: int, out: int) -> tuple:
    """A request's pools and position curve as it reads them (wherever they sit)."""
    base, curve = int(tables.base[rid]), int(tables.curve_end[rid]) - out
    return (tables.fill[base:base + ROW].tolist(), tables.fill_csum[base:base + ROW].tolist(),
            tables.accept[base:base + ROW].tolist(), tables.forced[base:base + ROW].tolist(),
            tables.curve[curve:curve + out].tolist())


def test_cost_pools_are_built_as_requests_arrive_the_same_in_any_slot_and_freed_as_they_end() -> None:
    out = 64
    requests = [Request(i, 0.0, 50, out, SPEC, "corp/slow" if i % 2 else "other/fast") for i in range(6)]
    ex = ModelExecutor(ProfileGrammarCosts(_profile(), 0))
    ex.prepare(requests, SpecKeys.of(requests), jump_forward=True)
    tables = ex.tables
    ex.arrive(0)
    first = _pools(tables, 0, out)
    ex.finish(0)  # its slot is free, its pools still there
    ex.arrive(2)  # request 0's cost spec again: the same slot, not drawn again (slot 0: the row of ones)
    assert int(tables.base[2]) == ROW and tables._rows.size == 2
    ex.finish(2)
    ex.arrive(1)  # another cost spec takes the freed slot
    ex.arrive(4)  # request 0's cost spec again, drawn again into another slot
    assert (int(tables.base[1]), int(tables.base[4])) == (ROW, 2 * ROW)
    assert _pools(tables, 4, out) == first
    for rid in (3, 5):
        ex.arrive(rid)
    # two cost specs in flight: two rows of pools, however many requests read them
    assert tables._rows.size == 3 and len(tables._rows.refs) == 2
    for rid in (1, 3, 4, 5):
        ex.finish(rid)
    assert not tables._rows.refs and len(tables._rows.free) == 2


def test_a_run_without_drafts_or_jump_forward_draws_only_the_pools_it_reads_and_the_same_ones() -> None:
    """The pools only drafts read (prefix sums, rollback, draft chains) and the forced tokens are not drawn
    for a run without them; the fills, accepts and curves a request reads are the same values."""
    out = 64
    requests = [Request(i, 0.0, 50, out, SPEC, "corp/slow" if i % 2 else "other/fast") for i in range(4)]
    full, lean = ModelExecutor(ProfileGrammarCosts(_profile(), 0)), ModelExecutor(ProfileGrammarCosts(_profile(), 0))
    full.prepare(requests, SpecKeys.of(requests), jump_forward=True)
    lean.prepare(requests, SpecKeys.of(requests), jump_forward=False, drafts=False)
    t = lean.tables
    assert t.fill_csum is None and t.rollback is None and t.forced is None and t.draft_chain is None
    assert full.tables.forced is not None and full.tables.fill_csum is not None
    for rid in range(4):
        full.arrive(rid)
        lean.arrive(rid)
        for name in ("base", "curve_end"):
            assert int(getattr(full.tables, name)[rid]) == int(getattr(t, name)[rid])
        base = int(t.base[rid])
        for name in ("fill", "accept"):
            assert getattr(full.tables, name)[base:base + ROW].tolist() == getattr(t, name)[base:base + ROW].tolist()
        curve = int(t.curve_end[rid]) - out
        assert full.tables.curve[curve:curve + out].tolist() == t.curve[curve:curve + out].tolist()


@pytest.mark.parametrize("drafts, jump_forward", [(True, True), (False, False)])
def test_a_cost_specs_fills_drawn_when_first_read_are_those_drawn_with_its_other_pools(drafts, jump_forward) -> None:
    """Requests replaying their texts read no cost spec's fills: a row drawn for them leaves its fills (prefix sums,
    outliers) out, skipping their draws in its stream, and draws them once a request that reads them arrives. Every
    pool is then the values drawn at once."""
    requests = [Request(i, 0.0, 50, 64, SPEC, spec_id) for i, spec_id in enumerate(["corp/spiky", "corp/slow"])]
    spiky = _spiky_profile()
    for profile in (spiky, _profile()):
        at_once, late = (ModelExecutor(ProfileGrammarCosts(profile, 3)) for _ in range(2))
        for ex in (at_once, late):
            ex.prepare(requests, SpecKeys.of(requests), jump_forward=jump_forward, drafts=drafts)
        t, t_late = at_once.tables, late.tables
        cost_specs = {t._spec_of[rid] for rid in range(2)} - {None}
        assert cost_specs
        for cost_spec in cost_specs:
            for tables, fill in ((t, True), (t_late, False)):
                tables._grow_rows(2)
                tables._write_row(1, cost_spec, fill)
            assert t_late._unfilled == {1}
            row = slice(ROW, 2 * ROW)
            for name in ("accept", "rollback", "forced"):
                if getattr(t, name) is not None:
                    assert getattr(t_late, name)[row].tobytes() == getattr(t, name)[row].tobytes()
            t_late._write_fill(1, cost_spec)
            assert not t_late._unfilled
            for name in ("fill", "fill_csum", "spike"):
                if getattr(t, name) is not None:
                    assert getattr(t_late, name)[row].tobytes() == getattr(t, name)[row].tobytes()
        assert profile is not spiky or t_late.spike is not None  # (its outliers drawn late too)
