"""GPU costs measured by running each step's GPU work for real (``costs.live_gpu``).

:class:`LiveGpuCosts` answers the scheduler's :class:`~cdbench.harness.costs.gpu.GpuCosts`
questions by executing the work on this machine's GPU and timing it with
CUDA events:

- the forward of the model's live architecture (:mod:`.forward`) over the
  step's shape: each prefill chunk with its cached prefix as one request of
  the paged cache, the decode rows as requests of their mean cached length, rounded up to a multiple
  of :data:`DECODE_BUCKET` so decode batches replay a CUDA graph captured once
  per (rows, length) as the engines do (the scheduler passes the rows' summed
  length, not each row's). A step with prefill chunks is captured for itself
  and its replay timed, so every forward time is GPU time, as in the
  calibration (an eager step's time would be the host's launch pace);
- the bitmask's host-to-device copy (pinned or pageable), the project's apply
  kernel (:func:`cdbench.kernels.apply_bitmask`) and its fused masked sampler
  (:func:`cdbench.kernels.masked_argmax`) over logits of the model's vocabulary:
  measured once per row count (the median of :data:`REPEATS` after a warm-up
  that keeps kernel compilation out) and reused.

The overlap of CPU and GPU work stays the scheduler's rules; only the GPU
parts are measured. On a CPU device (tests, a tiny model) the wall clock
times them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from cdbench.harness.costs.hardware import ModelSpec
from cdbench.harness.live.forward import (
    LiveForward,
    PrefillChunk,
    StepGraph,
)
from cdbench.harness.live.paged import KVCache, KVCapacityError, KVPool
from cdbench.kernels import apply_bitmask, masked_argmax

DECODE_BUCKET = 256
MAX_GRAPHS = 48  # captured decode shapes kept (least recently used dropped)
REPEATS = 5


class LiveGpuCosts:
    """Measured GPU seconds of each step part (see the module doc).

    Parameters
    ----------
    spec : the model whose live forward runs.
    vocab_size : the logits' width (mask and sampling): the model's vocabulary in a run (CostConfig.logits_width).
    device : a torch device; ``cuda`` to measure a GPU.
    kv_tokens : KV-cache capacity in tokens (paged, every layer its own memory).
    max_rows : the most mask or sample rows of a step.
    logits_dtype, dtype : of the masked logits; of the weights and KV cache.
    """

    def __init__(self, spec: ModelSpec, vocab_size: int, device: str = "cuda", kv_tokens: int = 2**18,
                 max_rows: int = 1024, logits_dtype: torch.dtype = torch.bfloat16,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.forward = LiveForward(spec, self.device, dtype=dtype, seed=seed)
        self.pool = KVPool(spec, kv_tokens, self.device, dtype)
        self.kv_tokens, self.max_rows = kv_tokens, max_rows
        words = (vocab_size + 31) // 32
        self.mask_row_bytes = 4 * words  # one int32 bitmask row
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.logits = torch.randn((max_rows, vocab_size), generator=gen, device=self.device).to(logits_dtype)
        # A sparse mask (about 1 token in 32 allowed), as grammar masks mostly are.
        self.mask_host = torch.full((max_rows, words), 1, dtype=torch.int32, pin_memory=self.cuda)
        self.mask_pageable = torch.full((max_rows, words), 1, dtype=torch.int32)
        self.mask = self.mask_host.to(self.device)
        self._graphs: OrderedDict[tuple[int, int], StepGraph] = OrderedDict()
        self._mask_parts: dict[tuple[str, int], float] = {}
        self.steps = 0

    # ---- GpuCosts ------------------------------------------------------------------------------------------

    def forward_s(self, prefill_chunks, prefill_cached, decode_rows: int, decode_kv_tokens: int) -> float:
        chunks = [PrefillChunk(0, int(c), int(n)) for n, c in zip(np.asarray(prefill_chunks).tolist(),
                                                                 np.asarray(prefill_cached).tolist(), strict=True)
                  if n > 0]
        rows = int(decode_rows)
        if not chunks and rows == 0:
            return 0.0
        length = _bucket(decode_kv_tokens / rows) if rows else 0
        slots = rows + len(chunks)
        max_len = max([length + 1 if rows else 0] + [c.cached + c.new for c in chunks])
        if self.pool.blocks_needed(slots, max_len) > self.pool.blocks:
            raise KVCapacityError(
                f"a step of {rows} decode rows of {length} tokens and {len(chunks)} prefill chunks needs "
                f"{slots} x {max_len} KV tokens; the live GPU holds {self.pool.tokens}")
        cache = self.pool.cache(slots, max_len)
        chunks = [PrefillChunk(rows + i, c.cached, c.new) for i, c in enumerate(chunks)]
        self.steps += 1
        if rows and not chunks and self.cuda:
            graph = self._decode_graph(rows, length, cache)
            return self._time(graph.replay)
        decode = self.forward.decode_inputs([length] * rows) if rows else None
        if self.cuda:
            once = self.forward.capture(cache, decode, chunks)
            return self._time(once.replay)
        return self._time(lambda: self.forward.step(cache, decode, chunks))

    def copy_s(self, mask_rows: int, pinned: bool) -> float:
        source = self.mask_host if pinned else self.mask_pageable
        return self._mask_part("copy" if pinned else "copy_pageable", mask_rows,
                               lambda n: self.mask[:n].copy_(source[:n], non_blocking=pinned))

    def apply_s(self, mask_rows: int) -> float:
        return self._mask_part("apply", mask_rows, lambda n: apply_bitmask(self.logits[:n], self.mask[:n]))

    def sample_s(self, rows: int) -> float:
        return self._mask_part("sample", rows, lambda n: masked_argmax(self.logits[:n], self.mask[:n]))

    # ---- helpers -------------------------------------------------------------------------------------------

    def _mask_part(self, part: str, rows: int, work: Callable[[int], object]) -> float:
        if rows <= 0:
            return 0.0
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows in one step; the live GPU was built for at most {self.max_rows}")
        key = (part, int(rows))
        seconds = self._mask_parts.get(key)
        if seconds is None:
            work(rows)  # warm-up: the first call of a shape may compile a kernel
            seconds = self._mask_parts[key] = float(np.median([self._time(lambda: work(rows))
                                                               for _ in range(REPEATS)]))
        return seconds

    def _decode_graph(self, rows: int, length: int, cache: KVCache) -> StepGraph:
        key = (rows, length)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self.forward.capture(cache, self.forward.decode_inputs([length] * rows))
            self._graphs[key] = graph
            if len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        return graph

    def _time(self, work: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            work()
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _bucket(length: float) -> int:
    """A decode row length rounded up to the graph bucket (at least one bucket)."""
    return max(DECODE_BUCKET, int(-(-length // DECODE_BUCKET)) * DECODE_BUCKET)
