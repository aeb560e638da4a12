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

The pool is sized as an engine sizes its cache (vLLM's
``Worker.determine_available_memory``): before it is allocated, the largest
step the run can form (:func:`largest_step`: the policy's token budget as
decode rows of every request row with their drafts and prefill chunks of the
rest, the MTP head's drafting over those rows, the bitmask apply and sampling
over every sampled row) runs eagerly on a small temporary pool, and its peak
of allocated memory is read (:func:`profile_memory`); the decode and drafting
graphs the run can capture are measured from two captures each (the smallest
and the largest capture size its batches pad to, the sizes between taken on
the line through them: every capture keeps a private memory pool of its own,
which grows with its token count). The pool takes the policy's
``kv_memory_fraction`` of the device's memory (vLLM ``gpu_memory_utilization``
0.9, SGLang ``mem_fraction_static`` 0.88) less the memory in use after the
weights and fixed buffers, that peak and those graphs
(:func:`~cdbench.harness.live.paged.size_kv_pool`); ``live.json`` records how
(:class:`~cdbench.harness.live.paged.KVSizing`). An explicit ``kv_tokens``
skips the profile.

On a CPU device (tests, at tiny shapes) the same calls run synchronously and
the wall clock times each part.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from cdbench.harness.costs.hardware import ModelSpec
from cdbench.harness.live.forward import (
    DecodeInputs,
    LiveForward,
    PrefillChunk,
    StepGraph,
    TensorParallel,
    kept_linear_state,
)
from cdbench.harness.live.paged import (
    BLOCK_SIZE,
    KVCapacityError,
    KVPool,
    KVSizing,
    PagedRequests,
    blocks_for,
    size_kv_pool,
)
from cdbench.harness.policies import SchedulerConfig, graph_size

if TYPE_CHECKING:
    from cdbench.harness.live.rank_info import RanksInfo
from cdbench.kernels import apply_bitmask, masked_argmax

# a live step's defaults outside a run are the scheduler's: the share of the device's memory a run holds, KV pool
# included (kv_memory_fraction: vLLM's gpu_memory_utilization; SGLang's mem_fraction_static is 0.88 on one GPU),
# and the token budget of a step (max_batched_tokens: vLLM's max_num_batched_tokens, SGLang's chunked_prefill_size)
GPU_MEMORY_UTILIZATION: float = SchedulerConfig.model_fields["kv_memory_fraction"].default
MAX_BATCHED_TOKENS: int = SchedulerConfig.model_fields["max_batched_tokens"].default


@dataclass(frozen=True)
class LargestStep:
    """The largest step a run can form: ``rows`` decode rows of ``1 + drafts`` query tokens each, then prefill
    chunks ``(cached, new)``."""

    rows: int
    drafts: int
    chunks: tuple[tuple[int, int], ...]

    @property
    def tokens(self) -> int:
        return self.rows * (1 + self.drafts) + sum(new for _, new in self.chunks)


