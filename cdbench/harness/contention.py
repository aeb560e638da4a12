"""Host CPU contention: compiles, mask fills and the scheduler loop sharing the engine host's cores.

The engines compile grammars on a thread pool beside the scheduler loop (and vLLM fills large batches'
masks on a second pool). When more of these threads run than the host has cores
(``SchedulerConfig.host_cpus``), the kernel shares the cores among them: each runs at cores / demand of
a core (processor sharing), so a piece of their work takes demand / cores as long (:func:`stretch`).

Which work takes a core: a thread running native code with the GIL released. xgrammar's and
llguidance's compiles and mask fills release it, so a running compile is a thread of demand
(``compile_cores`` of them: xgrammar's compiler runs up to ``max_threads`` threads of its own), and so
is each thread of a parallel fill. The engine's own Python (batch forming, the mask wrapper, result
processing) holds the GIL, so it never runs beside other Python of the process: it is the scheduler
loop's one thread, which counts once per rank whatever it runs. Since the compiles' native work does
not wait for the GIL, the stretch is the cores' alone: measured, a loop beside N compiling threads of
its process slows as much as beside N compiling processes (``reports/spec_costs/contention.md``).

The stretch is the loop's mean pace. The kernel shares cores in time slices of milliseconds, so on a
real host most short steps run untouched and a few wait a whole slice; a request's TPOT (a mean over
its steps) follows the mean, its ITL percentiles do not.

What stretches (:class:`HostCores`):

* a step's host CPU work — batch forming, serial fills and the engine's wrapper around them, the
  bitmask's transfer, result processing and the launch — by (running compiles x ``compile_cores`` +
  one loop per rank) / cores; a parallel fill's wall by (running compiles x ``compile_cores`` + the
  pool's busy threads per rank) / cores, as the loop waits on its pool meanwhile. Waits (SGLang's poll
  naps, vLLM's readiness timeouts, the all_gather) and GPU work do not stretch. The compiles counted
  are those running when the step starts;
* a compile, by the demand when it starts (the compiles then running, itself included, and the
  loops). A compile that starts later does not slow one already running: an approximation of
  processor sharing that keeps each compile's end known from its start, as the scheduler needs.

Measured against charged: ``hybrid`` and ``live`` mode compile each spec once, on the scheduler's
thread at its first arrival and off the step's clock, so no real compile ever runs beside a measured
step: the simulated host's compile pool is not in any measured time, and ``hybrid`` charges it as
``model`` mode does. ``live`` mode runs its steps for real and charges nothing.

>>> host = HostCores(cores=2)
>>> host.stretch(compiles=0), host.stretch(compiles=1), host.stretch(compiles=3)
(1.0, 1.0, 2.0)
>>> host.stretch(compiles=3, threads=2)  # a parallel fill's two threads beside three compiles
2.5
"""

from __future__ import annotations

from dataclasses import dataclass


def stretch(demand: float, cores: int) -> float:
    """How much longer CPU work takes when ``demand`` runnable threads share ``cores``: demand / cores, at least 1.

    >>> stretch(3, 2), stretch(1, 2)
    (1.5, 1.0)
    """
    return demand / cores if demand > cores else 1.0


@dataclass(frozen=True, slots=True)
class HostCores:
    """The engine host's cores and the threads that share them.

    Attributes
    ----------
    cores : the host's CPUs.
    compile_cores : cores one running compile keeps busy.
    loops : scheduler loops sharing the host, one thread each (one a rank).
    """

    cores: int
    compile_cores: float = 1.0
    loops: int = 1

    def stretch(self, compiles: int, threads: int = 1) -> float:
        """The stretch of work while ``compiles`` compiles run and each loop keeps ``threads`` threads
        busy (1: the loop itself; a parallel fill's busy pool threads while the loop waits on them)."""
        return stretch(compiles * self.compile_cores + self.loops * threads, self.cores)

    def can_exceed(self, compiles: int, threads: int = 1) -> bool:
        """Whether ``compiles`` running compiles beside loops of ``threads`` threads outnumber the cores
        (with the most each can have, whether contention can ever happen)."""
        return self.stretch(compiles, threads) > 1.0
