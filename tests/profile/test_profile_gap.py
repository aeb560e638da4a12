"""cdbench profile-gap: two folders of grammar profiles, per backend and kind."""

import shutil

from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.harness.costs.grammar_profile import GrammarProfile, shipped_profiles

runner = CliRunner()


def test_a_profile_against_itself_in_the_other_format_is_one_to_one(tmp_path):
    base, other = tmp_path / "base", tmp_path / "other"
    base.mkdir(), other.mkdir()
    shipped = GrammarProfile.builtin("outlines")
    shipped.save(base / "profile_outlines.json")  # as cdbench profile names it
    shutil.copy(shipped_profiles()["outlines"], other / "outlines.parquet")
    result = runner.invoke(app, ["profile-gap", str(base), str(other), "--backends", "outlines"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("| ") and not line.startswith("| kind")]
    assert [line.split(" | ")[0] for line in lines] == ["| " + kind for kind in [*shipped.kinds, "pooled"]]
    ratios = [cell for line in lines for cell in line.split(" | ") if cell.endswith("×)")]
    assert len(ratios) >= 5 and all(cell.endswith("(1.00×)") for cell in ratios)  # a kind never measured: dashes
    count = shipped.overall.fill_s.count
    assert f"| {count} / {count} |" in lines[-1]


def test_a_missing_profile_is_one_line_naming_it(tmp_path):
    result = runner.invoke(app, ["profile-gap", str(tmp_path), str(tmp_path), "--backends", "xgrammar"])
    assert result.exit_code == 2 and result.output.startswith("error:")
    assert str(tmp_path / "xgrammar.parquet") in result.output