def largest_step(max_tokens: int, max_len: int, requests: int, max_rows: int, drafts: int = 0) -> LargestStep:
    """The largest step under a token budget of ``max_tokens`` (decode tokens and drafts first: a mixed batch
    gives prefill what they leave), contexts up to ``max_len``, ``requests`` rows of the block table and
    ``max_rows`` sampled rows: as many decode rows as both allow beside a chunk request per ``max_len`` tokens
    of prefill, the rest of the budget as chunks (the last one after a cached prefix that fills its context, so
    its attention reads pages too). The most tokens and the most sampled rows together: every activation and
    the logits at their largest.

    >>> largest_step(8192, 4096, 256, 1024, drafts=2)
    LargestStep(rows=254, drafts=2, chunks=((0, 4096), (762, 3334)))
    """
    per_row = 1 + drafts
    rows = min(requests, max_rows // per_row)
    while rows > 0:
        chunks = -(-max(0, max_tokens - rows * per_row) // max_len)
        if rows + chunks <= requests and rows * per_row + chunks <= max_rows:
            break
        rows -= 1
    left = max(0, max_tokens - rows * per_row)
    n = min(-(-left // max_len), requests - rows, max_rows - rows * per_row)
    left = min(left, n * max_len)
    sizes = [max_len] * (n - 1) + [left - (n - 1) * max_len] if n else []
    return LargestStep(rows, drafts, tuple((max_len - new if i == n - 1 else 0, new) for i, new in enumerate(sizes)))


class MemoryReadings(Protocol):
    """The device's memory as the profile reads it (:class:`CudaMemory`; a CPU test injects its own)."""

    def start(self) -> int:
        """Restart the peak; the bytes allocated now."""

    def peak(self) -> int:
        """The most bytes allocated since :meth:`start`."""

    def reserved(self) -> int:
        """The bytes the allocator holds (its free cached blocks given back first)."""


class CudaMemory:
    """:class:`MemoryReadings` of a CUDA device: the caching allocator's counters, the device synchronized."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)


@dataclass(frozen=True)
class ProfiledMemory:
    """What :func:`profile_memory` read: the largest step it ran, its activation peak and the graphs' memory."""

    step: LargestStep
    peak_bytes: int
    graph_bytes: int


def profile_memory(forward: LiveForward, step: LargestStep, max_len: int, requests: int, block_size: int,
                   mtp_drafts: int, logits: torch.Tensor, mask: torch.Tensor, readings: MemoryReadings,
                   graph_sizes: Sequence[int] = ()) -> ProfiledMemory:
    """Run ``step`` eagerly on a temporary pool of its blocks (``requests`` rows of the block table, contexts up to
    ``max_len`` and ``mtp_drafts`` more), the MTP head's ``mtp_drafts`` passes over its decode rows, and the
    bitmask apply and sampling over all of ``logits`` and ``mask``; return the peak of allocated memory above its
    start and, on a GPU with ``graph_sizes``, the memory of the decode and drafting graphs the run can capture
    (:func:`_graph_bytes`). The pool is gone on return."""
    per_row = 1 + step.drafts
    head_layers = forward.spec.mtp_layers if mtp_drafts else 0
    # a decode row after one cached token: its verified tokens, then the head's drafts past them
    lengths = [1 + per_row + mtp_drafts] * step.rows + [cached + new for cached, new in step.chunks]
    blocks = sum(blocks_for(n, block_size) for n in lengths)
    paged = PagedRequests(KVPool(forward.spec, blocks * block_size, forward.device, forward.dtype, block_size,
                                 head_layers), requests, max_len + mtp_drafts)
    table = paged.rows(np.arange(len(lengths)), np.array(lengths))
    paged.flush()
    decode = draft = None
    if step.rows:
        decode = forward.decode_inputs(np.tile(np.arange(1, 1 + per_row), step.rows).tolist(),
                                       np.repeat(table[:step.rows], per_row).tolist(), per_row=True)
        if mtp_drafts:
            draft = forward.draft_inputs([1 + per_row] * step.rows, table[:step.rows].tolist())
    chunks = [PrefillChunk(int(row), cached, new) for row, (cached, new) in zip(table[step.rows:].tolist(),
                                                                                 step.chunks, strict=True)]
    start = readings.start()
    # as a capture runs it (the run captures a step with prefill chunks for its own shape): the states of the
    # step's requests kept aside meanwhile
    with kept_linear_state(paged.cache, decode, chunks):
        forward.step(paged.cache, decode, chunks)
    if draft is not None:
        forward.draft(paged.cache, draft, mtp_drafts)
    apply_bitmask(logits, mask)
    masked_argmax(logits, mask)
    peak = readings.peak() - start
    graphs = 0
    if forward.device.type == "cuda" and graph_sizes:
        most = min(requests, logits.shape[0] // per_row)  # decode rows of a step without prefill
        graphs = _graph_bytes(forward, paged, graph_sizes, most * per_row, most if mtp_drafts else 0, mtp_drafts,
                              readings)
    return ProfiledMemory(step, peak, graphs)


def _graph_bytes(forward: LiveForward, paged: PagedRequests, graph_sizes: Sequence[int], most_tokens: int,
                 most_drafting: int, passes: int, readings: MemoryReadings) -> int:
    """The memory of every decode graph a run of at most ``most_tokens`` decode tokens captures (and drafting
    graph of at most ``most_drafting`` requests, ``passes`` each): each keeps its own memory pool. A first
    capture, thrown away, sets up what every capture shares and keeps (the warm-up stream's library
    workspaces: counted once); then the smallest and the largest size a batch pads to are captured and
    measured, and the sizes between priced on the line through them (a pool grows with its tokens)."""
    cache = paged.cache
    # row 0 of the table holds the first decode row's blocks (or a chunk's): padding rows write and read there

    def decode(size: int) -> StepGraph:
        return forward.capture(cache, forward.decode_inputs([0] * size, [0] * size, per_row=True))

    def drafting(size: int) -> StepGraph:
        return forward.capture_draft(cache, forward.draft_inputs([0] * size, [0] * size), passes)

    def measured(capture: Callable[[int], StepGraph], size: int) -> int:
        before = readings.reserved()
        graph = capture(size)
        after = readings.reserved()
        del graph
        return after - before

    def padded_to(most: int) -> list[int]:
        top = graph_size(graph_sizes, most)
        return [s for s in graph_sizes if top is None or s <= top]

    before = readings.reserved()
    decode(graph_sizes[0])  # thrown away at once
    total = readings.reserved() - before
    for capture, most in ((decode, most_tokens), (drafting, most_drafting)):
        sizes = padded_to(most) if most else []
        if not sizes:
            continue
        lo, hi = sizes[0], sizes[-1]
        low = measured(capture, lo)
        slope = max(0.0, (measured(capture, hi) - low) / (hi - lo)) if hi > lo else 0.0
        total += sum(int(low + slope * (s - lo)) for s in sizes)
    return total


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
    kv_sizing: KVSizing | None = None  # how the pool was sized from the GPU's memory (None: kv_tokens was given)


class LiveStep:
    """Runs steps for real (see the module doc).

    Parameters
    ----------
    spec : the model whose forward runs (a GQA architecture: dense, MoE or hybrid).
    vocab_size : the logits' width (bitmask and sampling): the model's vocabulary in a run (CostConfig.logits_width).
    max_len : the longest context a row can reach (prompt, output, drafts).
    device : ``cuda`` on a GPU host; ``cpu`` runs the same steps synchronously (tests).
    kv_tokens : KV-cache capacity in tokens (default: sized from the GPU's memory with a profile of the
        largest step, the module doc; required on a CPU device).
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
    memory_fraction : the share of the device's memory the run holds, KV pool included (the policy's
        ``kv_memory_fraction``; default vLLM's ``gpu_memory_utilization``), when ``kv_tokens`` is not given.
    max_tokens : the most tokens one step runs (the policy's ``max_batched_tokens``): the profiled step's.
    spec_tokens : drafts a decode row verifies at most (default ``mtp_drafts``): the profiled step's.
    """

    def __init__(self, spec: ModelSpec, vocab_size: int, max_len: int, device: str = "cuda",
                 kv_tokens: int | None = None, max_rows: int = 1024, dtype: torch.dtype = torch.bfloat16,
                 logits_dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 graph_sizes: Sequence[int] = (), tp: TensorParallel | None = None,
                 balance_decode: bool = True, block_size: int = BLOCK_SIZE, max_requests: int | None = None,
                 mtp_drafts: int = 0, memory_fraction: float = GPU_MEMORY_UTILIZATION,
                 max_tokens: int = MAX_BATCHED_TOKENS, spec_tokens: int | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.mtp_drafts = mtp_drafts
        if kv_tokens is None and not self.cuda:
            raise ValueError("kv_tokens is required on a CPU device")
        self.forward = LiveForward(spec, self.device, dtype=dtype, seed=seed, tp=tp, balance_decode=balance_decode,
                                   mtp=mtp_drafts > 0)
        spec = self.forward.spec  # a tensor-parallel rank's cache holds its shard's KV heads
        head_layers = spec.mtp_layers if mtp_drafts else 0
        requests = max_rows if max_requests is None else min(max_requests, max_rows)
        self.max_len, self.max_rows = max_len, max_rows
        self.graph_sizes = tuple(graph_sizes)
        # the fixed buffers come before the pool: its sizing counts them in use
        words = (vocab_size + 31) // 32
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.logits = torch.randn((max_rows, vocab_size), generator=gen, device=self.device).to(logits_dtype)
        self.mask_host = torch.ones((max_rows, words), dtype=torch.int32, pin_memory=self.cuda)
        self.mask = self.mask_host.to(self.device)
        self._compile_sampling()  # before the sizing: the loaded kernels are in use too
        self.kv_sizing: KVSizing | None = None
        if kv_tokens is None:
            step = largest_step(max_tokens, max_len, requests, max_rows,
                                mtp_drafts if spec_tokens is None else spec_tokens)
            self.kv_sizing = self._size_pool(step, memory_fraction, requests, block_size)
            kv_tokens = self.kv_sizing.tokens
        if kv_tokens < max_len:
            raise KVCapacityError(f"a KV cache of {kv_tokens} tokens holds no context of {max_len} tokens")
        # a drafting request's blocks also hold the head's drafts past its verified tokens
        self.paged = PagedRequests(KVPool(spec, kv_tokens // block_size * block_size, self.device, dtype,
                                          block_size, head_layers), requests, max_len + mtp_drafts)
        self.cache = self.paged.cache
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

    def _size_pool(self, step: LargestStep, memory_fraction: float, requests: int, block_size: int) -> KVSizing:
        """The pool an engine would give this run (the module doc): ``memory_fraction`` of the device's memory
        less what is in use now (weights, fixed buffers, the CUDA context; the allocator's free cached blocks
        given back first), the activation peak of ``step`` and the graphs' memory, read by
        :func:`profile_memory`."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        profiled = profile_memory(self.forward, step, self.max_len, requests, block_size, self.mtp_drafts,
                                  self.logits, self.mask, CudaMemory(self.device), self.graph_sizes)
        torch.cuda.empty_cache()  # the temporary pool and the profile's activations go back to the device
        spec = self.forward.spec
        return size_kv_pool(spec, total_bytes=total, memory_fraction=memory_fraction, in_use_bytes=total - free,
                            activation_peak_bytes=profiled.peak_bytes, graph_bytes=profiled.graph_bytes,
                            requests=requests, max_len=self.max_len, block_size=block_size, dtype=self.forward.dtype,
                            extra_layers=spec.mtp_layers if self.mtp_drafts else 0)

    def _compile_sampling(self) -> None:
        """Compile every variant of the apply and sampling kernels a run can meet before it starts, as an
        engine does at start-up: one at every row count up to ``max_rows`` (their column block, apply mode
        and Triton's specialization of integer arguments all follow the row count, and a variant first met
        mid-run compiles on the step's clock: 0.4 s, seen on a fresh GPU host). On a CPU device, where the
        kernels run torch's reference code, a few row counts do."""
        rows = range(1, self.max_rows + 1) if self.cuda else [n for n in (1, 2, 16) if n <= self.max_rows]
        for n in rows:
            apply_bitmask(self.logits[:n], self.mask[:n])
            masked_argmax(self.logits[:n], self.mask[:n])

    def _warm_up(self) -> None:
        """Compile the forward's kernels a run can meet before it starts (the apply and sampling kernels
        are, :meth:`_compile_sampling`): a prefill and a mixed step cover the eager forward and the
        decode-attention kernel outside a graph. (Decode graphs are captured on first use, off the step's
        clock.)"""
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
                        self.cache.slots, self.max_len, self.steps, sorted(self._graphs), kv_sizing=self.kv_sizing)

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
