"""The registry's schema: the shipped file is valid, and a bad entry is one line naming it and the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest
import yaml

from cdbench.published.registry import RegistryError, load_registry, parse_registry

GOOD = {
    "id": "x-1", "title": "t",
    "source": {"kind": "pull_request", "url": "https://github.com/o/r/pull/1", "title": "t", "date": "2025-01-02"},
    "setup": {"engine": "vllm", "version": "0.1", "workload": "w", "load": "l", "change": "c"},
    "published": {"metric": "request_throughput", "base": 10.0, "treatment": 12.0, "unit": "req/s"},
    "reproducible": True,
    "config": {"workload": {"num_requests": 4}},
    "arms": {"base": {"scheduler.overlap": False}, "treatment": {"scheduler.overlap": True}},
}


def _one(**changes) -> dict:
    entry = copy.deepcopy(GOOD)
    entry.update(changes)
    return {"entries": [entry]}


def test_the_shipped_registry_holds_at_least_eight_published_effects():
    reg = load_registry()
    assert len(reg.entries) >= 8
    assert all(e.unstated for e in reg.entries if not e.reproducible)
    assert reg.entry("vllm-26866-structured-cost").published.effect == pytest.approx(69.36 / 103.16 - 1)


def test_each_release_fill_factor_is_the_committed_measurement_of_that_release():
    """An entry's ``costs.grammar_fill_scale`` is its xgrammar release's fills summed over 0.2.8's (the profile's
    release) at Qwen3's 151,936 logits, in reports/engine_costs/xgrammar_release_fills.csv.gz: 0.1.23 for #24300
    (vLLM's pin from August 2025), 0.1.25 for the #26866 cells (from September)."""
    rows = pd.read_csv(Path(__file__).parents[2] / "reports" / "engine_costs" / "xgrammar_release_fills.csv.gz")
    rows = rows[rows.vocab == 151936]

    def summed(release: str) -> float:
        per_schema = {v: rows[rows.backend_version == v].groupby("schema").fill_s.median() for v in (release, "0.2.8")}
        both = per_schema[release].index
        return float(per_schema[release].sum() / per_schema["0.2.8"].loc[both].sum())

    reg = load_registry()
    releases = {"vllm-24300": "0.1.23", **{e.id: "0.1.25" for e in reg.entries if e.id.startswith("vllm-26866")}}
    for entry in reg.entries:
        scale = entry.config.get("costs", {}).get("grammar_fill_scale")
        if entry.id in releases:
            assert scale == pytest.approx(summed(releases[entry.id]), abs=0.005), entry.id
        else:
            assert scale is None, entry.id


def test_a_good_entry_validates_and_its_effect_is_the_relative_change():
    entry = parse_registry(_one()).entries[0]
    assert entry.published.effect == pytest.approx(0.2)
    assert entry.small_requests == 40


def test_a_yaml_date_is_read_as_its_iso_text():
    data = yaml.safe_load(yaml.safe_dump(_one()).replace("'2025-01-02'", "2025-01-02"))
    assert parse_registry(data).entries[0].source.date == "2025-01-02"


@pytest.mark.parametrize(("changes", "expected"), [
    ({"published": {**GOOD["published"], "metric": "joy"}}, "entry 'x-1', field 'published.metric'"),
    ({"published": {**GOOD["published"], "base": 0}}, "entry 'x-1', field 'published.base'"),
    ({"source": {**GOOD["source"], "url": "not a link"}}, "entry 'x-1', field 'source.url'"),
    ({"reproducible": False}, "names what its source leaves unstated"),
    ({"config": {"mode": "hybrid"}}, "the arms run in model mode"),
    ({"extra": 1}, "entry 'x-1', field 'extra'"),
    ({"id": "Bad Id"}, "entry 'Bad Id', field 'id'"),
])
def test_a_bad_entry_is_one_line_naming_it_and_the_field(changes, expected):
    with pytest.raises(RegistryError) as err:
        parse_registry(_one(**changes))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_an_entry_without_an_id_is_named_by_its_place_and_ids_are_unique():
    data = _one()
    del data["entries"][0]["id"]
    with pytest.raises(RegistryError, match=r"entry #1, field 'id': Field required"):
        parse_registry(data)
    with pytest.raises(RegistryError, match="entry id 'x-1' appears twice"):
        parse_registry({"entries": [GOOD, GOOD]})


def test_a_file_that_is_not_a_registry_names_the_file(tmp_path):
    path = tmp_path / "reg.yaml"
    path.write_text("entries: [\n")
    with pytest.raises(RegistryError, match="reg.yaml is not valid YAML"):
        load_registry(path)
    path.write_text(yaml.safe_dump(_one(published={**GOOD["published"], "unit": ""})))
    with pytest.raises(RegistryError, match=r"reg.yaml: registry: entry 'x-1', field 'published.unit'"):
        load_registry(path)


def test_an_unknown_entry_lists_the_known_ones():
    with pytest.raises(RegistryError, match="no registry entry 'nope'; known: vllm-24300"):
        load_registry().entry("nope")
