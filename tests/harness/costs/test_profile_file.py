"""Grammar profile files: the compressed Parquet format, read a spec at a time, and the JSON one kept."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cdbench.harness.costs.grammar_profile import (
    PROFILE_DIR,
    CompileMeasurement,
    GrammarProfile,
    LazySections,
    ProfileError,
    WalkMeasurement,
    shipped_profiles,
    with_sections,
)
from cdbench.harness.costs.spec_profile import SpecProfile, instance_key, spec_key_hash


def _profile() -> GrammarProfile:
    rng = np.random.default_rng(0)
    compiles = [CompileMeasurement(f"c/s{i}", "regex", "ok", 1e-3 * (i + 1)) for i in range(6)]
    compiles += [CompileMeasurement("c/bad", "regex", "error")]
    walks = [WalkMeasurement(f"c/s{i}", "regex", fill_s=rng.lognormal(-10, 1, 40), accept_s=np.full(40, 1e-6),
                             rollback_s=np.full(3, 2e-6), instance=instance_key(f"regex:c/s{i}", [i, 1, 2]))
             for i in range(6)]
    return GrammarProfile.from_measurements("xgrammar", "cl100k", compiles, walks, source="unit test")


def test_a_parquet_profile_reads_back_value_identical_to_the_profile_saved(tmp_path):
    profile = _profile()
    profile.save(tmp_path / "p.parquet")
    profile.save(tmp_path / "p.json")
    back, old = GrammarProfile.load(tmp_path / "p.parquet"), GrammarProfile.load(tmp_path / "p.json")
    assert isinstance(back.specs, LazySections) and isinstance(back.instances, LazySections)
    assert back == profile == old
    assert back.model_dump_json() == profile.model_dump_json() == old.model_dump_json()
    assert sorted(back.spec_labels()) == sorted(profile.spec_labels())
    assert pq.ParquetFile(tmp_path / "p.parquet").metadata.row_group(0).column(4).compression == "ZSTD"


def test_a_parquet_profile_decodes_a_spec_only_when_read(tmp_path):
    profile = _profile()
    path = tmp_path / "p.parquet"
    profile.save(path)
    table = pq.read_table(path)
    keys = table["key"].to_pylist()
    broken = spec_key_hash("regex:c/s3")
    bodies = ['{"kind": 7}' if k == broken else b for k, b in zip(keys, table["body"].to_pylist())]
    pq.write_table(table.set_column(4, "body", pa.array(bodies, pa.string())), path)
    lazy = GrammarProfile.load(path)  # the broken row is not read yet
    good = spec_key_hash("regex:c/s2")
    assert lazy.specs[good] == profile.specs[good] and len(lazy.specs) == len(profile.specs)
    assert (broken, "regex", "c") in lazy.spec_labels()
    with pytest.raises(ProfileError, match=f"p.parquet: invalid SpecProfile '{broken}', field 'kind'"):
        lazy.specs[broken]


def test_sections_added_to_a_parquet_profile_take_the_place_of_its_own(tmp_path):
    profile = _profile()
    profile.save(tmp_path / "p.parquet")
    lazy = GrammarProfile.load(tmp_path / "p.parquet")
    key = spec_key_hash("regex:c/s0")
    mine = SpecProfile(kind="choice", corpus="mine", fills=1)
    merged = with_sections(lazy.specs, {key: mine, "new": mine})
    assert merged[key] == mine and merged["new"] == mine and lazy.specs[key] == profile.specs[key]
    assert len(merged) == len(profile.specs) + 1 and set(merged) == set(profile.specs) | {"new"}
    assert {(k, kind) for k, kind, _ in merged.labels() if k in (key, "new")} == {(key, "choice"), ("new", "choice")}
    assert with_sections(profile.specs, {"new": mine}) == {**profile.specs, "new": mine}
    # a profile holding them saves as the sections it reads as
    updated = lazy.model_copy(update={"specs": merged})
    updated.save(tmp_path / "q.json")
    assert GrammarProfile.load(tmp_path / "q.json").specs == dict(merged.items())


@pytest.mark.parametrize("content, message", [
    (b"not parquet", "cannot read grammar profile"),
    (None, "not a grammar profile file \\(no column section, key, kind, corpus, body\\)"),
])
def test_a_bad_parquet_file_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "bad.parquet"
    if content is None:
        pq.write_table(pa.table({"x": [1]}), path)
    else:
        path.write_bytes(content)
    with pytest.raises(ProfileError, match=f"bad.parquet: {message}"):
        GrammarProfile.load(path)


def test_the_shipped_profiles_are_compact_parquet_files():
    assert set(shipped_profiles()) == {"xgrammar", "llguidance", "outlines", "none"}
    assert not list(PROFILE_DIR.glob("*.json"))
    for path in shipped_profiles().values():
        assert path.suffix == ".parquet" and path.stat().st_size < 1_500_000
    profile = GrammarProfile.builtin("xgrammar")
    assert isinstance(profile.specs, LazySections) and len(profile.specs) > 3000
    assert all(profile.specs[k].kind == kind for k, kind, _ in profile.spec_labels()[:50])
