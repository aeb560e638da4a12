"""A profile the user names prices each run spec by its key first, so a cache-distinct copy of a corpus item
(same content, its own compile in the run that made the profile) replays its own measurement."""

from __future__ import annotations

import pytest

from cdbench.backends.base import ConstraintSpec
from cdbench.harness.costs.grammar_profile import GrammarProfile, with_sections
from cdbench.harness.costs.spec_costs import SpecCostSettings, price_specs
from cdbench.harness.costs.spec_profile import SpecProfile, spec_key_hash
from cdbench.workloads.generator import original_of_copy
from cdbench.workloads.instances import spec_hash
from cdbench.workloads.request import Request


def _costs(spec_id: str, compile_s: float) -> SpecProfile:
    return SpecProfile(kind="regex", spec_id=spec_id, status="ok", compile_s=compile_s, fills=4, fill_scale_s=1e-5,
                       fill_curve=[1.0] * 13, fill_residual=[1.0], accept_s=1e-6)


@pytest.mark.parametrize("named", [True, False])
def test_a_copy_replays_its_own_compile_from_a_named_profile_and_its_items_from_a_shipped_one(tmp_path, named):
    original = ConstraintSpec("regex", "[ab]+")
    copy = ConstraintSpec("regex", "[ab]+", {"unique_copy": 1})
    assert original_of_copy(copy) == original
    base = GrammarProfile.builtin("xgrammar")
    keys = {"regex:r/a": _costs("r/a", 0.001), "regex:r/a#copy1": _costs("r/a#copy1", 0.009)}
    profile = base.model_copy(update={
        "vocab": "cl100k", "specs": with_sections(base.specs, {spec_key_hash(k): v for k, v in keys.items()}),
        "spec_contents": {**base.spec_contents, **{spec_key_hash(k): spec_hash(original) for k in keys}}})
    requests = [Request(0, 0.0, 16, 8, original, "r/a"), Request(1, 0.1, 16, 8, copy, "r/a#copy1")]
    priced, coverage = price_specs(profile, "xgrammar", {}, "cl100k", requests,
                                   SpecCostSettings(spec_store=str(tmp_path), spec_costs="strict"),
                                   named_profile=named)
    assert coverage.specs["profile"] == 2
    compiles = [priced.specs[spec_key_hash(k)].compile_s for k in keys]
    # named: each by its own key; shipped (not trusted by key): the copy costs what its item costs
    assert compiles == ([0.001, 0.009] if named else [0.001, 0.001])


def test_copies_share_their_items_price_and_a_copy_of_other_content_gets_its_own(tmp_path):
    """Copies of one item are priced once for all (what prices them is shared), each as its item; a spec
    whose id names an item but whose content is another's is priced by its content, as it is alone."""
    base = GrammarProfile.builtin("xgrammar")
    contents = {"regex:r/a": ConstraintSpec("regex", "[ab]+"), "regex:r/b": ConstraintSpec("regex", "[cd]+")}
    profile = base.model_copy(update={
        "vocab": "cl100k",
        "specs": with_sections(base.specs, {spec_key_hash("regex:r/a"): _costs("r/a", 0.001),
                                            spec_key_hash("regex:r/b"): _costs("r/b", 0.005)}),
        "spec_contents": {**base.spec_contents, **{spec_key_hash(k): spec_hash(v) for k, v in contents.items()}}})
    requests = [Request(i, 0.1 * i, 16, 8, ConstraintSpec("regex", text, {"unique_copy": copy}), f"r/a#copy{copy}")
                for i, (copy, text) in enumerate([(1, "[ab]+"), (2, "[ab]+"), (3, "[cd]+"), (4, "[ab]+")])]
    settings = SpecCostSettings(spec_store=str(tmp_path), spec_costs="strict")
    priced, coverage = price_specs(profile, "xgrammar", {}, "cl100k", requests, settings)
    assert coverage.specs["profile"] == 4
    together = [priced.specs[spec_key_hash(f"regex:{r.spec_id}")].compile_s for r in requests]
    alone = [price_specs(profile, "xgrammar", {}, "cl100k", [r], settings)[0].specs[
        spec_key_hash(f"regex:{r.spec_id}")].compile_s for r in requests]
    assert together == alone == [0.001, 0.001, 0.005, 0.001]
