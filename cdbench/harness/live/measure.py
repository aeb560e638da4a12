"""Time the live forward over a grid of step shapes: the measurement half of ``cdbench calibrate``.

Every step shape is captured as a CUDA graph and timed as replays: the GPU
time of the step, which the forward cost model prices (the host's launch and
scheduling work is priced apart, as host-side engine costs). Each time is the
median of CUDA-event intervals after warm-up. On a CPU device (tests, at tiny
shapes) the wall clock times eager steps.

The default grid (:func:`default_grid`): decode rows 1-512 × cached context
256-8192 (rows × context up to 2^18 tokens, a KV cache an engine holds next to
8B weights on one 80 GB GPU), prefill chunks of 64-8192 tokens from an empty
cache and after a cached prefix, and mixed steps (a prefill chunk with decode
rows), and steps of 2-16 whole-prompt chunks sharing 1024 or 4096 tokens,
alone and beside 64 decode rows (:func:`chunk_grid`: each chunk's attention runs
its own kernels, so a busy engine's mixed steps cost more than one chunk of
the same tokens), and one chunk of 256-1024 tokens beside 1-4 decode rows
(:func:`few_rows_grid`: the mixed step of chunked prefill under light load,
a request's first-token step there).

A model with an MTP head (``mtp_layers`` > 0) also has the head's drafting
measured (:func:`draft_grid`, added by :func:`grid_shapes`): ``rows`` drafting
requests of ``kv`` cached tokens, the head's ``k`` passes captured as one CUDA
graph (:meth:`~.forward.LiveForward.capture_draft`), as live mode runs them
after a step; the forward is then built with its head and the cache pages the
head's layers after the model's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cdbench.harness.costs.calibration import ForwardMeasurement
from cdbench.harness.costs.hardware import ModelSpec
from cdbench.harness.live.forward import (
    LiveForward,
    PrefillChunk,
    TensorParallel,
)
from cdbench.harness.live.paged import BLOCK_SIZE, KVCache, KVPool, blocks_for
from cdbench.harness.live.step import spin

DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DECODE_KV = (256, 512, 1024, 2048, 4096, 8192)
MAX_DECODE_TOKENS = 2**18
PREFILL_NEW = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
PREFILL_AFTER_CACHE = ((512, 1024), (512, 4096), (2048, 2048), (1024, 7168), (64, 2048))
CHUNKS = (2, 4, 8, 16)
CHUNK_TOKENS = (1024, 4096)
CHUNK_DECODE = ((0, 0), (64, 1024))  # (rows, cached tokens each) beside the chunks
MIXED = ((256, 8, 1024), (256, 64, 1024), (256, 256, 1024), (1024, 8, 1024), (1024, 64, 1024),
         (1024, 256, 1024), (2048, 16, 2048), (2048, 128, 2048), (512, 32, 4096), (128, 128, 512))
FEW_ROWS_MIXED = tuple((new, rows, 1024) for new in (256, 512, 1024) for rows in (1, 2, 4))
DRAFT_ROWS = (1, 4, 16, 64, 128)
DRAFT_KV = (1024, 4096)
DRAFT_PASSES = (1, 3)


@dataclass(frozen=True)
class StepShape:
    """One grid point: ``rows`` decode rows of ``kv`` cached tokens, ``chunks`` prefill chunks of ``new``
    tokens after ``cached`` ones; or, ``drafts`` > 0, the MTP head's ``drafts`` passes over ``rows`` drafting
    requests of ``kv`` cached tokens (their drafts at positions ``kv`` on), no step."""

    rows: int = 0
    kv: int = 0
    chunks: int = 0
    new: int = 0
    cached: int = 0
    drafts: int = 0

    def __post_init__(self) -> None:
        if self.drafts and (self.chunks or not self.rows):
            raise ValueError(f"a draft shape has drafting rows and no prefill chunk: {self}")

    @property
    def kind(self) -> str:
        if self.drafts:
            return "draft"
        return "mixed" if self.rows and self.chunks else ("decode" if self.rows else "prefill")

    @property
    def slots(self) -> int:
        return self.rows + self.chunks

    @property
    def max_len(self) -> int:
        return max(self.kv + max(self.drafts, 1) if self.rows else 0, self.cached + self.new)


def default_grid() -> list[StepShape]:
    decode = [StepShape(rows=r, kv=kv) for r in DECODE_ROWS for kv in DECODE_KV if r * kv <= MAX_DECODE_TOKENS]
    prefill = [StepShape(chunks=1, new=n) for n in PREFILL_NEW]
    prefill += [StepShape(chunks=1, new=n, cached=c) for n, c in PREFILL_AFTER_CACHE]
    mixed = [StepShape(rows=r, kv=kv, chunks=1, new=n) for n, r, kv in MIXED]
    return decode + prefill + mixed + chunk_grid() + few_rows_grid()


def few_rows_grid() -> list[StepShape]:
    """The default grid's mixed steps of one chunk beside a few decode rows."""
    return [StepShape(rows=r, kv=kv, chunks=1, new=n) for n, r, kv in FEW_ROWS_MIXED]


