"""``live`` mode: each scheduler step executed for real on this machine and timed by the wall clock.

The scheduler loop is the one every mode runs; in ``live`` mode it hands each
step to a :class:`LiveStep`, which does the step's work in the order an
engine does it and measures how long that took:

1. (without overlap) the scheduler's own host work before the batch runs —
   scheduling, grammar polls, the all_gather — as a busy wait of its
   modelled length, on the thread that launches the GPU work (it holds that
   thread in the engines too);
2. the forward is launched as a CUDA-graph replay: a decode-only batch
   replays a graph captured once per padded token count (the policy's
   ``cuda_graph_sizes``, as the engines capture them); a step with prefill
   chunks replays a graph captured for its own shape just before (capture is
   off the clock). The engines launch prefill far faster than this forward's
   eager Python (fused kernels; vLLM's piecewise graphs), so an eager step
   here would time cdbench's launch pace rather than the GPU's work;
3. while the GPU runs it, the CPU does the step's mask work: (with overlap)
   the host work of step 1 and the previous step's result processing, then
   the real grammar backend's fills (the executor's ``step``), then the
   engine's own wrapper around them;
4. the bitmask's host-to-device copy (pinned, asynchronous), the project's
   apply kernel and its masked sampler, queued behind the forward on the
   same stream; the host waits for the sampled tokens;
5. (without overlap) the grammar accepts the sampled tokens (the executor's
   ``settle``) and the engine processes the results, after sampling.

The step's duration is the wall time from 1 to 5. The virtual clock of the
run advances by it, so arrivals, compile completions and every metric are in
the same time as the other modes, and the scheduler's own Python between
steps (cdbench's bookkeeping, not the engine's) is not counted.

The forward is :class:`~cdbench.harness.live.forward.LiveForward`: random bf16
weights of the configured model's architecture and a paged KV cache
(:mod:`.paged`) sized as an engine sizes it, blocks of the policy's
``kv_block_size``: a request takes a row of the block table when it first
runs and a block whenever its context grows past its last one, and gives them
back once it has left the running batch (finished, aborted, preempted or
retracted); each decode row attends to exactly its own cached length (the
decode attention reads a length and the block table from device tensors, so a
captured graph serves every length). Drafts of speculative decoding are
verified as extra query tokens of their row.

On a CPU device (tests, at tiny shapes) the same calls run synchronously and
the wall clock times each part.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from cdbench.harness.costs.hardware import ModelSpec
from cdbench.harness.live.forward import (
    DecodeInputs,
    LiveForward,
    PrefillChunk,
    StepGraph,
    TensorParallel,
)
from cdbench.harness.live.paged import (
    BLOCK_SIZE,
    KVCache,
    KVCapacityError,
    KVPool,
    PagedRequests,
)
from cdbench.harness.policies import graph_size

if TYPE_CHECKING:
    from cdbench.harness.live.rank_info import RanksInfo
from cdbench.kernels import apply_bitmask, masked_argmax

KV_MEMORY_SHARE = 0.85  # of the GPU memory left after the weights, for the KV cache (the rest: activations, graphs)


def _nothing() -> None:
    """A step with nothing to stage."""


def spin(seconds: float) -> None:
    """Hold this thread busy for ``seconds``: modelled host work, done where the engine does it."""
    if seconds <= 0.0:
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@dataclass(slots=True)
class LiveShape:
    """The GPU work of one step: decode rows (cached length, drafts verified) and prefill chunks."""

    decode_len: np.ndarray
    decode_drafts: np.ndarray
    prefill_new: np.ndarray
    prefill_cached: np.ndarray

    @property
    def decode_tokens(self) -> int:
        return int(len(self.decode_len) + self.decode_drafts.sum())


@dataclass(slots=True)
class LiveTimes:
    """What one live step measured, in seconds.

    ``duration``: wall time of the whole step; ``forward_s``, ``copy_s``,
    ``apply_s``, ``sample_s``: each GPU part from its start on the GPU to its
    end (CUDA events; the wall clock on a CPU device); ``mask_path_s``: wall
    time from the forward's launch to the copy's launch (the CPU's mask work);
    ``after_token_s``: wall time after the sampled tokens were out.
    """

    duration: float
    forward_s: float
    copy_s: float
    apply_s: float
    sample_s: float
    mask_path_s: float
    after_token_s: float


@dataclass(frozen=True)
class LiveInfo:
    """Where a live run ran (``live.json`` in its run folder)."""

    device: str
    torch_version: str
    model: str
    kv_tokens: int       # the paged cache's capacity (whole blocks)
    kv_block_size: int
    kv_requests: int     # rows of its block table: the most requests it holds at once
    max_len: int
    steps: int
    graphs_captured: list[int]
    ranks: RanksInfo | None = None  # a run of several rank processes: what they measured (rank 0's info above)


class LiveStep:
    """Runs steps for real (see the module doc).

    Parameters
    ----------
    spec : the model whose forward runs (a GQA architecture: dense, MoE or hybrid).
    vocab_size : the run's vocabulary (bitmask and sampling width).
    max_len : the longest context a row can reach (prompt, output, drafts).
    device : ``cuda`` on a GPU host; ``cpu`` runs the same steps synchronously (tests).
    kv_tokens : KV-cache capacity in tokens (default: :data:`KV_MEMORY_SHARE` of the GPU
        memory left after the weights and the linear-attention state of ``max_requests``;
        required on a CPU device).
    max_rows : the most rows (and mask rows) one step samples.
    block_size : tokens a block of the paged cache (the policy's ``kv_block_size``).
    max_requests : rows of the block table, the most requests running at once (at most and by default
        ``max_rows``).
    mtp_drafts : tokens the model's MTP head drafts after each step with decode rows, for every decoding
        request (:meth:`LiveForward.draft`, a graph per padded request count, timed with the forward); 0:
        no head (the drafts of an external drafter cost the forward nothing).
    tp : this rank's tensor-parallel group: the forward is its shard (:mod:`.forward`).
    balance_decode : decode attention launches its rows longest first (:class:`LiveForward`);
        settable between steps (:attr:`balance_decode`).
    """

    def __init__(self, spec: ModelSpec, vocab_size: int, max_len: int, device: str = "cuda",
                 kv_tokens: int | None = None, max_rows: int = 1024, dtype: torch.dtype = torch.bfloat16,
                 logits_dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 graph_sizes: Sequence[int] = (), tp: TensorParallel | None = None,
                 balance_decode: bool = True, block_size: int = BLOCK_SIZE, max_requests: int | None = None,
                 mtp_drafts: int = 0) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.mtp_drafts = mtp_drafts
        self.forward = LiveForward(spec, self.device, dtype=dtype, seed=seed, tp=tp, balance_decode=balance_decode,
                                   mtp=mtp_drafts > 0)
        spec = self.forward.spec  # a tensor-parallel rank's cache holds its shard's KV heads
        head_layers = spec.mtp_layers if mtp_drafts else 0
        requests = max_rows if max_requests is None else min(max_requests, max_rows)
        if kv_tokens is None:
            if not self.cuda:
                raise ValueError("kv_tokens is required on a CPU device")
            free, _ = torch.cuda.mem_get_info(self.device)
            # the pages take what the linear layers' fixed state of every request (hybrid models) leaves
            left = int(free * KV_MEMORY_SHARE) - requests * KVCache.bytes_per_slot(spec, dtype)
            kv_tokens = max(0, left) // KVCache.bytes_per_token(spec, dtype, head_layers)
        self.max_len = max_len
        if kv_tokens < max_len:
            raise KVCapacityError(f"a KV cache of {kv_tokens} tokens holds no context of {max_len} tokens")
        # a drafting request's blocks also hold the head's drafts past its verified tokens
        self.paged = PagedRequests(KVPool(spec, kv_tokens // block_size * block_size, self.device, dtype,
                                          block_size, head_layers), requests, max_len + mtp_drafts)
        self.cache = self.paged.cache
        self.max_rows = max_rows
        words = (vocab_size + 31) // 32
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.logits = torch.randn((max_rows, vocab_size), generator=gen, device=self.device).to(logits_dtype)
        self.mask_host = torch.ones((max_rows, words), dtype=torch.int32, pin_memory=self.cuda)
        self.mask = self.mask_host.to(self.device)
        self.graph_sizes = tuple(graph_sizes)
        self._graphs: dict[int, StepGraph] = {}
        self._graph_sets = {balance_decode: self._graphs}  # the graphs of each balance_decode setting
        self._draft_graphs: dict[tuple[bool, int], StepGraph] = {}  # per (balance_decode, padded requests)
        self._stage = torch.zeros((3, max(self.graph_sizes, default=1)), dtype=torch.int64, pin_memory=self.cuda)
        self._draft_stage = torch.zeros((2, max(self.graph_sizes, default=1)), dtype=torch.int64,
                                        pin_memory=self.cuda)
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(6)] if self.cuda else []
        self._launched = 0.0
        self._work: Callable[[], object] | None = None
        self._stamps: list[float] = []
        self.steps = 0
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile every kernel variant a run can meet before it starts, as an engine does at start-up:
        the apply and sampling kernels at every row count up to ``max_rows`` (their column block, apply
        mode and Triton's specialization of integer arguments all follow the row count, and a variant
        first met mid-run compiles on the step's clock: 0.4 s, seen on a fresh GPU host); a prefill
        and a mixed step cover the eager forward and the decode-attention kernel outside a graph.
        (Decode graphs are captured on first use, off the step's clock.) On a CPU device, where the
        kernels run torch's reference code, a few row counts do."""
        rows = range(1, self.max_rows + 1) if self.cuda else [n for n in (1, 2, 16) if n <= self.max_rows]
        for n in rows:
            apply_bitmask(self.logits[:n], self.mask[:n])
            masked_argmax(self.logits[:n], self.mask[:n])
        pool = self.paged.pool
        length = min(64, self.max_len - 1, pool.blocks // 3 * pool.block_size)
        if self.cache.slots >= 3 and length >= 2:
            rows = self.paged.rows(np.array([-1, -2, -3]), np.full(3, length))  # ids no request has
            self.paged.flush()
            self.forward.step(self.cache, prefill=[PrefillChunk(int(rows[0]), 0, length)])
            self.forward.step(self.cache, self.forward.decode_inputs([length - 1] * 2, rows[1:].tolist(),
                                                                     per_row=True),
                              [PrefillChunk(int(rows[0]), length // 2, length - length // 2)])
            self.paged.release([-1, -2, -3])
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @property
    def balance_decode(self) -> bool:
        """Whether decode attention launches its rows longest first (:class:`LiveForward`)."""
        return self.forward.balance_decode

    @balance_decode.setter
    def balance_decode(self, balance: bool) -> None:
        # a captured graph keeps the launches it was captured with: each setting replays its own graphs
        self.forward.balance_decode = balance
        self._graphs = self._graph_sets.setdefault(balance, {})

    def info(self) -> LiveInfo:
        device = torch.cuda.get_device_name(self.device) if self.cuda else "cpu"
        pool = self.paged.pool
        return LiveInfo(device, torch.__version__, self.forward.spec.name, pool.tokens, pool.block_size,
                        self.cache.slots, self.max_len, self.steps, sorted(self._graphs))

    @property
    def kv_tokens(self) -> int:
        """The paged cache's capacity in tokens (whole blocks)."""
        return self.paged.pool.tokens

    @property
    def kv_block_size(self) -> int:
        return self.paged.pool.block_size

    @property
    def kv_requests(self) -> int:
        """The most requests the cache holds at once (rows of its block table)."""
        return self.cache.slots

    # ---- one step ------------------------------------------------------------------------------------------

    def begin(self, decode_len: np.ndarray, decode_drafts: np.ndarray, prefill_new: np.ndarray,
              prefill_cached: np.ndarray, sync: bool, host_s: float, decode_rid: np.ndarray | None = None,
              prefill_rid: np.ndarray | None = None, running: np.ndarray | None = None) -> None:
        """Start a step (its :class:`LiveShape` as arrays): ``host_s`` of modelled host work (before the
        launch without overlap, beside the forward with it), and the forward's launch.

        ``decode_rid``, ``prefill_rid``: the rows' and chunks' requests; ``running``: every request of the
        running batch (the cache frees the blocks of the others). Without them, the step's rows and chunks
        are requests 0, 1, ... in that order, and no other request runs.
        """
        shape = LiveShape(decode_len, decode_drafts, prefill_new, prefill_cached)
        rows = len(decode_len)
        if decode_rid is None:
            decode_rid = np.arange(rows)
            prefill_rid = np.arange(rows, rows + len(prefill_new))
            running = np.arange(rows + len(prefill_new))
        self.paged.keep_only(running)
        decode, chunks, drafting = self._place(shape, decode_rid, prefill_rid)
        # graphs are captured before the clock starts; the step keeps its own until it ends
        stage, work = self._prepare(decode, chunks, drafting)
        self._work = work
        self._t0 = time.perf_counter()
        if sync:
            spin(host_s)
        # the inputs' copies are queued before the forward's first event: forward_s is the GPU's forward alone
        stage()
        if self.cuda:
            self._events[0].record()
        else:
            self._stamps = [time.perf_counter()]
        work()
        if self.cuda:
            self._events[1].record()
        else:
            self._stamps.append(time.perf_counter())
        self._launched = time.perf_counter()
        if not sync:
            spin(host_s)

    def end(self, mask_rows: int, sample_rows: int, host_s: float, sync: bool,
            after_sample: Callable[[], object] | None = None, after_s: float = 0.0) -> LiveTimes:
        """Finish the step begun last: ``host_s`` more of modelled mask-path host work, then the
        bitmask copy, apply and sampling; after sampling (``sync``), ``after_sample`` (the grammar's
        accepts) and ``after_s`` of modelled result processing. Returns what was measured."""
        spin(host_s)
        mask_path = time.perf_counter() - self._launched
        if mask_rows > self.max_rows or sample_rows > self.max_rows:
            raise ValueError(f"{max(mask_rows, sample_rows)} rows in one step; "
                             f"the live step was built for at most {self.max_rows}")
        parts = self._mask_and_sample(mask_rows, sample_rows)
        t_token = time.perf_counter()
        if sync:
            if after_sample is not None:
                after_sample()
            spin(after_s)
        t_end = time.perf_counter()
        self._work = None
        self.steps += 1
        forward_s, copy_s, apply_s, sample_s = parts
        return LiveTimes(t_end - self._t0, forward_s, copy_s, apply_s, sample_s, mask_path, t_end - t_token)

    # ---- parts ---------------------------------------------------------------------------------------------

    def _place(self, shape: LiveShape, decode_rid: np.ndarray, prefill_rid: np.ndarray
               ) -> tuple[tuple[np.ndarray, np.ndarray] | None, list[PrefillChunk], tuple[np.ndarray, np.ndarray]]:
        """The step's requests in the paged cache: each its row of the block table, with blocks for the
        context it reaches in this step (the table's changes copied to the device). Returns each decode
        query token's (table row, position), a row's token then its drafts, the prefill chunks, and each
        decoding request's (table row, position after its last verified token): where an MTP head drafts."""
        rows = len(shape.decode_len)
        keep = shape.prefill_new > 0
        new, cached, chunk_rid = shape.prefill_new[keep], shape.prefill_cached[keep], prefill_rid[keep]
        # a chunk from an empty cache starts its request anew (a recompute after a preemption may come back
        # before the cache saw it leave): its old blocks go first
        self.paged.release(chunk_rid[cached == 0].tolist())
        try:
            decode, drafting = None, (np.zeros(0, np.int64), np.zeros(0, np.int64))
            if rows:
                per_row = 1 + shape.decode_drafts
                table_rows = self.paged.rows(decode_rid, shape.decode_len + per_row + self.mtp_drafts)
                slots = np.repeat(table_rows, per_row)
                first = np.repeat(np.cumsum(per_row) - per_row, per_row)
                decode = slots, np.repeat(shape.decode_len, per_row) + (np.arange(len(slots)) - first)
                drafting = table_rows, shape.decode_len + per_row
            chunk_rows = self.paged.rows(chunk_rid, cached + new)
        except KVCapacityError as error:
            raise KVCapacityError(
                f"a step of {rows} decode rows and {len(new)} prefill chunks does not fit the live KV cache "
                f"({self.kv_tokens} tokens in blocks of {self.paged.pool.block_size}, {self.kv_requests} "
                f"requests, contexts up to {self.max_len}): {error}") from None
        self.paged.flush()
        chunks = [PrefillChunk(int(r), int(c), int(n))
                  for r, c, n in zip(chunk_rows.tolist(), cached.tolist(), new.tolist(), strict=True)]
        return decode, chunks, drafting

    def _prepare(self, decode: tuple[np.ndarray, np.ndarray] | None, chunks: list[PrefillChunk],
                 drafting: tuple[np.ndarray, np.ndarray]) -> tuple[Callable[[], object], Callable[[], object]]:
        """The step's input staging and its forward, ready to run in that order: on a GPU a graph replay
        (a decode batch's graph is kept per padded token count and its inputs are refilled in place; a
        step with prefill chunks is captured for its own shape, since the engines launch prefill far
        faster than this forward's eager Python could: timed eagerly it would measure cdbench's launch
        pace, not the GPU); on a CPU the eager step. With an MTP head, its drafting of the ``drafting``
        requests follows the forward (staged and timed with it)."""
        stage, work = self._prepare_forward(decode, chunks)
        if not self.mtp_drafts or decode is None:
            return stage, work
        draft_stage, draft_work = self._prepare_draft(*drafting)

        def stage_both() -> None:
            stage()
            draft_stage()

        def work_both() -> None:
            work()
            draft_work()
        return stage_both, work_both

    def _prepare_forward(self, decode: tuple[np.ndarray, np.ndarray] | None, chunks: list[PrefillChunk]
                         ) -> tuple[Callable[[], object], Callable[[], object]]:
        if decode is not None and not chunks and self.cuda:
            graph = self._graph(len(decode[0]))
            if graph is not None:
                return (lambda: self._stage_inputs(graph, *decode)), graph.replay
        inputs = self.forward.decode_inputs(decode[1].tolist(), decode[0].tolist(), per_row=True) \
            if decode is not None else None
        if self.cuda:
            captured = self.forward.capture(self.cache, inputs, chunks)
            self._captured()
            return _nothing, captured.replay
        return _nothing, lambda: self.forward.step(self.cache, inputs, chunks)

    def _prepare_draft(self, slots: np.ndarray, positions: np.ndarray
                       ) -> tuple[Callable[[], object], Callable[[], object]]:
        """The MTP head's drafting of these requests, ready to run after the forward: on a GPU a graph per
        padded request count (inputs refilled in place; beyond the largest size captured for its own), on
        a CPU the eager passes."""
        k = self.mtp_drafts
        if not self.cuda:
            inputs = self.forward.draft_inputs(positions.tolist(), slots.tolist())
            return _nothing, lambda: self.forward.draft(self.cache, inputs, k)
        padded = graph_size(self.graph_sizes, len(slots))
        if padded is None:
            graph = self.forward.capture_draft(self.cache, self.forward.draft_inputs(positions.tolist(),
                                                                                     slots.tolist()), k)
            self._captured()
            return _nothing, graph.replay
        key = (self.forward.balance_decode, padded)
        graph = self._draft_graphs.get(key)
        if graph is None:
            graph = self._draft_graphs[key] = self.forward.capture_draft(
                self.cache, self.forward.draft_inputs([0] * padded, [0] * padded), k)
            self._captured()

        def stage() -> None:
            # padding requests draft at position 0 of the table's row 0 (their values do not change the time)
            staged = self._draft_stage[:, :padded]
            staged.zero_()
            view = staged.numpy()
            view[0, :len(slots)], view[1, :len(slots)] = slots, positions
            graph.inputs.slots.copy_(staged[0], non_blocking=True)
            graph.inputs.positions.copy_(staged[1], non_blocking=True)
        return stage, graph.replay

    def _graph(self, tokens: int) -> StepGraph | None:
        """The captured decode graph for ``tokens`` query tokens (padded up; captured on first use), or
        ``None`` beyond the largest capture size (such a batch is captured for itself)."""
        padded = graph_size(self.graph_sizes, tokens)
        if padded is None:
            return None
        graph = self._graphs.get(padded)
        if graph is None:
            inputs = self.forward.decode_inputs([0] * padded, [0] * padded, per_row=True)
            graph = self._graphs[padded] = self.forward.capture(self.cache, inputs)
            self._captured()
        return graph

    def _captured(self) -> None:
        """After a capture: tensor-parallel ranks wait for each other, so no rank's capture (off the clock)
        lands on another's clock as a wait inside the replay's first all-reduce."""
        torch.cuda.synchronize(self.device)
        if self.forward.tp is not None:
            self.forward.tp.barrier(self.device)

    def _stage_inputs(self, graph: StepGraph, slots: np.ndarray, positions: np.ndarray) -> None:
        """Refill a decode graph's inputs in place (asynchronous copies, queued before its replay)."""
        tokens = len(slots)
        inputs: DecodeInputs = graph.inputs
        padded = len(inputs.slots)
        # padding tokens write position 0 of the table's row 0 and attend to one key (the values written do
        # not change the time)
        stage = self._stage[:, :padded]
        stage.zero_()
        staged = stage.numpy()
        staged[0, :tokens], staged[1, :tokens] = slots, positions
        staged[2] = staged[1] + 1
        # pinned and asynchronous, on the stream before the replay (the previous step was waited for)
        inputs.slots.copy_(stage[0], non_blocking=True)
        inputs.positions.copy_(stage[1], non_blocking=True)
        inputs.lengths.copy_(stage[2], non_blocking=True)

    def _mask_and_sample(self, mask_rows: int, sample_rows: int) -> tuple[float, float, float, float]:
        """Queue the copy, apply and sampling behind the forward; wait for the tokens; each part's time."""
        if self.cuda:
            events = self._events
            events[2].record()
            if mask_rows:
                self.mask[:mask_rows].copy_(self.mask_host[:mask_rows], non_blocking=True)
            events[3].record()
            if mask_rows:
                apply_bitmask(self.logits[:mask_rows], self.mask[:mask_rows])
            events[4].record()
            if sample_rows:
                masked_argmax(self.logits[:sample_rows], self.mask[:sample_rows])
            events[5].record()
            events[5].synchronize()
            return (events[0].elapsed_time(events[1]) / 1e3, events[2].elapsed_time(events[3]) / 1e3,
                    events[3].elapsed_time(events[4]) / 1e3, events[4].elapsed_time(events[5]) / 1e3)
        stamps = self._stamps
        t0 = time.perf_counter()
        if mask_rows:
            self.mask[:mask_rows].copy_(self.mask_host[:mask_rows])
        t1 = time.perf_counter()
        if mask_rows:
            apply_bitmask(self.logits[:mask_rows], self.mask[:mask_rows])
        t2 = time.perf_counter()
        if sample_rows:
            masked_argmax(self.logits[:sample_rows], self.mask[:sample_rows])
        t3 = time.perf_counter()
        return stamps[1] - stamps[0], t1 - t0, t2 - t1, t3 - t2
