"""How DP/TP ranks agree on grammar readiness: a modelled constant, or a real all_gather (gloo or NCCL).

With ``R > 1`` ranks each rank compiles every grammar itself; before a step
the ranks exchange what each saw ready and what each gave up on (SGLang's
``all_gather_object`` of its ready and failed sets): ready = ready on every rank
(intersection), failed = failed on any (union).

- ``scheduler.collectives: model``: the scheduler computes the sets over its
  per-rank arrays and prices the exchange at the constant ``all_gather_s``.
- :class:`RankAgreement` (``scheduler.collectives: gloo`` or ``nccl``) runs the
  exchange for real: one local process per rank joined in a
  ``torch.distributed`` group; each receives its rank's sets, the ranks meet at
  a barrier, then ``all_gather_object`` the sets, and each computes the
  agreement. The step pays the measured all_gather (the slowest rank's)
  instead of the constant. gloo needs no GPU; with NCCL rank ``r`` holds GPU
  ``r`` (the objects travel as GPU tensors, as in a multi-GPU engine), so it
  needs as many GPUs as ranks.
- :class:`PeerAgreement` is one rank's side of the same exchange when every
  rank is a process with a scheduler of its own (``live`` mode's rank
  processes, :mod:`~cdbench.harness.live.ranks`): it gathers this rank's sets
  from the others' over a process group the caller joined, and the step
  durations the ranks must share.

>>> agree_sets([[1, 2, 3], [2, 3]], [[], [3]])
((2,), (3,))
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Self


@dataclass(frozen=True)
class Agreement:
    """The ranks' common view: requests ready on every rank and not failed, requests failed on any rank."""

    ready: tuple[int, ...]
    failed: tuple[int, ...]
    seconds: float  # what the exchange cost


def agree_sets(ready: Sequence[Sequence[int]], failed: Sequence[Sequence[int]]) -> tuple[tuple[int, ...],
                                                                                          tuple[int, ...]]:
    """Intersection of the ready sets minus the union of the failed sets, and that union (sorted)."""
    failed_any = set().union(*map(set, failed))
    ready_all = set(ready[0]).intersection(*map(set, ready[1:])) - failed_any
    return tuple(sorted(ready_all)), tuple(sorted(failed_any))


class CollectiveError(RuntimeError):
    """A rank process failed or the ranks disagreed."""


BACKENDS = ("gloo", "nccl")


class RankAgreement:
    """``ranks`` local processes that exchange the sets with a real ``all_gather_object`` over ``backend``.

    Use as a context manager, or call :meth:`close`; the processes end with it.
    """

    def __init__(self, ranks: int, backend: str = "gloo", timeout_s: float = 60.0) -> None:
        if ranks < 2:
            raise ValueError(f"a collective needs at least 2 ranks, got {ranks}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown collectives backend {backend!r}; known: {', '.join(BACKENDS)}")
        if backend == "nccl":
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if gpus < ranks:
                raise CollectiveError(f"collectives 'nccl' puts each of the {ranks} ranks on its own GPU; "
                                      f"this machine has {gpus} (gloo runs them on the CPU)")
        self.ranks, self.backend, self.timeout_s = ranks, backend, timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix=f"cdbench-{backend}-")
        store = Path(self._dir.name) / "store"  # the rendezvous: a file store, no port to pick
        ctx = mp.get_context("spawn")  # a fresh interpreter per rank: no forked torch state
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, ranks, backend, str(store), child), daemon=True,
                               name=f"cdbench-rank{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        for rank, conn in enumerate(self._conns):
            self._receive(rank, conn)  # each rank says it joined the group

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _receive(self, rank: int, conn: Connection):
        if not conn.poll(self.timeout_s):
            self.close()
            raise CollectiveError(f"rank {rank} did not answer within {self.timeout_s:g} s")
        message = conn.recv()
        if isinstance(message, BaseException):
            self.close()
            raise CollectiveError(f"rank {rank} failed: {message}") from message
        return message

    def agree(self, ready: Sequence[Sequence[int]], failed: Sequence[Sequence[int]]) -> Agreement:
        """Send rank ``r`` its sets ``ready[r]``, ``failed[r]``; every rank must reach the same agreement."""
        if len(ready) != self.ranks or len(failed) != self.ranks:
            raise ValueError(f"need one ready and one failed set per rank ({self.ranks})")
        for conn, mine, gave_up in zip(self._conns, ready, failed, strict=True):
            conn.send((list(mine), list(gave_up)))
        answers = [self._receive(rank, conn) for rank, conn in enumerate(self._conns)]
        views = {(a_ready, a_failed) for a_ready, a_failed, _ in answers}
        if len(views) != 1:
            raise CollectiveError(f"ranks disagree after all_gather: {sorted(views)}")
        (agreed_ready, agreed_failed), = views
        return Agreement(agreed_ready, agreed_failed, max(seconds for _, _, seconds in answers))

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()  # our own child, stuck: end it by its handle
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        self._dir.cleanup()


