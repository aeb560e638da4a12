"""What a step costs in time: the overlap rules, and a parallel mask fill's makespan.

:func:`step_time` is the one place where the step's CPU and GPU parts are
combined (module docstring of :mod:`cdbench.harness.scheduler` states the
rules); :func:`parallel_makespan` prices a mask fill spread over a thread pool.
"""

from __future__ import annotations

import heapq

import numpy as np


def step_time(sync: bool, has_grammar: bool, pre: float, carry: float, forward_s: float, fill_s: float,
              copy_s: float, apply_s: float, sample_s: float, process_s: float, launch_s: float = 0.0,
              mask_beside: bool = True, after_forward_s: float = 0.0, waiting_copy_s: float = 0.0,
              loop_waits: bool = True, build_s: float = 0.0, tail_beside_next: bool = False,
              maximum=max) -> tuple[float, float, float, float, float]:
    """One step's ``(duration, after_token, exposed, hidden, carry_out)``.

    ``pre``: scheduling, polls and checks before the batch runs; ``carry``: the
    previous step's result processing paid now (overlap). Without overlap
    (``sync``) the CPU and GPU parts run in turn, except the mask fill and
    copy, which run beside the forward; with overlap the CPU chain runs
    beside the forward and this step's processing moves to the next
    (``carry_out``). ``launch_s``: the host's staging and launch of the
    forward and its wake-up on the tokens, which nothing hides (the GPU
    waits for it) in either case. ``mask_beside=False`` (without overlap):
    the fill and copy run before the forward instead of beside it. ``after_forward_s`` (without overlap):
    host work the GPU waits for between the forward and the apply (blocking per-row copies and the fills
    between them). ``waiting_copy_s``: a bitmask copy from pageable memory, which waits for the forward
    queued before it and then holds its host for the copy, the GPU idle; with overlap, ``loop_waits``
    says that host is the scheduler loop's (the engine's worker in its process): the loop cannot run
    ahead of the forward, so this step's scheduling and launch are no longer hidden (otherwise another
    process waits and only the GPU does). ``build_s``: host work on the bitmask after the forward's launch, before
    its copy (vLLM 0.10 / 0.11's model runner: the array of every copied row, -1, and the mask rows scattered in),
    beside the forward whether the fill ran before it or beside it. ``tail_beside_next`` (with overlap, where the
    loop waits on that copy): the loop returns once the copy is done, and the apply and sampling run on the GPU
    while it schedules and launches the next step, the next forward queued behind them, so they cost the step only
    what they outlast that (priced against this step's own ``launch_s + pre``: the next step's in a run of decode
    steps); its tokens come out that much after the step's end (``after_token`` below 0). ``after_token``: seconds
    of the step after its tokens are out; ``exposed``/``hidden``: CPU seconds on / off the
    critical path; ``carry_out``: the step's ``process_s`` with overlap, 0 without.
    ``maximum=np.maximum`` prices many steps at once, one a value of the arrays
    given, each as it alone gives it.

    >>> step_time(True, True, 0.001, 0.0, 0.010, 0.002, 0.0, 0.0, 0.0, 0.001)
    (0.012, 0.001, 0.002, 0.002, 0.0)
    >>> step_time(False, True, 0.001, 0.001, 0.010, 0.002, 0.0, 0.0, 0.0, 0.001)
    (0.01, 0.0, 0.0, 0.004, 0.001)
    >>> [round(t, 6) for t in step_time(True, True, 0.001, 0.0, 0.010, 0.002, 0.0, 0.0, 0.0, 0.001, mask_beside=False)]
    [0.014, 0.001, 0.004, 0.0, 0.0]
    >>> [round(t, 6) for t in step_time(False, True, 0.001, 0.001, 0.010, 0.002, 0.0, 0.0, 0.0, 0.001,
    ...                                 waiting_copy_s=0.0005)]
    [0.0115, 0.0, 0.0015, 0.003, 0.001]
    >>> [round(t, 6) for t in step_time(False, True, 0.001, 0.001, 0.010, 0.002, 0.0, 0.0005, 0.0005, 0.001, 0.0003,
    ...                                 waiting_copy_s=0.0005, build_s=0.001, tail_beside_next=True)]
    [0.0118, -0.001, 0.0018, 0.004, 0.001]
    """
    if sync:
        mask_path = fill_s + build_s + copy_s
        if mask_beside:
            gpu_part = maximum(forward_s, mask_path)
        else:  # the fill and copy before the launch; the runner's build beside the forward
            gpu_part = fill_s + copy_s + maximum(forward_s, build_s)
        after_forward_s += waiting_copy_s
        duration = launch_s + pre + carry + gpu_part + after_forward_s + apply_s + sample_s + process_s
        exposed = launch_s + pre + carry + maximum(0.0, gpu_part - forward_s) + after_forward_s + process_s
        cpu_total = launch_s + pre + carry + mask_path + after_forward_s + process_s
        return duration, process_s, exposed, cpu_total - exposed, 0.0
    if has_grammar and waiting_copy_s and loop_waits:  # the loop waits out the forward before it schedules on
        chain = carry + fill_s + build_s + copy_s
        tail = apply_s + sample_s
        after_token = 0.0
        if tail_beside_next:  # the GPU's apply and sampling under the next step's scheduling and launch
            room = launch_s + pre
            after_token = maximum(tail, room) - tail - room  # (minus the smaller: maximum serves arrays too)
            tail = tail + after_token
        duration = launch_s + pre + maximum(forward_s, chain) + waiting_copy_s + tail
        exposed = maximum(0.0, chain - forward_s)
        return duration, after_token, launch_s + pre + exposed + waiting_copy_s, chain - exposed, process_s
    if has_grammar:  # sampling waits for this step's mask
        chain = pre + carry + fill_s + build_s + copy_s
        duration = launch_s + maximum(forward_s, chain) + waiting_copy_s + apply_s + sample_s
        exposed = maximum(0.0, chain - forward_s)
        return duration, 0.0, launch_s + exposed + waiting_copy_s, chain - exposed, process_s
    chain = pre + carry
    duration = launch_s + maximum(forward_s + sample_s, chain)
    exposed = maximum(0.0, chain - forward_s)
    return duration, 0.0, launch_s + exposed, chain - exposed, process_s


def parallel_makespan(per_request_s: np.ndarray, chunk: int, threads: int) -> float:
    """Wall time to fill masks in chunks of ``chunk`` requests on ``threads`` threads (FIFO).

    >>> parallel_makespan(np.full(64, 1.0), chunk=16, threads=2)
    32.0
    """
    n = len(per_request_s)
    starts = np.arange(0, n, chunk)
    tasks = np.add.reduceat(per_request_s, starts) if n else np.zeros(0)
    free = [0.0] * min(threads, max(1, len(tasks)))
    for task in tasks.tolist():  # Python floats: cheaper heap arithmetic than numpy scalars
        heapq.heapreplace(free, free[0] + task)
    return float(max(free))