def chunk_grid() -> list[StepShape]:
    """The default grid's steps of several whole-prompt chunks."""
    return [StepShape(rows=rows, kv=kv, chunks=chunks, new=total // chunks)
            for total in CHUNK_TOKENS for chunks in CHUNKS for rows, kv in CHUNK_DECODE]


def tiny_grid() -> list[StepShape]:
    """A few small shapes of every kind: a CPU smoke test of measuring and fitting."""
    return [StepShape(rows=1, kv=8), StepShape(rows=4, kv=16), StepShape(rows=8, kv=32), StepShape(chunks=1, new=16),
            StepShape(chunks=1, new=64), StepShape(chunks=1, new=16, cached=32),
            StepShape(rows=4, kv=16, chunks=1, new=32)]


def draft_grid() -> list[StepShape]:
    """The MTP head's drafting: rows 1-128 × 1024 or 4096 cached tokens (rows × context up to the decode
    grid's 2^18 tokens) × 1 or 3 passes."""
    return [StepShape(rows=r, kv=kv, drafts=k) for r in DRAFT_ROWS for kv in DRAFT_KV for k in DRAFT_PASSES
            if r * kv <= MAX_DECODE_TOKENS]


def tiny_draft_grid() -> list[StepShape]:
    """Two small draft shapes: the tiny grid's for a model with an MTP head."""
    return [StepShape(rows=1, kv=8, drafts=1), StepShape(rows=4, kv=16, drafts=2)]


GRIDS: dict[str, Callable[[], list[StepShape]]] = {
    "default": default_grid, "chunks": chunk_grid, "few_rows": few_rows_grid, "tiny": tiny_grid,
    "draft": draft_grid}
# the draft shapes a step grid adds for a model with an MTP head
_DRAFTS_BESIDE = {"default": draft_grid, "tiny": tiny_draft_grid}


def grid_shapes(grid: str, spec: ModelSpec, tp: int = 1) -> list[StepShape]:
    """The shapes ``cdbench calibrate --grid`` measures: the grid's, and for a model with an MTP head on one
    GPU the default and tiny grids' draft shapes after them (live mode drafts on one GPU)."""
    if grid not in GRIDS:
        raise ValueError(f"--grid {grid!r}: choose from {', '.join(GRIDS)}")
    shapes = GRIDS[grid]()
    if any(s.drafts for s in shapes) and not spec.mtp_layers:
        raise ValueError(f"--grid {grid}: {spec.name} has no MTP head (mtp_layers = 0) to draft with")
    if any(s.drafts for s in shapes) and tp > 1:
        raise ValueError(f"--grid {grid}: the MTP head's drafting is measured on one GPU, not {tp} ranks")
    if spec.mtp_layers and tp == 1 and grid in _DRAFTS_BESIDE:
        shapes += _DRAFTS_BESIDE[grid]()
    return shapes


def pool_tokens(shapes: Iterable[StepShape], cache_len: int | None = None, block_size: int = BLOCK_SIZE) -> int:
    """Cache tokens the largest shape needs: its requests × the blocks of its longest context (or of
    ``cache_len``), in whole blocks."""
    return max(s.slots * blocks_for(cache_len or s.max_len, block_size) * block_size for s in shapes)


def measure_grid(spec: ModelSpec, shapes: Sequence[StepShape], device: str = "cuda", *,
                 dtype: torch.dtype = torch.bfloat16, min_reps: int = 10, min_time_s: float = 0.25,
                 per_row: bool = False, cache_len: int | None = None, idle_s: float = 0.0,
                 tp: TensorParallel | None = None, linear_kernels: str = "auto", block_size: int = BLOCK_SIZE,
                 write_contexts: bool = False,
                 progress: Callable[[ForwardMeasurement], None] | None = None) -> list[ForwardMeasurement]:
    """Build ``spec``'s live forward on ``device`` and time every shape (see the module doc).

    ``per_row``: decode rows attend through the per-row decode-attention kernel (as ``live``
    mode runs them) instead of dense attention. ``cache_len``: the context each request's row of
    the block table can hold (default the shape's longest context); ``live`` mode's rows are as long
    as the workload's longest context, and the per-row kernel's launch shape depends on it (each
    request holds the blocks of that length, ``block_size`` tokens a block, interleaved with the
    other requests' blocks: :meth:`~.paged.KVPool.cache`). ``idle_s``: time each repetition alone,
    launched after that long with the GPU idle (default: back to back, the GPU's time alone).
    ``tp``: this process is one rank of a tensor-parallel group (:func:`measure_grid_tp`): it runs its
    shard, and every rank times exactly ``min_reps`` repetitions (``min_time_s`` ignored), since a rank
    that stopped early would leave the others waiting in their all-reduces. ``linear_kernels``: a hybrid
    model's Gated DeltaNet kernels (:class:`~.forward.LiveForward`). Draft shapes time the MTP head's
    passes (the module doc): their rows are of kind ``draft`` with ``mtp_drafts`` set. ``write_contexts``:
    before a step shape is timed, prefill steps write its decode rows' contexts and its chunks' cached
    prefixes (:func:`prefill_contexts`), as a live request's prefill has; otherwise they are unwritten (zeros),
    which changes no dense step's time but routes a MoE's decode rows to as many experts as uniform routing
    (``reports/calibration/README.md``).
    """
    longest = max(s.max_len for s in shapes)
    if cache_len is not None and cache_len < longest:
        raise ValueError(f"cache_len {cache_len} is shorter than a shape's context ({longest} tokens)")
    mtp = any(s.drafts for s in shapes)
    forward = LiveForward(spec, device, dtype=dtype, tp=tp, linear_kernels=linear_kernels, mtp=mtp)
    ranks = forward.tp.size if forward.tp is not None else 1
    if ranks > 1:  # every rank the same number of repetitions: they run in step
        min_time_s = 0.0
    pool = KVPool(forward.spec, pool_tokens(shapes, cache_len, block_size), device, dtype, block_size,
                  extra_layers=forward.spec.mtp_layers if mtp else 0)
    cuda = forward.device.type == "cuda"
    gpu_device = torch.cuda.get_device_name(forward.device) if cuda else "cpu"
    rows = []
    for shape in shapes:
        cache = pool.cache(shape.slots, cache_len or shape.max_len)
        graph = cuda
        if shape.drafts:
            draft = forward.draft_inputs([shape.kv] * shape.rows, range(shape.rows))
            if graph:
                captured = forward.capture_draft(cache, draft, shape.drafts)
                run = captured.replay
            else:
                def run(cache=cache, draft=draft, passes=shape.drafts):
                    return forward.draft(cache, draft, passes)
        else:
            if write_contexts:
                prefill_contexts(forward, cache, shape)
            decode = forward.decode_inputs([shape.kv] * shape.rows, per_row=per_row) if shape.rows else None
            prefill = [PrefillChunk(shape.rows + i, shape.cached, shape.new) for i in range(shape.chunks)]
            if graph:
                captured = forward.capture(cache, decode, prefill)
                run = captured.replay
            else:
                def run(cache=cache, decode=decode, prefill=prefill):
                    return forward.step(cache, decode, prefill)
        times = time_repetitions(run, cuda, min_reps, min_time_s, idle_s)
        del run
        if graph:
            del captured
        q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
        row = ForwardMeasurement(
            model=spec.name, gpu_device=gpu_device, torch_version=torch.__version__, kind=shape.kind,
            decode_rows=shape.rows, decode_kv=shape.kv, prefill_chunks=shape.chunks, prefill_new=shape.new,
            prefill_cached=shape.cached, graph=graph, reps=len(times), median_s=statistics.median(times),
            p10_s=q[0], p90_s=q[-1], tp=ranks, idle_s=idle_s, mtp_drafts=shape.drafts,
            contexts_written=write_contexts and not shape.drafts,
            # the head's passes always attend through the per-row kernel
            decode_attention="per_row" if per_row or shape.drafts else "dense")
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


# tokens a context-writing prefill step takes at most (the grid's longest prefill)
_WRITE_STEP_TOKENS = 8192


def prefill_contexts(forward: LiveForward, cache: KVCache, shape: StepShape) -> None:
    """Write ``shape``'s contexts as live requests' prefills leave them: each decode row's ``kv`` tokens and
    each prefill chunk's ``cached`` prefix, in prefill steps of at most :data:`_WRITE_STEP_TOKENS` tokens."""
    chunks = [PrefillChunk(slot, 0, shape.kv) for slot in range(shape.rows) if shape.kv]
    chunks += [PrefillChunk(shape.rows + i, 0, shape.cached) for i in range(shape.chunks) if shape.cached]
    batch: list[PrefillChunk] = []
    tokens = 0
    for chunk in chunks:
        if batch and tokens + chunk.new > _WRITE_STEP_TOKENS:
            forward.step(cache, prefill=batch)
            batch, tokens = [], 0
        batch.append(chunk)
        tokens += chunk.new
    if batch:
        forward.step(cache, prefill=batch)


def time_repetitions(run: Callable[[], object], cuda: bool, min_reps: int, min_time_s: float,
                     idle_s: float = 0.0) -> list[float]:
    """Seconds of each repetition of ``run`` after two warm-ups: at least ``min_reps`` and ``min_time_s``.

    ``idle_s`` > 0: each repetition starts on an idle GPU, after the host has spun that long, and is timed
    from its launch, as a serving loop launches a step after its host work (launch latency included).
    Back to back, a compute-bound step (a long prefill) holds an H100 at its power cap and its clocks drop
    (prefill 1x1628 of qwen3-8b: 41.9-43.5 ms back to back, 39.4 ms after 20 ms idle, as live runs' steps of
    that shape took; decode steps unchanged: ``reports/calibration/README.md``).
    """
    for _ in range(2):
        run()
    times: list[float] = []
    if cuda and idle_s > 0:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        while len(times) < min_reps or sum(times) < min_time_s:
            torch.cuda.synchronize()
            spin(idle_s)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return times
    if not cuda:
        while len(times) < min_reps or sum(times) < min_time_s:
            spin(idle_s)
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return times
    torch.cuda.synchronize()
    while len(times) < min_reps or sum(times) < min_time_s:
        # A batch of event pairs per sync keeps the host from pacing the GPU.
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(min_reps)]
        for start, end in events:
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        times += [start.elapsed_time(end) / 1e3 for start, end in events]
    return times


