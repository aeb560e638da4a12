"""Packs: run folders into one Parquet file set and back, and fidelity / compare reading runs out of a pack."""

import json
import shutil

import pandas as pd
import pytest
from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.results.config_files import builtin_config_path
from cdbench.results.pack import Pack, find_run_folders, open_run, pack_runs
from cdbench.results.run_folder import ResultsError, load_run

runner = CliRunner()


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    """Two tiny model-mode runs of one workload (sglang and vllm), as `cdbench compare` writes them."""
    out = tmp_path_factory.mktemp("campaign") / "runs"
    result = runner.invoke(app, ["compare", "--policies", "sglang,vllm", "--config", str(builtin_config_path("ci")),
                                 "--requests", "30", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def packed(campaign):
    dest = campaign.parent / "campaign.pack"
    result = runner.invoke(app, ["pack", str(campaign), str(dest)])
    assert result.exit_code == 0, result.output
    assert "packed 2 runs" in result.output
    return dest


def _same_run(a, b):
    assert a.summary == b.summary and a.config == b.config and a.label == b.label
    for x, y in ((a.requests, b.requests), (a.steps, b.steps)):
        pd.testing.assert_frame_equal(x, y, check_exact=True)
        assert list(x.dtypes) == list(y.dtypes)


def test_a_packed_run_reads_as_its_folder(campaign, packed):
    assert Pack(packed).run_ids == ["sglang", "vllm"]
    for run_id in ("sglang", "vllm"):
        folder_run, packed_run = load_run(campaign / run_id), open_run(f"{packed}::{run_id}")
        _same_run(folder_run, packed_run)
        assert packed_run.ref == f"{packed}::{run_id}" and packed_run.has_tables
        trace = (campaign / run_id / "workload.trace.jsonl").read_bytes()
        assert packed_run.read_file("workload.trace.jsonl") == trace
        assert packed_run.read_file("report.md") is None  # derived: rebuilt by cdbench report, not packed


def _body(md: str) -> list[str]:
    return [line for line in md.splitlines() if not line.startswith("Runs:")]  # the one line naming the runs


def test_fidelity_and_compare_give_the_same_output_from_the_pack_and_from_the_folders(campaign, packed, tmp_path):
    outputs = {}
    for source, refs in (("folders", [str(campaign / "sglang"), str(campaign / "vllm")]),
                         ("pack", [f"{packed}::sglang", f"{packed}::vllm"])):
        fid = runner.invoke(app, ["fidelity", *refs, "--noise", refs[0], refs[1], "--out", str(tmp_path / f"f-{source}")])
        cmp = runner.invoke(app, ["compare", *refs, "--out", str(tmp_path / f"c-{source}")])
        assert fid.exit_code in (0, 1) and cmp.exit_code == 0, fid.output + cmp.output
        outputs[source] = (fid.exit_code, (tmp_path / f"f-{source}" / "fidelity.csv").read_text(),
                           _body((tmp_path / f"f-{source}" / "fidelity.md").read_text()),
                           (tmp_path / f"c-{source}" / "comparison.csv").read_text(),
                           _body((tmp_path / f"c-{source}" / "comparison.md").read_text()))
    assert outputs["pack"] == outputs["folders"]
    assert f"({packed}::sglang)" in (tmp_path / "f-pack" / "fidelity.md").read_text()
    assert (tmp_path / "f-pack" / "plots" / "ttft_cdf.png").is_file()


def test_unpack_gives_back_the_folders(campaign, packed, tmp_path):
    result = runner.invoke(app, ["pack", "--unpack", str(packed), str(tmp_path / "back")])
    assert result.exit_code == 0, result.output
    for run_id in ("sglang", "vllm"):
        _same_run(load_run(campaign / run_id), load_run(tmp_path / "back" / run_id))
        for name in ("summary.json", "config.yaml", "workload.trace.jsonl", "workload_issues.json"):
            assert (tmp_path / "back" / run_id / name).read_bytes() == (campaign / run_id / name).read_bytes()


def test_runs_of_different_columns_each_keep_their_own(campaign, tmp_path):
    """Runs written by different cdbench versions: a column only one has, and one whose type differs."""
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(campaign / "sglang", old)
    shutil.copytree(campaign / "vllm", new)
    requests = pd.read_parquet(old / "requests.parquet").drop(columns=["valid"])
    requests["output_tokens"] = requests["output_tokens"].astype("float64")  # int64 in the newer run
    requests.to_parquet(old / "requests.parquet", index=False)
    pack = pack_runs({"old": old, "new": new}, tmp_path / "p.pack")
    _same_run(load_run(old), open_run(f"{pack}::old"))
    _same_run(load_run(new), open_run(f"{pack}::new"))


def test_summary_only_runs_are_packed_and_compared_without_plots(campaign, tmp_path):
    """What the committed campaigns kept of most runs: summary.json and config.yaml."""
    src = tmp_path / "kept"
    for name in ("sglang", "vllm"):
        (src / "runs" / name).mkdir(parents=True)
        for file in ("summary.json", "config.yaml"):
            shutil.copy(campaign / name / file, src / "runs" / name / file)
    (src / "campaign.md").write_text("# the campaign page\n")
    assert list(find_run_folders(src)) == ["runs/sglang", "runs/vllm"]
    dest = tmp_path / "kept.pack"
    assert runner.invoke(app, ["pack", str(src), str(dest), "--all-files"]).exit_code == 0
    run = open_run(f"{dest}::runs/vllm")
    assert not run.has_tables and run.summary == json.loads((campaign / "vllm" / "summary.json").read_text())
    assert Pack(dest).read_file("campaign.md") == b"# the campaign page\n"
    result = runner.invoke(app, ["compare", f"{dest}::runs/sglang", f"{dest}::runs/vllm", "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "c" / "comparison.md").read_text()
    assert "Not in the CDFs (saved without requests.parquet): `sglang`, `vllm`." in md
    assert not (tmp_path / "c" / "plots").exists()
    listing = runner.invoke(app, ["pack", "--list", str(dest)])
    assert listing.exit_code == 0 and "runs/sglang" in listing.output and "1 more files" in listing.output


def test_bad_refs_and_destinations_are_one_line_errors(packed, campaign, tmp_path):
    with pytest.raises(ResultsError, match="holds no run 'nope'"):
        open_run(f"{packed}::nope")
    with pytest.raises(ResultsError, match="is not a cdbench pack"):
        open_run(f"{campaign}::sglang")
    with pytest.raises(ResultsError, match="already exists"):
        pack_runs({"sglang": campaign / "sglang"}, packed)
    result = runner.invoke(app, ["fidelity", f"{packed}::sglang", f"{packed}::nope"])
    assert result.exit_code == 2 and result.output.startswith("error:") and "holds no run 'nope'" in result.output
    empty = runner.invoke(app, ["pack", str(tmp_path), str(tmp_path / "x.pack")])
    assert empty.exit_code == 2 and "holds no run folder" in empty.output
