"""The KV cache as the engines manage it: capacity, admission by free blocks, vLLM's preemption and
SGLang's retraction.

**Capacity.** An engine gives the KV cache what a fraction of the GPU's memory leaves after the
weights: vLLM ``gpu_memory_utilization`` (0.9), SGLang ``mem_fraction_static`` (0.88 on one GPU).
SGLang's ``ModelRunner.profile_max_num_token`` takes ``available - total * (1 - fraction)`` after
the weights are loaded, i.e. ``total * fraction - weights``; vLLM's ``Worker.determine_available_memory``
takes ``total * utilization`` less the weights and the peak activation of a profiling forward (the
activation peak and CUDA graphs are not modelled here). The bytes are divided by the model's KV
bytes per token (:meth:`~cdbench.harness.costs.hardware.ModelSpec.kv_bytes_per_token`: the attention
layers only; a linear-attention layer holds a fixed state per request, reserved here for
``max_running_requests`` requests as SGLang sizes its state pool) and rounded down to whole blocks
(vLLM ``block_size`` 16, SGLang ``page_size`` 1). A request holds ``ceil(tokens / block)`` blocks.
Prefix sharing (vLLM's prefix cache, SGLang's radix cache) is not modelled: every request holds its
own blocks, and a recomputed request recomputes all of its tokens.

**vLLM** (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``): the running requests, in the
order they were admitted, each allocate the blocks of this step's tokens (``KVCacheManager.allocate_slots``);
when one cannot, the *last* running request is preempted (``self.running.pop()``: the latest admitted)
until it can, or it preempts itself. A preempted request frees its blocks, is put at the *front* of
the waiting queue (``waiting.prepend_request``) with ``num_computed_tokens = 0``, and later recomputes
its prompt and the tokens it had generated as a prefill. Waiting requests are admitted only in a
step that preempted nothing, each while its prefill chunk's blocks are free. Since victims always
come from the end, the kept rows are the longest prefix of the running batch whose blocks fit
(:meth:`KVCache.vllm_keep`).

**SGLang** (``python/sglang/srt/managers/schedule_batch.py``, ``ScheduleBatch.check_decode_mem`` and
``retract_decode``; ``scheduler.py``, ``Scheduler.update_running_batch``): before a decode batch runs,
it needs one token a request; if that is not free, requests are retracted in the order of
``sorted(..., key=(len(output_ids), -len(origin_input_ids)), reverse=True)`` popped from the end (the
fewest decoded tokens first, then the longest prompt), at least one and until ``retract_decode_steps``
(20) tokens a remaining request are free. A retracted request frees its KV
(``Req.reset_for_retract``) and rejoins the waiting queue at its tail; it is prefilled again with its
prompt and output. The admission estimate ``new_token_ratio`` is then set to
``min(1, (decoded + 20 * n) / max_new_tokens)`` over the requests kept; it decays by
``(0.7 - 0.7 * 0.14) / 600`` each decode step that needed no retraction, down to ``0.7 * 0.14``,
and is reset to 0.7 when the engine idles (``Scheduler.self_check_during_idle``). Admission
(``schedule_policy.py``, ``PrefillAdder``): ``rem_total_tokens`` = free tokens less, for each
running request, ``min(max_new_tokens - generated, 4096) * new_token_ratio``; a waiting request of
``extend + min(max_new_tokens - generated, 4096)`` tokens is refused (and admission stops) when that
is at least ``rem_total_tokens``; each admitted one takes its whole estimate off it. A request's
``max_new_tokens`` is taken as its output length (what a benchmark client sends).

**Grammar state.** Both engines keep a preempted request's output tokens and its grammar matcher:
vLLM's ``_preempt_request`` resets only ``num_computed_tokens`` and the KV, and the
``StructuredOutputRequest`` keeps its grammar, which already accepted the output; SGLang's
``Req.reset_for_retract`` resets the prefix and KV fields but not ``req.grammar``. The resumed
request continues from its last accepted token, so its grammar state stays consistent and the
executor is told nothing.

**Live mode** runs steps on a paged cache of the policy's block size (:mod:`cdbench.harness.live.paged`):
its capacity bounds the scheduler's (the smaller of the two), and the rows of its block table bound the
running requests (``max_seqs``), so a live step never needs more blocks or rows than the cache has.

A row's ``cached`` tokens count its last sampled token, whose KV the next step writes: a step
allocates a decode row's 1 + drafts tokens, and a prefill chunk that completes its prompt one
token more than the chunk.

Cost: one reduction over the running batch a step when everything fits (``block`` 1) or three
elementwise operations (larger blocks); the rest runs only when the cache is full.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from cdbench.harness.batch import RunningBatch
from cdbench.harness.costs.hardware import GPUSpec, ModelSpec

if TYPE_CHECKING:
    from cdbench.harness.costs.gpu import GpuCosts
    from cdbench.harness.live.step import LiveStep
    from cdbench.harness.policies import SchedulerConfig
    from cdbench.harness.records import RequestTable

_sum = np.add.reduce
_NO_ROWS = np.zeros(0, np.int64)

# SGLang's defaults (python/sglang/srt/server_args.py: schedule_conservativeness; global_config /
# environ: SGLANG_INIT_NEW_TOKEN_RATIO 0.7, SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR 0.14,
# SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS 600, SGLANG_RETRACT_DECODE_STEPS 20;
# schedule_policy.py: SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION 4096)
SGLANG_INIT_NEW_TOKEN_RATIO = 0.7
SGLANG_MIN_NEW_TOKEN_RATIO = SGLANG_INIT_NEW_TOKEN_RATIO * 0.14
SGLANG_NEW_TOKEN_RATIO_DECAY = (SGLANG_INIT_NEW_TOKEN_RATIO - SGLANG_MIN_NEW_TOKEN_RATIO) / 600
SGLANG_RETRACT_DECODE_STEPS = 20
SGLANG_CLIP_MAX_NEW_TOKENS = 4096


class NoKVCacheError(ValueError):
    """The weights leave no KV cache at the configured memory fraction."""


def capacity_tokens(model: ModelSpec, gpu: GPUSpec, tp: int, fraction: float, block: int, state_requests: int) -> int:
    """Token slots of the KV cache of ``model`` on one of ``tp`` ranks of ``gpu`` with ``fraction`` of its
    memory for weights and cache, in whole blocks of ``block``; ``state_requests`` requests' fixed
    linear-attention states are reserved first.

    >>> from cdbench.harness.costs.hardware import resolve_gpu, resolve_model
    >>> capacity_tokens(resolve_model("qwen3-8b"), resolve_gpu("h100"), 1, 0.88, 1, 256)
    366346
    """
    weights = model.params_total * model.bytes_per_weight / tp
    room = gpu.hbm_bytes * fraction - weights - state_requests * model.state_bytes_per_request(tp)
    per_token = model.kv_bytes_per_token(tp)
    tokens = int(room // per_token) // block * block if per_token > 0 else 0
    if tokens < block:
        raise NoKVCacheError(f"{model.name} on {gpu.name}: {fraction:g} of {gpu.hbm_bytes / 2**30:.1f} GiB leaves no "
                              f"KV cache after {weights / 2**30:.1f} GiB of weights (raise kv_memory_fraction or tp)")
    return tokens


def configured_capacity(cfg: SchedulerConfig, gpu: GpuCosts) -> int | None:
    """The KV cache's tokens under ``cfg`` (``kv_tokens``, or derived from the GPU cost model's model and
    GPU); ``None`` when unbounded (``kv_cache="unbounded"``, or costs without a model's shape)."""
    if cfg.kv_cache == "unbounded":
        return None
    if cfg.kv_tokens is not None:
        return cfg.kv_tokens // cfg.kv_block_size * cfg.kv_block_size
    forward = getattr(gpu, "forward", None)
    model, spec = getattr(forward, "model", None), getattr(forward, "gpu", None)
    if not isinstance(model, ModelSpec) or not isinstance(spec, GPUSpec):
        return None  # fixed GPU costs: no model shape to size a cache from
    return capacity_tokens(model, spec, forward.tp, cfg.kv_memory_fraction, cfg.kv_block_size,
                           cfg.max_running_requests)


class KVCache:
    """The KV cache's state while a run goes: what the running batch holds, and the counters.

    Parameters
    ----------
    policy : ``vllm`` (preemption) or ``sglang`` (retraction, ``new_token_ratio``); ``unbounded`` bounds only
        the running requests by ``max_seqs`` (the rows of live mode's block table).
    tokens : capacity in token slots (a multiple of ``block``).
    block : tokens a block (page).
    max_seqs : the most running requests the cache has slots for (``None``: no such bound).
    rec : the request table (prompt lengths; the KV columns are written here).
    batch : the running batch (its ``cached`` tokens are what the cache holds).
    gen_total : each request's tokens to generate (its ``max_new_tokens``).
    """

    def __init__(self, policy: str, tokens: int, block: int, max_seqs: int | None, rec: RequestTable,
                 batch: RunningBatch, gen_total: np.ndarray) -> None:
        self.policy, self.block, self.max_seqs = policy, block, max_seqs
        self.tokens = tokens
        self.blocks = tokens // block
        self.rec, self.batch, self.gen_total = rec, batch, gen_total
        self.ratio = SGLANG_INIT_NEW_TOKEN_RATIO
        self.free = self.blocks  # free blocks after this step's allocations (admission takes from them)
        self.rem_total = 0.0  # SGLang: rem_total_tokens while admitting
        self.evicted = 0  # requests preempted or retracted before this step (the step log's column)
        self.settled = False  # ``free`` counts this iteration's running batch and its tokens
        self.recomputing = False  # some request was preempted: a later prefill may be a recompute
        self.blocked_since = np.full(rec.n, np.nan)  # since when a request waits for memory
        self.decoded = np.zeros(rec.n, np.int64)  # tokens a preempted request had generated

    @classmethod
    def build(cls, cfg: SchedulerConfig, gpu: GpuCosts, live: LiveStep | None, rec: RequestTable,
              batch: RunningBatch, gen_total: np.ndarray) -> KVCache | None:
        """The cache ``cfg`` asks for (``None``: unbounded); in live mode bounded by the live cache too."""
        tokens = configured_capacity(cfg, gpu)
        block = cfg.kv_block_size
        max_seqs = None
        if live is not None:
            if live.kv_block_size != block:
                raise ValueError(f"live mode's KV cache has blocks of {live.kv_block_size} tokens; the policy's "
                                 f"kv_block_size is {block} (build the live step with the policy's)")
            max_seqs = live.kv_requests
            held = live.kv_tokens // block * block
            tokens = held if tokens is None else min(tokens, held)
        if tokens is None:
            return None
        return cls(cfg.kv_cache, tokens, block, max_seqs, rec, batch, gen_total)

    # ---- what the batch holds ------------------------------------------------------------------------------

    def _blocks(self, tokens: np.ndarray) -> np.ndarray:
        b = self.block
        return tokens if b == 1 else (tokens + (b - 1)) // b

    def used_tokens(self) -> int:
        """Token slots in use now (whole blocks)."""
        return (self.blocks - self.free) * self.block

    def too_long(self, spec_tokens: int, prompt: np.ndarray | None = None,
                 gen: np.ndarray | None = None) -> np.ndarray:
        """Per request, whether it can never run: its longest context exceeds the cache, or (SGLang) its
        admission estimate alone reaches it; of every request slot, or of requests of ``prompt`` tokens and
        ``gen`` to generate (requests entering)."""
        if prompt is None:
            prompt, gen = self.rec.prompt_len, self.gen_total
        refused = -(-(prompt + gen + spec_tokens) // self.block) > self.blocks
        if self.policy == "sglang":
            refused |= prompt + np.minimum(gen, SGLANG_CLIP_MAX_NEW_TOKENS) >= self.tokens
        return refused

    def clear(self, rows: np.ndarray) -> None:
        """Request slots ``rows`` are free for other requests."""
        self.blocked_since[rows] = np.nan
        self.decoded[rows] = 0

    def grow(self, n: int, gen_total: np.ndarray) -> None:
        """Room for ``n`` request slots, whose tokens to generate are now ``gen_total``."""
        self.gen_total = gen_total
        more = n - len(self.decoded)
        self.blocked_since = np.concatenate((self.blocked_since, np.full(more, np.nan)))
        self.decoded = np.concatenate((self.decoded, np.zeros(more, np.int64)))

    # ---- vLLM: preemption ----------------------------------------------------------------------------------

    def reserve(self, new: np.ndarray | int) -> bool:
        """Allocate this step's ``new`` tokens of each running row; False (nothing taken) when they do not fit."""
        cached = self.batch.cached
        total = int(_sum(cached)) if self.block == 1 and isinstance(new, int) and new == 0 else \
            int(_sum(self._blocks(cached + new)))
        if total > self.blocks:
            return False
        self.free = self.blocks - total
        self.settled = True
        return True

    def vllm_keep(self, new: np.ndarray | int) -> int:
        """Rows of the running batch (a prefix, in admission order) that keep running when each row
        allocates the blocks of its ``new`` tokens this step; the rest are preempted, from the end."""
        cached = self.batch.cached
        after = self._blocks(cached + new)
        total = int(_sum(after))
        if total <= self.blocks:
            self.free = self.blocks - total
            self.settled = True
            return len(cached)
        kept = int(np.searchsorted(np.add.accumulate(after), self.blocks, side="right"))
        return max(kept, 0)

    # ---- SGLang: decode check and retraction ---------------------------------------------------------------

    def sglang_victims(self, new: np.ndarray | int | None, rows: np.ndarray, decay: bool = True,
                       need: int | None = None) -> np.ndarray:
        """Of the decode ``rows``, those to retract before a decode step whose rows need ``new`` tokens each
        (``need`` in all, when known: ``new`` is then not read with ``block`` 1) (``check_decode_mem``,
        ``retract_decode``), in retraction order; empty when the step fits (``new_token_ratio`` then decays,
        if ``decay``)."""
        batch = self.batch
        cached = batch.cached
        if self.block == 1:
            # (counted before an admission that admitted nothing, this same iteration: the batch is unchanged)
            used = self.blocks - self.free if self.settled else int(_sum(cached))
            if need is None:
                need = int(_sum(new)) if isinstance(new, np.ndarray) else new * len(cached)
            free = self.blocks - used
        else:
            held = self._blocks(cached)
            used = int(_sum(held))
            need = int(_sum(self._blocks(cached + new) - held))
            free = self.blocks - used
        if need <= free:
            self.free = free - need
            self.settled = True
            if decay:
                self.ratio = max(self.ratio - SGLANG_NEW_TOKEN_RATIO_DECAY, SGLANG_MIN_NEW_TOKEN_RATIO)
            return _NO_ROWS
        rows = np.asarray(rows)
        rid = batch.rid[rows]
        decoded = self.gen_total[rid] - batch.gen_left[rows]
        n = len(rid)
        # ascending (decoded, -prompt), ties latest row first: the end of SGLang's stable descending sort,
        # popped first
        order = np.lexsort((-np.arange(n), -self.rec.prompt_len[rid], decoded))
        if n <= 1:
            return _NO_ROWS
        held_rows = self._blocks(cached[rows])[order]
        freed = free * self.block + np.add.accumulate(held_rows[:-1]) * self.block  # free tokens after 1.. victims
        remaining = n - np.arange(1, n)
        enough = np.flatnonzero(freed >= remaining * SGLANG_RETRACT_DECODE_STEPS)
        victims = order[: (int(enough[0]) + 1) if len(enough) else n - 1]
        kept = np.ones(n, bool)
        kept[victims] = False
        self.ratio = min(1.0, (float(_sum(decoded[kept])) + SGLANG_RETRACT_DECODE_STEPS * int(kept.sum()))
                         / max(float(_sum(self.gen_total[rid[kept]])), 1.0))
        return rows[victims]

    def fit_chunks(self, rows: np.ndarray, chunks: np.ndarray, new: np.ndarray | int) -> np.ndarray:
        """Continuing prefill ``chunks`` of ``rows``, first come first served, cut to what the blocks left
        free by every row's ``new`` tokens hold (SGLang truncates a chunk to its remaining tokens)."""
        batch = self.batch
        cached = batch.cached
        free = self.blocks - int(_sum(self._blocks(cached + new)))
        c, left = cached[rows], batch.prefill_left[rows]
        grow = self._blocks(c + chunks + (chunks == left)) - self._blocks(c)
        total = int(_sum(grow))
        self.settled = True
        if total <= free:
            self.free = free - total
            return chunks
        before = np.add.accumulate(grow) - grow
        short = int(np.flatnonzero(before + grow > free)[0])
        chunks = chunks.copy()
        allowed = int(self._blocks(c[short]) * self.block - c[short]) + (free - int(before[short])) * self.block
        chunk = min(int(chunks[short]), allowed)
        if chunk == left[short] and chunk + 1 > allowed:
            chunk -= 1  # the completing chunk's sampled token needs a slot too
        chunks[short] = max(chunk, 0)
        chunks[short + 1:] = 0
        self.free = free - int(_sum(self._blocks(c + chunks + (chunks == left)) - self._blocks(c)))
        return chunks

    def idle(self) -> None:
        """The engine has nothing to run (SGLang resets its estimate)."""
        self.ratio = SGLANG_INIT_NEW_TOKEN_RATIO

    # ---- leaving and admission -----------------------------------------------------------------------------

    def evict(self, rows: np.ndarray, t: float) -> np.ndarray:
        """Preempt or retract running ``rows`` at ``t``: their KV is freed, their tokens will be recomputed as
        a prefill (grammar state and output kept), and they wait for memory. Returns their requests, in order."""
        batch, rec = self.batch, self.rec
        rids = batch.rid[rows]
        self.recomputing = True
        rec.preemptions[rids] += 1
        rec.recomputed_tokens[rids] += batch.cached[rows]
        self.decoded[rids] = self.gen_total[rids] - batch.gen_left[rows]
        self.blocked_since[rids] = t
        self.evicted += len(rids)
        batch.park(rows)
        keep = np.ones(len(batch), bool)
        keep[rows] = False
        batch.keep(np.flatnonzero(keep))
        return rids

    def start_admission(self) -> None:
        """Before admitting waiting requests: the free blocks (when this iteration has not counted them: a
        prefill batch's admission with no prefill in flight), and SGLang's ``rem_total_tokens``."""
        if not self.settled:
            self.reserve(0)
        if self.policy == "sglang":
            batch = self.batch
            left = np.minimum(batch.gen_left, SGLANG_CLIP_MAX_NEW_TOKENS)
            self.rem_total = self.free * self.block - float(_sum(left)) * self.ratio

    def wait(self, rid: int, t: float) -> None:
        """Request ``rid`` waits for memory from ``t`` on (unless it already does)."""
        if math.isnan(self.blocked_since[rid]):
            self.blocked_since[rid] = t

    def admit(self, rid: int, chunk: int, whole: bool, t: float) -> bool:
        """Whether waiting request ``rid`` can start with a prefill chunk of ``chunk`` tokens at ``t`` (its
        blocks are then taken; a ``whole`` prompt's sampled token takes a slot too); a refused request is
        waiting for memory from ``t`` on."""
        blocks = -(-(chunk + whole) // self.block)
        ok = blocks <= self.free
        if ok and self.policy == "sglang":
            rec = self.rec
            done = int(self.decoded[rid])
            total = int(rec.prompt_len[rid]) + done + min(max(int(self.gen_total[rid]) - done, 0),
                                                         SGLANG_CLIP_MAX_NEW_TOKENS)
            ok = total < self.rem_total
            if ok:
                self.rem_total -= total
        if not ok:
            self.wait(rid, t)
            return False
        self.free -= blocks
        since = self.blocked_since[rid]
        if not math.isnan(since):
            self.rec.kv_wait_s[rid] += t - since
            self.blocked_since[rid] = math.nan
        return True


def kv_description(kv: KVCache | None) -> tuple[int | None, str]:
    """A run's KV cache as its summary takes it: capacity in token slots (``None``: unbounded) and policy."""
    return (None, "unbounded") if kv is None else (kv.tokens, kv.policy)


def kv_step_columns(kv: KVCache | None) -> tuple[int, int]:
    """The step log's KV columns: token slots in use, requests preempted or retracted for the step."""
    return (0, 0) if kv is None else (kv.used_tokens(), kv.evicted)
