import json

import pytest

from cdbench.results.output_folder import (
    MARKER_FILE,
    FolderInUseError,
    claim_folder,
    new_folder,
)


def test_a_run_never_writes_into_a_folder_holding_results_unless_told_to_replace_them(tmp_path):
    folder = tmp_path / "keep"
    claim_folder(folder, "run")
    (folder / "summary.json").write_text('{"completed": 20}')
    with pytest.raises(FolderInUseError, match=r"already holds the results of `cdbench run`; give another --out, "
                                               r"or --overwrite to replace them$"):
        claim_folder(folder, "run")
    assert (folder / "summary.json").read_text() == '{"completed": 20}'
    (folder / "plots").mkdir()
    (folder / "plots" / "a.png").write_bytes(b"x")
    claim_folder(folder, "run", overwrite=True)
    assert [p.name for p in folder.iterdir()] == [MARKER_FILE]
    assert json.loads((folder / MARKER_FILE).read_text())["command"] == "run"


def test_overwrite_never_deletes_files_cdbench_did_not_write(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(FolderInUseError, match="notes.txt"):
            claim_folder(tmp_path, "run", overwrite=overwrite)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_folders_from_before_markers_are_recognized_by_their_files(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(FolderInUseError, match="holds the results of `cdbench run`"):
        claim_folder(tmp_path, "sweep", identity={"name": "s"}, resumable=True)
    claim_folder(tmp_path, "compare", overwrite=True)
    assert not (tmp_path / "summary.json").exists()


def test_resumable_commands_continue_only_their_own_folder_with_the_same_identity(tmp_path):
    folder = tmp_path / "sweep"
    claim_folder(folder, "sweep", identity={"grid": [1, 2]}, resumable=True)
    (folder / "point").mkdir()
    claim_folder(folder, "sweep", identity={"grid": [1, 2]}, resumable=True)  # resumes
    assert (folder / "point").is_dir()
    with pytest.raises(FolderInUseError, match="made with other settings, so it cannot be resumed"):
        claim_folder(folder, "sweep", identity={"grid": [3]}, resumable=True)
    with pytest.raises(FolderInUseError, match="holds the results of `cdbench sweep`"):
        claim_folder(folder, "profile", resumable=True)
    with pytest.raises(FolderInUseError, match="holds the results of `cdbench sweep`"):
        claim_folder(folder, "run")
    claim_folder(folder, "sweep", identity={"grid": [3]}, resumable=True, overwrite=True)
    assert not (folder / "point").exists()


def test_an_empty_or_marker_only_folder_is_free_and_a_file_is_refused(tmp_path):
    claim_folder(tmp_path / "a", "run")  # a claim whose run then stopped before writing anything
    claim_folder(tmp_path / "a", "compare")
    (tmp_path / "f").write_text("")
    with pytest.raises(FolderInUseError, match="is a file; it must be a folder"):
        claim_folder(tmp_path / "f", "run")


def test_default_folders_never_collide(tmp_path):
    base = tmp_path / "runs" / "20260101-000000"
    assert [new_folder(base).name for _ in range(3)] == ["20260101-000000", "20260101-000000-2",
                                                          "20260101-000000-3"]


def test_a_sweep_folder_from_before_markers_resumes_only_the_same_sweep(tmp_path):
    (tmp_path / "sweep.json").write_text(json.dumps({"name": "s", "grid": {"a": [1]}}))
    claim_folder(tmp_path, "sweep", identity={"name": "s", "grid": {"a": [1]}}, resumable=True)
    (tmp_path / MARKER_FILE).unlink()
    with pytest.raises(FolderInUseError, match="made with other settings"):
        claim_folder(tmp_path, "sweep", identity={"name": "s", "grid": {"a": [2]}}, resumable=True)


def test_adopt_takes_a_folder_without_a_marker_as_it_is_and_no_other(tmp_path):
    earlier = tmp_path / "earlier"
    (earlier / "cell" / "run-a").mkdir(parents=True)
    (earlier / "cell" / "run-a" / "summary.json").write_text("{}")
    with pytest.raises(FolderInUseError, match="not a cdbench output folder"):
        claim_folder(earlier, "campaign", resumable=True)
    claim_folder(earlier, "campaign", identity={"campaign": "c"}, resumable=True, adopt=True)
    assert (earlier / "cell" / "run-a" / "summary.json").read_text() == "{}"
    assert json.loads((earlier / MARKER_FILE).read_text())["command"] == "campaign"
    claimed = tmp_path / "claimed"
    claim_folder(claimed, "sweep", identity={"grid": 1}, resumable=True)
    (claimed / "sweep.log").write_text("")
    with pytest.raises(FolderInUseError, match="holds the results of `cdbench sweep`"):
        claim_folder(claimed, "campaign", resumable=True, adopt=True)