class PeerAgreement:
    """This process's side of the ranks' exchange, over ``group`` (a gloo group of ``ranks`` processes;
    ``None``: the default group), with :meth:`agree` shaped as :meth:`RankAgreement.agree` for one rank.

    Each exchange is timed alone (after a barrier): ``seconds`` holds the all_gathers' times,
    ``step_seconds`` the step agreements'.
    """

    def __init__(self, ranks: int, group: object = None) -> None:
        self.ranks, self.group = ranks, group
        self.seconds: list[float] = []
        self.step_seconds: list[float] = []

    def agree(self, ready: Sequence[Sequence[int]], failed: Sequence[Sequence[int]]) -> Agreement:
        """This rank's ``ready[0]`` and ``failed[0]`` against every other rank's: the agreed sets."""
        import torch.distributed as dist

        (mine,), (gave_up,) = ready, failed
        dist.barrier(group=self.group)  # the exchange's time alone, not the wait for a slower rank
        start = time.perf_counter()
        gathered: list = [None] * self.ranks
        dist.all_gather_object(gathered, (list(mine), list(gave_up)), group=self.group)
        seconds = time.perf_counter() - start
        self.seconds.append(seconds)
        agreed_ready, agreed_failed = agree_sets([g[0] for g in gathered], [g[1] for g in gathered])
        return Agreement(agreed_ready, agreed_failed, seconds)

    def agree_step(self, duration: float, token_at: float) -> tuple[float, float]:
        """The slowest rank's step ``duration`` and sampled-token time (seconds from the step's start)."""
        import torch
        import torch.distributed as dist

        start = time.perf_counter()
        values = torch.tensor([duration, token_at], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        self.step_seconds.append(time.perf_counter() - start)
        return float(values[0]), float(values[1])

    def check_same(self, state: tuple, what: str) -> None:
        """Raise :class:`CollectiveError` unless every rank holds the same ``state`` (ranks that should
        move together and do not would otherwise wait on each other's collectives for ever)."""
        import torch.distributed as dist

        gathered: list = [None] * self.ranks
        dist.all_gather_object(gathered, state, group=self.group)
        if any(other != gathered[0] for other in gathered[1:]):
            raise CollectiveError(f"the ranks diverged: {what}, by rank: {gathered}")

    def close(self) -> None:
        """Nothing to end: the group belongs to the rank process."""


def _rank_main(rank: int, ranks: int, backend: str, store: str, conn: Connection) -> None:
    """One rank: join the group, then answer each pair of sets with the agreed pair and the time taken."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # all_gather_object sends its bytes from the current GPU
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=ranks)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which names the rank
        conn.send(exc)
        return
    conn.send("joined")
    try:
        while (message := conn.recv()) is not None:
            mine, gave_up = message
            dist.barrier()  # all ranks enter the all_gather together: its time is the exchange alone
            start = time.perf_counter()
            gathered: list = [None] * ranks
            dist.all_gather_object(gathered, (mine, gave_up))
            seconds = time.perf_counter() - start
            conn.send((*agree_sets([g[0] for g in gathered], [g[1] for g in gathered]), seconds))
    except EOFError:
        pass  # the parent went away
    finally:
        dist.destroy_process_group()
