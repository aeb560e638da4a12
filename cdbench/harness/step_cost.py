"""A step's time: its CPU and GPU parts priced by the cost models, or measured by a live step.

The fourth phase of the scheduler's iteration (:mod:`cdbench.harness.scheduler`, whose docstring
states the rules). Given the rows a step runs (:class:`~cdbench.harness.admission.StepPlan`) and the
grammar's work on them (:class:`~cdbench.harness.executors.base.StepWork`), :class:`StepPricer`
prices the mask building (the fills, or a parallel fill's wall time, under tensor-parallel ranks the
slowest of the ranks' fills (``rank_fill_ratios``, or ``rank_fill_jitter``); token filters of thinking
rows; the engine's wrapper around the fills and its mask allocation), the bitmask's transfer to another
process, the engine's result processing and the launch, each stretched by host contention; the
GPU's forward (a decode step at the next captured graph size), mask copy (of the mask rows, or of every
sampled row: ``mask_copy_rows``), apply and sampling; and
combines them by the overlap rules (:func:`~cdbench.harness.step_time.step_time`). A ``live`` step
(:mod:`cdbench.harness.live.step`) measures the GPU parts and the whole step instead, and the
launch is what its wall time holds beyond the parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from cdbench.harness.admission import StepPlan
from cdbench.harness.contention import HostCores
from cdbench.harness.costs.gpu import GpuCosts
from cdbench.harness.executors.base import Settlement, StepWork
from cdbench.harness.policies import SchedulerConfig, padded_decode
from cdbench.harness.step_time import step_time

if TYPE_CHECKING:
    from cdbench.harness.live.step import LiveStep

_sum = np.add.reduce  # (the cheapest sum on small arrays: see scheduler.py)
_PARTS = 1 << 12  # decode steps' parts remembered (_decode_parts)
_PART_TABLES = 64  # and tables of them remembered, one a stretch (_part_table: at most about 300 kB each)
_TABLE_ROWS = 64  # runs of fewer rows take their parts from those tables


class StepCost(NamedTuple):
    """One step's time and its parts, in seconds (the step log's columns of the same names); a
    tuple, cheap to build once a step.

    ``after_token``: of the step, the time after its tokens are out; ``exposed``/``hidden``: CPU
    time on / off the critical path; ``carry_out``: result processing paid in the next iteration
    (overlap). ``grammar_rows``/``mask_rows``: rows that built masks, and mask rows in all
    (drafts' and token filters' included); ``dec_tokens``/``kv``: the forward's decode tokens and
    their context.
    """

    duration: float
    after_token: float
    exposed: float
    hidden: float
    carry_out: float
    forward_s: float
    fill_s: float
    copy_s: float
    apply_s: float
    sample_s: float
    process_s: float
    transfer_s: float
    launch_s: float
    grammar_rows: int
    mask_rows: int
    dec_tokens: int
    kv: int


# the measured steps a priced step's rank fill ratio is drawn among: the nearest in rank 0's fill (8: each of
# three TP=2 live copies' records priced from another's, reports/fidelity/live_vs_model.md, "Under capacity
# with 150 requests")
FILL_NEIGHBOURS = 8


class StepPricer:
    """Prices steps under ``cfg`` on ``gpu``; ``host``: the host's cores where contention can
    happen (``None``: never); ``settle``: the grammar's work deferred past a live step's sampling;
    ``seed``: the draws of the tensor-parallel ranks' fill spread (``rank_fill_jitter``)."""

    def __init__(self, cfg: SchedulerConfig, gpu: GpuCosts, host: HostCores | None,
                 settle: Callable[[], Settlement | None], seed: int = 0) -> None:
        self.cfg, self.gpu, self.host, self.settle = cfg, gpu, host, settle
        # each tp rank fills its own masks and the step waits for the slowest (live mode measures it)
        tp = cfg.ranks > 1 and cfg.parallel == "tp"
        ratios = cfg.rank_fill_ratios if tp else None
        self.fill_table = (np.log([f for f, _ in ratios]), np.array([r for _, r in ratios])) if ratios else None
        waits = tp and not ratios and (cfg.rank_fill_jitter > 0 or cfg.rank_fill_offset != 0)
        self.fill_spread = (cfg.rank_fill_offset, cfg.rank_fill_jitter) if waits else None
        self.fill_waits = self.fill_table is not None or self.fill_spread is not None
        self.rng_ranks = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(2,)))
        self.mtp = cfg.spec_drafter == "mtp"  # the model's MTP head drafts: its passes join the forward
        self.row_bytes = gpu.mask_row_bytes  # the engines' per-byte host costs (mask allocation, IPC)
        self.per_row = cfg.mask_apply == "per_row"
        self.batch_copy = cfg.mask_copy_rows == "batch"  # the copied bitmask holds every sampled row
        self.sample_prep = cfg.sampler_host  # (V0's sampler: the presets' others 0)
        # its CPU work and, on a GPU, its calls that launch GPU work, both up to its sync: per step and sampled row
        self.prep_step_s = cfg.sample_prep_s + cfg.sample_launch_s
        self.prep_row_s = cfg.sample_prep_row_s + cfg.sample_launch_row_s
        self._parts: dict[tuple[int, int, float], tuple[float, ...]] = {}  # _decode_parts, remembered
        self._part_tables: dict[float, np.ndarray] = {}  # _part_table, by stretch
        self._sizes: list[int] = []  # _padded_sizes
        self._pads = np.zeros(0, np.int64)

    def _measured_fill_ratio(self, fill_s: float) -> float:
        """The slowest rank's fill over rank 0's in one of the measured steps (``rank_fill_ratios``) whose rank-0
        fill is nearest ``fill_s`` (in log), drawn uniformly among the nearest :data:`FILL_NEIGHBOURS`."""
        log_own, ratio = self.fill_table
        k = min(FILL_NEIGHBOURS, len(log_own))
        log_fill = np.log(fill_s)
        at = int(np.searchsorted(log_own, log_fill))
        low, high = max(at - k, 0), min(at + k, len(log_own))
        nearest = low + np.argsort(np.abs(log_own[low:high] - log_fill), kind="stable")[:k]
        return float(ratio[nearest[int(self.rng_ranks.integers(k))]])
    def price(self, plan: StepPlan, work: StepWork, cached: np.ndarray, n_filter: int, sync: bool,
              has_grammar: bool, carry: float, stretch: float, compiles: int, live: LiveStep | None) -> StepCost:
        """The time of the step ``plan`` runs, given the grammar's ``work`` on it, the batch's
        ``cached`` context per row, its ``n_filter`` token-filtered rows, whether it runs without
        overlap (``sync``) and any row waits for a mask (``has_grammar``), the previous step's
        processing ``carry``, and the loop's ``stretch`` with ``compiles`` compiles running."""
        cfg = self.cfg
        n_sample = len(plan.s_rid)
        # --- mask building (CPU)
        row_fill, row_masks = work.fill_s, work.mask_rows
        grammar_rows = len(row_fill)
        mask_rows = n_filter
        fill_s = 0.0
        if grammar_rows:  # (the executor times or prices a parallel fill: its pool's wall time)
            if work.fill_wall_s is None:
                fill_s = float(_sum(row_fill)) * stretch
            elif self.host is not None:  # the loop waits on the pool, whose busy threads share the cores
                tasks = -(-grammar_rows // cfg.fill_chunk)
                fill_s = work.fill_wall_s * self.host.stretch(compiles, min(cfg.fill_threads, tasks))
            else:
                fill_s = work.fill_wall_s
            mask_rows += int(_sum(row_masks))
            if self.fill_table is not None and live is None:  # the slowest rank's, as in measured steps like it
                fill_s *= self._measured_fill_ratio(fill_s)
            elif self.fill_spread and live is None:  # the slowest rank's fill, priced against rank 0's
                others = self.rng_ranks.lognormal(*self.fill_spread, cfg.ranks - 1).max()
                fill_s *= max(1.0, float(others))
        host_fill_s, transfer_s, engine_process_s = self._host(n_filter, grammar_rows, mask_rows, n_sample, stretch)
        fill_s += host_fill_s

        # --- GPU
        n_drafts = plan.n_drafts
        if work.drafted is not None:
            # the batch reserved k tokens per decode row; the forward verifies the drafts actually
            # proposed (hybrid: fewer near an oracle's end, none for a random walk)
            n_drafts = int(_sum(work.drafted))
        n_dec = len(plan.dec_rows)
        dec_tokens = n_dec + n_drafts
        if plan.everyone:
            kv = int(_sum(cached))
        else:
            kv = int(_sum(cached[plan.dec_sel])) if n_dec else 0
        pf_tokens = plan.pf_tokens
        sample_rows = n_sample + n_drafts
        if live is not None:
            return self._measured(live, work, sync, has_grammar, plan.pre, carry, fill_s, host_fill_s, transfer_s,
                                  grammar_rows, mask_rows, sample_rows, engine_process_s, dec_tokens, kv)
        fw_tokens, fw_kv = dec_tokens, kv
        if dec_tokens and not pf_tokens:  # a decode step replays the graph of the next captured size
            fw_tokens, fw_kv = padded_decode(cfg.cuda_graph_sizes, dec_tokens, kv)
        pf_chunks = plan.pf_chunks
        forward_s = self.gpu.forward_s(pf_chunks, cached[plan.pf_sel] if pf_tokens else pf_chunks, fw_tokens, fw_kv)
        if self.mtp and n_drafts:  # the head drafts the next step's k tokens for each decoding row
            forward_s += self.gpu.draft_s(n_dec, cfg.spec_tokens, kv)
        copied = sample_rows if self.batch_copy else mask_rows
        copy_s = self.gpu.copy_s(copied, cfg.pinned_mask) if mask_rows else 0.0
        build_s = self._build(copied, mask_rows, stretch) if mask_rows else 0.0
        apply_s = self.gpu.apply_s(mask_rows) if mask_rows else 0.0
        sample_s = self.gpu.sample_s(sample_rows)
        process_s = work.process_s * stretch + engine_process_s
        launch_s = self._launch(pf_tokens, n_sample, stretch)
        prep_s = (self.prep_step_s + self.prep_row_s * n_sample) * stretch if self.sample_prep else 0.0
        if self.per_row and mask_rows:
            return self._per_row(plan.pre, carry, forward_s, fill_s, host_fill_s, row_fill, stretch, transfer_s,
                                 sample_s, process_s, launch_s, prep_s, grammar_rows, mask_rows, dec_tokens, kv)
        waiting_copy_s = 0.0 if cfg.pinned_mask else copy_s  # from pageable memory: the GPU copies after the forward
        holds = bool(mask_rows) and self._copy_holds_host(copied)  # ... and its host waits for that
        # the sampler's host work follows the mask's copy: beside the forward, or after it when the copy waited
        prep_after = prep_s if holds else 0.0
        duration, after_token, exposed, hidden, carry_out = step_time(
            sync, has_grammar, plan.pre, carry, forward_s, fill_s + prep_s - prep_after,
            copy_s - waiting_copy_s + transfer_s, apply_s, sample_s, process_s, launch_s, cfg.fill_beside_forward,
            after_forward_s=prep_after, waiting_copy_s=waiting_copy_s,
            loop_waits=holds and cfg.mask_transfer == "none", build_s=build_s,
            tail_beside_next=cfg.sample_beside_schedule)
        return StepCost(duration, after_token, exposed, hidden, carry_out, forward_s, fill_s + build_s, copy_s, apply_s,
                        sample_s, process_s, transfer_s, launch_s, grammar_rows, mask_rows, dec_tokens, kv)

    def price_decode_run(self, rows: int | np.ndarray, grammar_rows: int | np.ndarray, lengths: Sequence[int],
                         pre: np.ndarray, carry: float, fill_s: np.ndarray | None, process_s: np.ndarray,
                         kv: np.ndarray, sync: bool, has_grammar: bool, stretch: float) -> StepCost:
        """:meth:`price` of a run of decode steps at once: each field an array, one value a step, or one value
        for every step. The steps are segments of ``lengths[i]`` steps, each of the same rows: ``rows`` of them
        (one value for every step, or one a step), ``grammar_rows`` of them building a mask (one mask row
        each). Given, per step, the loop's time before it ``pre``, the grammar rows' fill seconds summed
        ``fill_s`` (``None``: no grammar row), their processing ``process_s`` and the rows' context ``kv``;
        ``carry``: the processing carried into the first step. Every row samples one token a step: no drafts,
        prefill, thinking rows, live step, per-row apply or ranks' fill spread; more than one segment only with
        the bitmask in pinned memory (no copy waits for the forward)."""
        cfg, gpu = self.cfg, self.gpu
        if len(lengths) == 1:
            host_fill_s, transfer_s, engine_process_s, copy_s, apply_s, sample_s, launch_s, prep_s, build_s = \
                self._decode_parts(rows, grammar_rows, stretch)
            fw_tokens, fw_kv = padded_decode(cfg.cuda_graph_sizes, rows, kv)
            forward_s = gpu.decode_forward_s(fw_tokens, fw_kv)
        else:
            if not cfg.pinned_mask:
                raise ValueError("decode steps of rows leaving between them are priced at once only with the "
                                 "bitmask in pinned memory")
            step_rows = rows.tolist()
            most = step_rows[0]  # (the rows only leave: the first step has the most)
            sizes, pads = self._padded_sizes(most)
            spans: list[list[int]] = []  # [priced rows, first step, end] of consecutive segments of as many
            starts, at = [], 0
            for length in lengths:
                starts.append(at)
                size = sizes[step_rows[at]]
                if spans and spans[-1][0] == size:
                    spans[-1][2] = at + length
                else:
                    spans.append([size, at, at + length])
                at += length
            # each step's forward as padded_decode prices it, together for the steps of one priced size in a row
            # (the rows only leave: a size's segments follow one another)
            fw_kv = kv + pads[rows]
            if len(spans) == 1:
                forward_s = gpu.decode_forward_s(spans[0][0], fw_kv)
            else:
                forward_s = np.empty(len(kv))
                for size, a, b in spans:
                    forward_s[a:b] = gpu.decode_forward_s(size, fw_kv[a:b])
            if most < _TABLE_ROWS:  # each step's segment's parts
                parts = self._part_table(most, stretch)[:, rows, grammar_rows]
            else:  # (a table of more rows would take more memory than the steps save)
                parts = np.array([self._decode_parts(step_rows[a], int(grammar_rows[a]), stretch)
                                  for a in starts]).repeat(lengths, axis=0).T
            host_fill_s, transfer_s, engine_process_s, copy_s, apply_s, sample_s, launch_s, prep_s, build_s = parts
        fill = fill_s * stretch if fill_s is not None else np.zeros(len(kv))
        fill += host_fill_s
        process = process_s * stretch + engine_process_s
        waiting_copy_s = 0.0 if cfg.pinned_mask else copy_s
        # (a pageable copy: one segment, so one count of rows for every step)
        holds = not cfg.pinned_mask and bool(grammar_rows) and self._copy_holds_host(
            int(rows if self.batch_copy else grammar_rows))
        host_path, prep_after = fill, 0.0  # the host's work beside the forward, and after it
        if self.sample_prep:  # (as price's)
            prep_after = prep_s if holds else 0.0
            host_path = fill + (prep_s - prep_after)
        # each step carries the one before's processing in (step_time's carry_out: none without overlap)
        carried = np.empty(len(fill))
        carried[0] = carry
        carried[1:] = 0.0 if sync else process[:-1]
        duration, after_token, exposed, hidden, carry_out = step_time(
            sync, has_grammar, pre, carried, forward_s, host_path, copy_s - waiting_copy_s + transfer_s, apply_s,
            sample_s, process, launch_s, cfg.fill_beside_forward, after_forward_s=prep_after,
            waiting_copy_s=waiting_copy_s, loop_waits=holds and cfg.mask_transfer == "none", build_s=build_s,
            tail_beside_next=cfg.sample_beside_schedule, maximum=np.maximum)
        return StepCost(duration, after_token, exposed, hidden, carry_out, forward_s, fill + build_s, copy_s, apply_s,
                        sample_s, process, transfer_s, launch_s, grammar_rows, grammar_rows, rows, kv)

    def _decode_parts(self, n_rows: int, mask_rows: int, stretch: float) -> tuple[float, ...]:
        """A decode step's parts that depend on its ``n_rows`` rows and ``mask_rows`` grammar rows (one mask row
        each): the host's fill wrapper, transfer and processing, the mask's copy and apply, the sampling,
        the launch, the sampler's host work and the model runner's bitmask build (remembered: a run asks for the
        same few again and again)."""
        key = (n_rows, mask_rows, stretch)
        parts = self._parts.get(key)
        if parts is None:
            cfg, gpu = self.cfg, self.gpu
            host_fill_s, transfer_s, engine_process_s = self._host(0, mask_rows, mask_rows, n_rows, stretch)
            copied = n_rows if self.batch_copy else mask_rows
            copy_s = gpu.copy_s(copied, cfg.pinned_mask) if mask_rows else 0.0
            build_s = self._build(copied, mask_rows, stretch) if mask_rows else 0.0
            apply_s = gpu.apply_s(mask_rows) if mask_rows else 0.0
            prep_s = (self.prep_step_s + self.prep_row_s * n_rows) * stretch if self.sample_prep else 0.0
            if len(self._parts) >= _PARTS:  # (bounded: a long run under contention meets many stretches)
                self._parts.clear()
            parts = self._parts[key] = (host_fill_s, transfer_s, engine_process_s, copy_s, apply_s,
                                        gpu.sample_s(n_rows), self._launch(0, n_rows, stretch), prep_s, build_s)
        return parts

    def _part_table(self, rows: int, stretch: float) -> np.ndarray:
        """:meth:`_decode_parts` of every count of rows up to at least ``rows`` (fewer than :data:`_TABLE_ROWS`) and
        of grammar rows up to those, as one array ``[part, rows, grammar rows]`` (remembered by stretch, grown for a
        run of more rows): a decode run's steps of several segments gather their parts at once, not a segment at a
        time."""
        table = self._part_tables.get(stretch)
        if table is None or table.shape[1] <= rows:
            size = min(max(rows + 1, 2 * table.shape[1] if table is not None else 8), _TABLE_ROWS)
            table = np.zeros((len(self._decode_parts(1, 0, stretch)), size, size))
            for n in range(1, size):  # (a step has rows)
                for g in range(n + 1):
                    table[:, n, g] = self._decode_parts(n, g, stretch)
            if len(self._part_tables) >= _PART_TABLES:  # (bounded, as _decode_parts' memo)
                self._part_tables.clear()
            self._part_tables[stretch] = table
        return table

    def _padded_sizes(self, rows: int) -> tuple[list[int], np.ndarray]:
        """:func:`~cdbench.harness.policies.padded_decode` of decode steps of every count of rows up to at least
        ``rows``: the rows priced, and the padding's context tokens (an array to gather from)."""
        if len(self._sizes) <= rows:
            count = max(rows + 1, 2 * len(self._sizes))
            padded = [padded_decode(self.cfg.cuda_graph_sizes, n, 0) for n in range(count)]
            self._sizes = [size for size, _ in padded]
            self._pads = np.array([pad for _, pad in padded], np.int64)
        return self._sizes, self._pads

    def _copy_holds_host(self, copied_rows: int) -> bool:
        """Whether a bitmask copy of ``copied_rows`` rows holds its host until the forward is done: from pageable
        memory and larger than what the driver stages at once (``pageable_staged_bytes``)."""
        cfg = self.cfg
        if cfg.pinned_mask:
            return False
        return cfg.pageable_staged_bytes is None or copied_rows * self.row_bytes > cfg.pageable_staged_bytes

    def _build(self, copied_rows: int, mask_rows: int, stretch: float) -> float:
        """The model runner's host work on the bitmask after the forward's launch (stretched): the array of the
        ``copied_rows`` it sends, filled, and the ``mask_rows`` scattered into it."""
        cfg = self.cfg
        return (cfg.mask_build_byte_s * copied_rows + cfg.mask_scatter_byte_s * mask_rows) * self.row_bytes * stretch

    def _host(self, n_filter: int, grammar_rows: int, mask_rows: int, n_sample: int,
              stretch: float) -> tuple[float, float, float]:
        """The engine's host work around the grammar: its wrapper around the fills and the token filters, the
        bitmask's transfer to another process, and its result processing (stretched)."""
        cfg = self.cfg
        host_fill_s = n_filter * cfg.think_filter_s
        if mask_rows:  # the engine's own wrapper around the fills: Python under the GIL, so serial even with a pool
            host_fill_s += cfg.fill_step_s + cfg.fill_row_s * grammar_rows + cfg.mask_alloc_byte_s * self.row_bytes * n_sample
        host_fill_s *= stretch
        # a bitmask built in another process than the sampler's travels serialized, on the mask path
        transfer_s = (cfg.ipc_s + cfg.ipc_byte_s * self.row_bytes * mask_rows) * stretch \
            if mask_rows and cfg.mask_transfer == "ipc" else 0.0
        engine_process_s = (cfg.process_step_s + cfg.process_row_s * n_sample + cfg.accept_row_s * grammar_rows) * stretch
        return host_fill_s, transfer_s, engine_process_s

    def _launch(self, pf_tokens: int, n_sample: int, stretch: float) -> float:
        """The host's launch of the step (stretched)."""
        cfg = self.cfg
        return ((cfg.launch_s if not pf_tokens or cfg.launch_prefill_s is None else cfg.launch_prefill_s)
                + cfg.launch_row_s * n_sample) * stretch

    def _per_row(self, pre: float, carry: float, forward_s: float, fill_s: float, host_fill_s: float,
                 row_fill: np.ndarray, stretch: float, transfer_s: float, sample_s: float, process_s: float,
                 launch_s: float, prep_s: float, grammar_rows: int, mask_rows: int, dec_tokens: int,
                 kv: int) -> StepCost:
        """A step of V0's per-sequence logits processors (``mask_apply="per_row"``, no overlap): after the
        forward's launch the host fills each row and queues its one-row copy and apply kernel. A
        non-blocking copy (``pinned_mask``) leaves every fill beside the forward and the rows' copies and
        applies in turn on the GPU after it. A blocking copy waits for the GPU's queue: the first row's
        fill runs beside the forward, then each row's copy (its host clock, the GPU idle), and the
        following rows' fills between them; each row's apply runs on the GPU while the host fills the
        next row, so only the last one's is exposed. The engine's wrapper per row (``fill_row_s``: V0's
        logits-processor loop and processor call around the grammar) runs with its row, so after a
        blocking copy only the first row's is beside the forward; each row's launches after its copy
        (``row_launch_s``: the apply kernel's, the row's write-back's) follow that copy, so after a blocking one
        all of them are after the forward. The sampler's host work up to its GPU sync (``prep_s``, its launches
        included) follows the last row: beside the forward after non-blocking copies, after it (the GPU idle)
        after blocking ones; the sampling kernels' GPU time is priced after it, not under its launches."""
        one_apply = self.gpu.apply_s(1)
        launches = mask_rows * self.cfg.row_launch_s * stretch
        if self.cfg.pinned_mask:  # queued behind the forward on its stream: the GPU runs them after it
            copy_s = mask_rows * self.gpu.copy_s(1, True)
            apply_s = mask_rows * one_apply
            beside, after, gpu_after = fill_s + transfer_s + launches + prep_s, 0.0, copy_s + apply_s
        else:
            copy_s = mask_rows * self.gpu.copy_s(1, False)
            apply_s = one_apply
            later_wrappers = self.cfg.fill_row_s * max(grammar_rows - 1, 0) * stretch  # (with their rows, after)
            first = (float(row_fill[0]) * stretch if grammar_rows else 0.0) + host_fill_s - later_wrappers
            beside, after, gpu_after = first, fill_s - first + copy_s + transfer_s + launches + prep_s, apply_s
        duration, after_token, exposed, hidden, carry_out = step_time(
            True, True, pre, carry, forward_s, beside, 0.0, gpu_after, sample_s, process_s, launch_s,
            after_forward_s=after)
        return StepCost(duration, after_token, exposed, hidden, carry_out, forward_s, fill_s, copy_s, apply_s,
                        sample_s, process_s, transfer_s, launch_s, grammar_rows, mask_rows, dec_tokens, kv)

    def _measured(self, live: LiveStep, work: StepWork, sync: bool, has_grammar: bool, pre: float, carry: float,
                  fill_s: float, host_fill_s: float, transfer_s: float, grammar_rows: int, mask_rows: int,
                  sample_rows: int, engine_process_s: float, dec_tokens: int, kv: int) -> StepCost:
        """Finish a live step: the measured duration and parts, the grammar's deferred accepts merged
        into ``work``, and the CPU split by the overlap rules; the launch is the measured duration
        beyond what those rules make of the measured parts."""
        settled: list[Settlement | None] = []
        times = live.end(mask_rows, sample_rows, host_fill_s + transfer_s, sync,
                         after_sample=lambda: settled.append(self.settle()), after_s=engine_process_s)
        if settled and settled[0] is not None:
            work.process_s += settled[0].process_s
            if settled[0].rejected is not None:
                work.rejected = settled[0].rejected if work.rejected is None else work.rejected | settled[0].rejected
        process_s = work.process_s + engine_process_s
        parts, _, exposed, hidden, _ = step_time(sync, has_grammar, pre, carry, times.forward_s, fill_s,
                                                 times.copy_s + transfer_s, times.apply_s, times.sample_s, process_s)
        launch_s = times.duration - parts
        # with overlap the grammar's accepts ran beside this forward; the engine's processing is paid next step
        carry_out = 0.0 if sync else engine_process_s
        return StepCost(times.duration, times.after_token_s, exposed + launch_s, hidden, carry_out, times.forward_s,
                        fill_s, times.copy_s, times.apply_s, times.sample_s, process_s, transfer_s, launch_s,
                        grammar_rows, mask_rows, dec_tokens, kv)
