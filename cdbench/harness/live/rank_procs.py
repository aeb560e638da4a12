"""One process per rank: start them, wait for each one's output, and name the rank that failed.

Shared by live mode's rank runs (:mod:`cdbench.harness.live.ranks`) and the tensor-parallel
calibration (:func:`cdbench.harness.live.measure.measure_grid_tp`). Each rank runs
``target(rank, folder, *args)`` in a fresh interpreter (spawn: no forked torch or backend state) and
hands back its output with :func:`deliver`; a rank that raises leaves its traceback, which the parent
reports naming the rank, and the others are ended.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from cdbench.harness.collectives import CollectiveError

STACKS_ENV = "CDBENCH_RANK_STACKS_S"  # set: each rank prints its threads' stacks every that many seconds


def run_rank_processes(target: Callable[..., None], ranks: int, args: Sequence[object], timeout_s: float,
                       progress: Callable[[float], None] | None = None, name: str = "cdbench-rank") -> list[object]:
    """Every rank's delivered output, in rank order, once all ``ranks`` processes of ``target`` delivered.

    ``progress`` is called with the share of ranks done. A failed or silent rank, or ``timeout_s`` passing,
    raises :class:`~cdbench.harness.collectives.CollectiveError` naming the rank.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        folder = Path(tmp)
        procs = [ctx.Process(target=_rank_main, args=(target, rank, str(folder), tuple(args)), name=f"{name}{rank}")
                 for rank in range(ranks)]
        for proc in procs:
            proc.start()
        try:
            _wait(procs, folder, timeout_s, progress)
        finally:
            for proc in procs:
                proc.join(timeout=10)  # (a rank that delivered may still be leaving its group)
                if proc.is_alive():
                    proc.terminate()  # our own child, stuck or left waiting on a failed rank: ended by its handle
                    proc.join()
        return [pickle.loads((folder / f"rank{rank}.pkl").read_bytes()) for rank in range(ranks)]


def deliver(folder: Path, rank: int, output: object) -> None:
    """Hand ``output`` to the parent (whole or absent: the parent never reads half of it)."""
    scratch = folder / f"rank{rank}.tmp"
    scratch.write_bytes(pickle.dumps(output))
    scratch.rename(folder / f"rank{rank}.pkl")


def _rank_main(target: Callable[..., None], rank: int, folder: str, args: tuple) -> None:
    """One rank process: run ``target``, leave its error for the parent if it fails."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if stacks := os.environ.get(STACKS_ENV):  # a stuck rank says where it waits (every that many seconds)
        faulthandler.dump_traceback_later(float(stacks), repeat=True)
    try:
        target(rank, Path(folder), *args)
    except BaseException:  # noqa: BLE001 - reported to the parent, which names the rank and ends the others
        (Path(folder) / f"rank{rank}.err").write_text(traceback.format_exc())


def _wait(procs, folder: Path, timeout_s: float, progress: Callable[[float], None] | None) -> None:
    """Until every rank has delivered its output (a rank may still be leaving its group then)."""
    deadline = time.monotonic() + timeout_s
    done: set[int] = set()
    while len(done) < len(procs):
        for rank, proc in enumerate(procs):
            if rank in done:
                continue
            failure = folder / f"rank{rank}.err"
            if (folder / f"rank{rank}.pkl").exists():
                done.add(rank)
                if progress is not None:
                    progress(len(done) / len(procs))
            elif failure.exists():
                text = failure.read_text()
                raise CollectiveError(f"rank {rank} failed: {text.strip().splitlines()[-1]}\n{text}")
            elif not proc.is_alive():
                raise CollectiveError(f"rank {rank} ended (exit code {proc.exitcode}) without a result")
        if time.monotonic() > deadline:
            raise CollectiveError(f"the ranks did not finish within {timeout_s:g} s (done: {sorted(done)})")
        time.sleep(0.05)
