"""Filling the spec-cost store from a corpus (``fill_store``): an entry per spec, reruns measure nothing,
failures kept with their status.

Real xgrammar compiles in a worker process, on a corpus of three specs written here with the cl100k
vocabulary, so the module costs seconds; the host benchmark is replaced by a constant.
"""

from __future__ import annotations

import json

import pytest

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.registry import UnknownBackendError
from cdbench.harness.costs import host as host_module
from cdbench.harness.costs.host import this_host
from cdbench.harness.costs.spec_store import SpecCostStore, backend_version, spec_digest
from cdbench.profile.fill_store import fill_store
from cdbench.workloads.corpora import UnknownCorpusError

ITEMS = [
    {"id": "t/person", "kind": "json_schema",
     "spec": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
    {"id": "t/code", "kind": "regex", "spec": "[A-Z]{2}-[0-9]{3}"},
    {"id": "t/broken", "kind": "json_schema",
     "spec": {"type": "object", "properties": {"x": {"$ref": "#/definitions/missing"}}}},
]


def _spec(item: dict) -> ConstraintSpec:
    return ConstraintSpec(item["kind"], item["spec"])


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A corpus of :data:`ITEMS`, filled into a fresh store twice (the second time: nothing left)."""
    patch = pytest.MonkeyPatch()
    patch.setattr(host_module, "run_benchmark", lambda: 1.0)
    root = tmp_path_factory.mktemp("fill")
    corpus = root / "tiny.jsonl"
    corpus.write_text("".join(json.dumps({**item, "source": "tests", "license": "MIT"}) + "\n" for item in ITEMS))
    store = root / "store"
    first = fill_store([str(corpus)], ["xgrammar"], "cl100k", store)
    second = fill_store([str(corpus)], ["xgrammar"], "cl100k", store)
    yield SpecCostStore(store), first, second
    patch.undo()


def _entry(store: SpecCostStore, item: dict):
    digest = spec_digest("xgrammar", backend_version("xgrammar"), "cl100k", {}, _spec(item))
    (entry,) = store.entries(digest)
    return entry


def test_every_spec_gets_an_entry_with_its_label_and_text(filled):
    store, first, _ = filled
    assert len(store) == len(ITEMS) and first.items == len(ITEMS)
    for item in ITEMS:
        entry = _entry(store, item)
        assert (entry.label, entry.spec, entry.kind) == (item["id"], _spec(item).canonical(), item["kind"])
        assert entry.host.id == this_host(store.root).id
    (fill,) = first.backends
    assert (fill.backend, fill.specs, fill.held, fill.measured, fill.impossible) == ("xgrammar", 3, 0, 3, None)


def test_specs_that_compile_walk_their_oracle_texts(filled):
    store, _, _ = filled
    for item in ITEMS[:2]:
        entry = _entry(store, item)
        assert entry.status == "ok" and entry.costs.compile_s > 0
        assert entry.costs.fills > 0 and entry.costs.fill_scale_s > 0 and len(entry.instances) == 2


def test_a_bad_spec_is_recorded_with_its_status(filled):
    store, first, _ = filled
    entry = _entry(store, ITEMS[2])
    assert entry.status == "error" and "definitions" in entry.message
    assert first.backends[0].statuses == {"ok": 2, "error": 1}


def test_a_second_fill_measures_nothing(filled):
    store, _, second = filled
    (fill,) = second.backends
    assert (fill.specs, fill.held, fill.measured, fill.statuses) == (3, 3, 0, {})
    assert len(store) == len(ITEMS)


def test_unknown_names_are_refused_before_anything_is_measured(tmp_path):
    with pytest.raises(UnknownBackendError, match="unknown backend 'nope'; available: .*xgrammar"):
        fill_store(["embedded"], ["nope"], "cl100k", tmp_path / "store")
    with pytest.raises(UnknownCorpusError, match="no_such_corpus"):
        fill_store(["no_such_corpus"], ["xgrammar"], "cl100k", tmp_path / "store")
    assert not (tmp_path / "store").exists()
