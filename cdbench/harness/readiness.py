"""Grammar readiness, priced: SGLang's blocking poll, vLLM's per-request check, and idle strides.

The first phase of the scheduler's iteration (:mod:`cdbench.harness.scheduler`) asks which queued
grammars are ready. SGLang polls its grammar queue (:func:`blocking_poll`): each rank checks every
``interval/naps`` whether a compile is done, leaves early when all are, and gives up on a request
after ``max_poll_iterations`` polls that did not see it; the ranks then agree (an all_gather). vLLM
checks a waiting request when admission reaches it (:func:`check`), waiting up to
``check_timeout_s`` for its compile. While nothing can change, an idle loop repeats the same poll
or checks; :func:`idle_repeats` says how many such iterations follow, so that they are taken in one
stride.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cdbench.harness.policies import SchedulerConfig


def blocking_poll(done_at: np.ndarray, t0: float, cfg: SchedulerConfig) -> tuple[float, np.ndarray]:
    """SGLang's blocking poll at ``t0`` of grammars whose compiles end at ``done_at`` (requests x
    ranks): the poll's seconds (its slowest rank's) and which compiles each rank saw done.

    >>> from cdbench.harness.policies import policy
    >>> cfg = policy("sglang", poll_interval_s=0.004, poll_naps=4)
    >>> blocking_poll(np.array([[0.0015], [0.0025]]), 0.0, cfg)  # both seen by the third check
    (0.003, array([[ True],
           [ True]]))
    """
    nap = cfg.poll_interval_s / cfg.poll_naps
    first_seen = first_checks(done_at, t0, cfg)
    seen = first_seen <= cfg.poll_naps - 1
    if cfg.poll_early_exit:
        all_seen = seen.all(axis=0)
        exit_check = np.where(seen, first_seen, 0.0).max(axis=0)
        per_rank = np.where(all_seen, exit_check * nap, cfg.poll_interval_s)
    else:
        per_rank = np.full(cfg.ranks, cfg.poll_interval_s)
    return float(per_rank.max()), seen


def first_checks(done_at: np.ndarray, t0: float | np.ndarray, cfg: SchedulerConfig) -> np.ndarray:
    """The index of the first readiness check of a poll from ``t0`` (one every ``poll_interval_s / poll_naps``)
    that sees each compile ending at ``done_at`` done (0 for one done before the poll; ``t0`` may be an array of
    polls, broadcast against ``done_at``)."""
    with np.errstate(invalid="ignore"):
        return np.maximum(np.ceil((done_at - t0) / (cfg.poll_interval_s / cfg.poll_naps) - 1e-9), 0.0)


def blocking_poll_one_rank(done_at: Sequence[float], t0: float, cfg: SchedulerConfig) -> tuple[float, list[bool]]:
    """:func:`blocking_poll` of one rank's few compiles (ends ``done_at``) in Python floats: the same
    values bit for bit (a poll of a queue of one or two costs mostly numpy's calls).

    >>> from cdbench.harness.policies import policy
    >>> cfg = policy("sglang", poll_interval_s=0.004, poll_naps=4)
    >>> blocking_poll_one_rank([0.0015, 0.0025], 0.0, cfg)
    (0.003, [True, True])
    """
    nap = cfg.poll_interval_s / cfg.poll_naps
    last = cfg.poll_naps - 1
    seen, exit_check = [], None
    for done in done_at:
        x = (done - t0) / nap - 1e-9
        # numpy's ceil, then its maximum with 0.0 (which gives 0.0, not the ceil's -0.0, for x in (-1, 0])
        first = (float(math.ceil(x)) if x < math.inf else x) if x > 0.0 else 0.0
        was_seen = first <= last
        seen.append(was_seen)
        value = first if was_seen else 0.0
        if exit_check is None or value > exit_check:
            exit_check = value
    if not cfg.poll_early_exit or not all(seen):
        return cfg.poll_interval_s, seen
    return exit_check * nap, seen


def check(ready_at: float, t: float, timeout_s: float) -> tuple[bool, float]:
    """vLLM's readiness check at ``t`` of a grammar ready at ``ready_at``: (ready, seconds it cost).

    >>> check(1.0, 2.0, 0.5), check(2.25, 2.0, 0.5), check(3.0, 2.0, 0.5)
    ((True, 0.0), (True, 0.25), (False, 0.5))
    """
    if ready_at <= t:
        return True, 0.0
    if ready_at <= t + timeout_s:
        return True, ready_at - t
    return False, timeout_s


def idle_repeats(cfg: SchedulerConfig, t_next: float, poll_s: float, check_s: float, queued: Sequence[int],
                 waiting: Sequence[int], grammar_ready_s: np.ndarray, done_at: np.ndarray, wait_ct: np.ndarray,
                 next_event: float, stretch: float, stretch_until: float, real_agreement: bool) -> int:
    """How many identical idle iterations follow one that ends at ``t_next`` (0 when unsure).

    ``poll_s``/``check_s``: that iteration's poll and checks; ``queued``: the grammar queue;
    ``waiting``: the waiting queue; ``grammar_ready_s``: when each request's grammar was taken;
    ``done_at``/``wait_ct``: each request's compile ends and unseen polls per rank (a stride's
    polls are counted into ``wait_ct`` here); ``next_event``: the event queue's next time;
    ``stretch``/``stretch_until``: the loop's CPU stretch and when it may change; ``real_agreement``:
    every poll runs its own real all_gather among rank processes.
    """
    full_poll = queued and cfg.readiness == "blocking_poll" and poll_s == cfg.poll_interval_s
    if full_poll and real_agreement:
        return 0  # every poll runs its own real all_gather
    unready = [rid for rid in waiting if math.isnan(grammar_ready_s[rid])]
    if not full_poll and not (check_s > 0 and len(unready) == len(waiting)):
        return 0
    if cfg.readiness == "blocking_poll" and waiting:
        return 0
    schedule_s = cfg.schedule_s * stretch
    step = max(schedule_s + poll_s + (cfg.all_gather_s if cfg.ranks > 1 and full_poll else 0.0) + check_s,
               cfg.idle_spin_s)
    pending = np.array(list(queued) + unready, np.int64)
    done = done_at[pending]
    change = min(next_event, float(done.max(axis=1).min()))
    change = min(change, stretch_until)
    if full_poll and cfg.poll_early_exit:
        change = min(change, float(done.max(axis=0).min()))
    repeats = int((change - t_next) // step) - 1
    if repeats <= 0:
        return 0
    if full_poll:
        at = np.array(queued, np.int64)
        if cfg.max_poll_iterations is not None:
            repeats = min(repeats, cfg.max_poll_iterations - 1 - int(wait_ct[at].max()))
            if repeats <= 0:
                return 0
        # poll j (1..repeats) starts at t_next + (j-1)·step; its last check sees compiles done by then
        last_check = t_next + schedule_s + (cfg.poll_naps - 1) * cfg.poll_interval_s / cfg.poll_naps
        seen_at = np.ceil((done_at[at] - last_check) / step - 1e-9) + 1
        wait_ct[at] += np.clip(seen_at - 1, 0, repeats).astype(np.int64)
    return repeats