def measure_grid_tp(spec: ModelSpec, shapes: Sequence[StepShape], ranks: int, device: str = "cuda", *,
                    min_reps: int = 20, per_row: bool = False, timeout_s: float = 1800.0,
                    idle_s: float = 0.0) -> list[ForwardMeasurement]:
    """Time every shape on ``ranks`` tensor-parallel ranks, one process (and GPU) each, joined by NCCL
    (gloo on the CPU): rank 0's times of its sharded steps, all-reduces included, as the live mode's
    tensor-parallel ranks run them; ``idle_s``: each repetition after that long idle on every rank (the
    step's all-reduces bring the ranks together again, as a live step's do)."""
    from cdbench.harness.live.rank_procs import run_rank_processes

    if device == "cuda" and torch.cuda.device_count() < ranks:
        raise ValueError(f"{ranks} tensor-parallel ranks each need a GPU; this machine has "
                         f"{torch.cuda.device_count()}")
    outputs = run_rank_processes(_measure_rank, ranks, (spec, list(shapes), ranks, device, min_reps, per_row,
                                                        timeout_s, idle_s), timeout_s, name="cdbench-calibrate")
    return outputs[0]


def _measure_rank(rank: int, folder: Path, spec: ModelSpec, shapes: list[StepShape], ranks: int, device: str,
                  min_reps: int, per_row: bool, timeout_s: float, idle_s: float) -> None:
    """One rank of :func:`measure_grid_tp`: join the group, time the grid, hand back the rows."""
    import datetime

    import torch.distributed as dist

    from cdbench.harness.live.rank_procs import deliver

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder / 'store'}", rank=rank,
                            world_size=ranks, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        rows = measure_grid(spec, shapes, f"cuda:{rank}" if cuda else device, min_reps=min_reps, per_row=per_row,
                            tp=TensorParallel(ranks, rank, None), idle_s=idle_s)
    finally:
        dist.destroy_process_group()
    deliver(folder, rank, rows)
