"""Packs: run folders into one Parquet file set and back, and fidelity / compare reading runs out of a pack."""

import gzip
import json
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cdbench.cli.app import app
from cdbench.results.config_files import builtin_config_path
from cdbench.results.pack import (
    STEP_QUANTUM_S,
    Pack,
    find_run_folders,
    open_run,
    pack_runs,
)
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


def _same_run(a, b, exact_steps=False):
    """``b`` is ``a`` packed: the same summary, config and requests; its steps' seconds within half a tick."""
    assert a.summary == b.summary and a.config == b.config and a.label == b.label
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    assert list(a.requests.dtypes) == list(b.requests.dtypes) and list(a.steps.dtypes) == list(b.steps.dtypes)
    seconds = [c for c in a.steps if c.endswith("_s") and a.steps[c].dtype.kind == "f"]
    assert seconds
    pd.testing.assert_frame_equal(a.steps.drop(columns=seconds), b.steps.drop(columns=seconds), check_exact=True)
    if exact_steps:
        pd.testing.assert_frame_equal(a.steps, b.steps, check_exact=True)
    else:
        gap = (a.steps[seconds] - b.steps[seconds]).abs().to_numpy()
        assert np.nanmax(gap) <= STEP_QUANTUM_S / 2 * (1 + 1e-6)
        assert (a.steps[seconds].isna() == b.steps[seconds].isna()).all().all()


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
    # categories the newer run does not have: the runs share a row group, each reads back its own
    requests["cache"] = requests["cache"].cat.add_categories(["retired"])
    requests.to_parquet(old / "requests.parquet", index=False)
    pack = pack_runs({"old": old, "new": new}, tmp_path / "p.pack")
    _same_run(load_run(old), open_run(f"{pack}::old"))
    _same_run(load_run(new), open_run(f"{pack}::new"))
    assert "retired" not in list(open_run(f"{pack}::new").requests["cache"].cat.categories)


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


def _pack_as_before(folders, dest):
    """The layout packs were written in before: a row group a run, dictionary pages, gzip files as they were."""
    dest.mkdir()
    index, tables, files = [], {"requests.parquet": [], "steps.parquet": []}, []
    for run_id, folder in folders.items():
        row = {"run_id": run_id, "mode": "model", "backend": None, "policy": None, "seed": 0,
               "summary": (folder / "summary.json").read_text(), "config": (folder / "config.yaml").read_text()}
        for name, runs in tables.items():
            table = pq.read_table(folder / name)
            row[f"{name.removesuffix('.parquet')}_schema"] = table.schema.serialize().to_pybytes()
            row[f"{name.removesuffix('.parquet')}_rows"] = table.num_rows
            runs.append(table.add_column(0, "run_id", pa.array([run_id] * table.num_rows, pa.string()))
                        .replace_schema_metadata(None))
        index.append(row)
        files += [{"run_id": run_id, "path": path.name, "data": path.read_bytes()} for path in sorted(folder.iterdir())
                  if path.name in ("workload.trace.jsonl", "notes.json.gz")]
    pq.write_table(pa.Table.from_pylist(index), dest / "runs.parquet")
    for name, runs in tables.items():
        with pq.ParquetWriter(dest / name, runs[0].schema) as writer:
            for table in runs:
                writer.write_table(table)
    pq.write_table(pa.Table.from_pylist(files), dest / "files.parquet")
    return dest


def test_gzip_files_are_packed_inflated_and_read_back_gzipped(campaign, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(campaign / "sglang", run)
    notes = b'{"note": "kept"}\n' * 50
    (run / "notes.json.gz").write_bytes(gzip.compress(notes))
    (run / "fake.gz").write_bytes(b"not gzip")  # a name that lies: kept byte for byte
    pack = pack_runs({"run": run}, tmp_path / "p.pack")
    stored = pq.read_table(pack / "files.parquet").to_pylist()
    assert {r["path"]: r["inflated"] for r in stored}["notes.json.gz"] is True
    assert {r["path"]: r["data"] for r in stored}["notes.json.gz"] == notes
    assert gzip.decompress(Pack(pack).read_file("notes.json.gz", "run")) == notes
    assert Pack(pack).read_file("fake.gz", "run") == b"not gzip"
    back = Pack(pack).unpack(tmp_path / "back")
    assert gzip.decompress((back / "run" / "notes.json.gz").read_bytes()) == notes


def test_a_pack_of_the_earlier_layout_reads_the_same_and_repacks_smaller(campaign, tmp_path):
    runs = {}
    for name in ("sglang", "vllm"):
        runs[name] = tmp_path / name
        shutil.copytree(campaign / name, runs[name])
    (runs["vllm"] / "notes.json.gz").write_bytes(gzip.compress(b"notes " * 100))
    before = _pack_as_before(runs, tmp_path / "before.pack")
    for name, folder in runs.items():
        _same_run(load_run(folder), open_run(f"{before}::{name}"))
    assert Pack(before).read_file("workload.trace.jsonl", "sglang") == (runs["sglang"] / "workload.trace.jsonl").read_bytes()

    result = runner.invoke(app, ["pack", "--repack", str(before), str(tmp_path / "after.pack")])
    assert result.exit_code == 0, result.output
    after = tmp_path / "after.pack"
    assert "repacked 2 runs" in result.output
    for name, folder in runs.items():
        _same_run(load_run(folder), open_run(f"{after}::{name}"))
        assert Pack(after).read_file("workload.trace.jsonl", name) == (folder / "workload.trace.jsonl").read_bytes()
    assert gzip.decompress(Pack(after).read_file("notes.json.gz", "vllm")) == b"notes " * 100
    for table in ("requests.parquet", "steps.parquet"):
        assert pq.ParquetFile(after / table).metadata.num_row_groups == 1  # every run's column compressed at once
    size = {pack: sum(p.stat().st_size for p in pack.iterdir()) for pack in (before, after)}
    assert size[after] < size[before]
    again = runner.invoke(app, ["pack", "--repack", str(before), str(after)])
    assert again.exit_code == 2 and "already exists" in again.output


def test_steps_seconds_are_kept_at_the_quantum_unless_exact(campaign, packed, tmp_path):
    folders = {run_id: campaign / run_id for run_id in ("sglang", "vllm")}
    exact = pack_runs(folders, tmp_path / "exact.pack", exact=True)
    for run_id, folder in folders.items():
        _same_run(load_run(folder), open_run(f"{exact}::{run_id}"), exact_steps=True)
        _same_run(load_run(folder), open_run(f"{packed}::{run_id}"))  # the default: ticks of 0.1 µs
    ticks = pq.read_table(packed / "steps.parquet").schema.field("duration_s")
    assert ticks.type == pa.int64() and float(ticks.metadata[b"cdbench.quantum_s"]) == STEP_QUANTUM_S
    assert pq.read_table(exact / "steps.parquet").schema.field("duration_s").type == pa.float64()
    assert (packed / "steps.parquet").stat().st_size < (exact / "steps.parquet").stat().st_size
    # repacking a quantized pack changes no tick; repacking an exact one quantizes it
    again = Pack(packed).repack(tmp_path / "again.pack")
    assert pq.read_table(again / "steps.parquet").equals(pq.read_table(packed / "steps.parquet"))
    from_exact = Pack(exact).repack(tmp_path / "from_exact.pack")
    assert pq.read_table(from_exact / "steps.parquet").equals(pq.read_table(packed / "steps.parquet"))
