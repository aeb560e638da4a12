"""Claims are atomic: of several processes claiming one folder at once, exactly one gets it."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cdbench.results.output_folder import FolderInUseError, claim_folder, release_folder

CONTENDERS = 4
RESUMABLE = {"sweep", "profile"}


def _contend(folder: str, command: str, start, attempted, results) -> None:
    start.wait()
    try:
        claim_folder(Path(folder), command, identity={"same": 1} if command in RESUMABLE else None,
                     resumable=command in RESUMABLE)
        results.put("claimed")
    except FolderInUseError as err:
        results.put(str(err))
    attempted.wait()  # the winner holds its claim until every contender has tried


@pytest.mark.parametrize("command", ["run", "compare", "sweep", "profile", "fidelity", "kernels"])
def test_of_processes_claiming_one_folder_at_once_exactly_one_gets_it(tmp_path, command):
    context = multiprocessing.get_context("fork")
    start, attempted = context.Barrier(CONTENDERS), context.Barrier(CONTENDERS)
    results = context.Queue()
    folder = tmp_path / "out"
    workers = [context.Process(target=_contend, args=(str(folder), command, start, attempted, results))
               for _ in range(CONTENDERS)]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    assert outcomes.count("claimed") == 1, outcomes
    for refusal in (o for o in outcomes if o != "claimed"):
        assert refusal == (f"--out {folder} is being written by `cdbench {command}` right now; give another "
                           "--out, or wait for it to finish")


def test_the_claim_of_a_process_killed_outright_does_not_block_the_folder(tmp_path):
    folder = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from cdbench.results.output_folder import claim_folder
        claim_folder(Path({str(folder)!r}), "run")
        print("claimed", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(FolderInUseError, match="is being written by `cdbench run` right now"):
            claim_folder(folder, "run")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    claim_folder(folder, "run")  # the kernel dropped the dead process's lock
    release_folder(folder)


def test_a_released_claim_is_free_and_a_refused_one_leaves_nothing(tmp_path):
    folder = tmp_path / "out"
    claim_folder(folder, "run")
    release_folder(folder)
    claim_folder(folder, "compare")  # marker only: free again
    release_folder(folder)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FolderInUseError, match="not a cdbench output folder"):
        claim_folder(tmp_path, "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "out"]


CLI_CONTENDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from cdbench.cli.app import app  # the slow imports happen before the start line
    go = Path(sys.argv[1])
    while not go.exists():
        time.sleep(0.001)
    app(sys.argv[2:], prog_name="cdbench")
    """)


def test_two_runs_started_together_into_one_out_folder_exactly_one_proceeds(tmp_path):
    out, go = tmp_path / "shared", tmp_path / "go"
    runs = [subprocess.Popen([sys.executable, "-c", CLI_CONTENDER, str(go), "run", "--mode", "model", "-n", "200",
                              "--seed", str(seed), "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "COLUMNS": "200"})
            for seed in (1, 5)]
    go.touch()
    finished = [run.communicate(timeout=300) for run in runs]
    codes = [run.returncode for run in runs]
    assert sorted(codes) == [0, 2], (codes, finished)
    loser_err = finished[codes.index(2)][1]
    errors = [line for line in loser_err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"error: --out {out} "), loser_err
    winner_seed = (1, 5)[codes.index(0)]
    assert f"seed: {winner_seed}\n" in (out / "config.yaml").read_text()
