"""Scheduler policies: the ``sglang`` and ``vllm`` presets of the one scheduler loop.

A policy is only configuration. :class:`SchedulerConfig` names every mechanism
the loop models; :func:`policy` returns a preset with any field overridden:

>>> cfg = policy("sglang", poll_interval_s=0.001)
>>> cfg.grammar_wait, cfg.readiness, cfg.poll_interval_s
('grammar_queue', 'blocking_poll', 0.001)
>>> policy("vllm").fill_parallel_threshold
128

Defaults follow the engines (sources in the project's engine notes):

========================  ===============================  ===============================
mechanism                 sglang                           vllm
========================  ===============================  ===============================
compile pool              ``min(32, cpus + 4)`` threads     ``(cpus + 1) // 2`` threads
compile cache             written at harvest, no in-flight  written when compiled (xgrammar
                          de-dup, failures cached,          cache, LRU of 1000 entries),
                          unbounded                         in-flight shared, hits still
                                                            take a pool round trip
while compiling           separate grammar queue; ready     stays in the waiting queue at
                          requests rejoin at the tail       its place; later ones pass it
readiness                 one blocking poll per iteration   a 100 µs check per unready
                          (5 ms in 0.5 ms naps), timeout    request inspected, no timeout
                          after 10 000 polls
rank sync                 all_gather of (ready, failed)     none (one scheduler)
batching                  prefill and decode batches apart  mixed (chunked prefill)
mask fill                 serial                            parallel above 128 rows, chunks
                                                            of 16 on ``min(cpus//2, 8)``
decode CUDA graphs        1, 2, 4, 8, 12, then every 8     1, 2, 4, every 8 to 248, then
                          to 256                           every 16 to 512
KV cache                  ``mem_fraction_static`` 0.88,    ``gpu_memory_utilization`` 0.9,
                          page 1; decode requests          block 16; the latest admitted
                          retracted when the cache runs    request preempted (recomputed)
                          out; ``new_token_ratio``         when the running ones' blocks
                          admission                        run out
========================  ===============================  ===============================
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SchedulerConfig(BaseModel):
    """Every parameter of the scheduler loop. Times are seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("custom", description="preset this configuration came from")

    # --- continuous batching
    max_running_requests: int = Field(256, ge=1, description="vLLM max_num_seqs / SGLang max_running_requests")
    max_batched_tokens: int = Field(
        8192, ge=1, description="token budget per iteration (vLLM max_num_batched_tokens, SGLang chunked_prefill_size)"
    )
    chunked_prefill: bool = Field(True, description="split prompts longer than the remaining token budget")
    mixed_batches: bool = Field(
        True, description="decode rows and prefill chunks share an iteration (vLLM); False: prefill batches run alone (SGLang)"
    )

    # --- KV cache (cdbench/harness/kv_cache.py)
    kv_cache: Literal["unbounded", "vllm", "sglang"] = Field(
        "unbounded", description="how the KV cache bounds the batch: vllm (admission by free blocks, the latest admitted "
        "request preempted and recomputed when they run out), sglang (admission by new_token_ratio, decode requests "
        "retracted when the cache runs out), unbounded (not modelled; live mode still bounds it by its slot cache)")
    kv_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="share of the GPU's memory for weights and KV cache (vLLM gpu_memory_utilization, "
        "SGLang mem_fraction_static); the cache gets what the weights leave")
    kv_block_size: int = Field(16, ge=1, description="tokens a KV block (vLLM block_size, SGLang page_size)")
    kv_tokens: int | None = Field(
        None, ge=1, description="KV-cache capacity in tokens, instead of deriving it from the GPU's memory")

    # --- compile pool and cache
    compile_threads: int = Field(16, ge=1, description="worker threads of the async compile pool (per rank)")
    cache: bool = Field(True, description="compiled-grammar cache on")
    cache_write: Literal["harvest", "compile"] = Field(
        "compile", description="when a compiled grammar enters the cache: when the scheduler harvests it (SGLang) or when compiling ends (xgrammar's cache)"
    )
    cache_dedup_inflight: bool = Field(True, description="a miss for a key already compiling waits for that compile")
    cache_capacity: int | None = Field(None, ge=1, description="LRU entry limit; None: unbounded")
    cache_failures: bool = Field(False, description="a failed or timed-out key is cached as invalid; later requests abort at once")
    cache_hit_path: Literal["direct", "pool"] = Field(
        "pool", description="a hit is ready at once (SGLang) or still makes a round trip through the compile pool (vLLM)"
    )
    cache_hit_s: float = Field(20e-6, ge=0, description="cost of a cache hit (copy, or the pool task)")

    # --- waiting for the grammar
    grammar_wait: Literal["grammar_queue", "in_place"] = Field(
        "in_place", description="grammar_queue: separate queue, tail on release (SGLang); in_place: keeps its waiting-queue place (vLLM)"
    )
    readiness: Literal["blocking_poll", "per_request_check"] = Field(
        "per_request_check", description="how the scheduler learns a compile finished"
    )
    poll_interval_s: float = Field(0.005, gt=0, description="SGLang: one poll blocks up to this long")
    poll_naps: int = Field(10, ge=1, description="SGLang: readiness checks per poll (naps of interval/naps)")
    poll_early_exit: bool = Field(True, description="SGLang: a poll ends at the first check where everything is ready")
    max_poll_iterations: int | None = Field(
        None, ge=1, description="SGLang: abort after this many polls not ready; None: never time out"
    )
    check_timeout_s: float = Field(100e-6, ge=0, description="vLLM: result(timeout) per unready request inspected")

    # --- ranks
    ranks: int = Field(1, ge=1, description="TP/DP ranks that each compile every grammar and agree by all_gather")
    parallel: Literal["tp", "dp"] = Field(
        "tp", description="what the ranks split: tp (every rank the same batch, each compiling every grammar; "
        "live mode shards the forward, one process and GPU a rank) or dp (requests dealt round robin, each rank "
        "its own batch and grammars, no agreement)")
    rank_jitter: float = Field(0.0, ge=0, description="per-rank compile-time jitter: lognormal sigma")
    rank_jitter_by_size: tuple[tuple[float, float], ...] | None = Field(
        None, description="per-rank compile-time jitter by the compile's size: (seconds, lognormal sigma) points, "
        "a compile's sigma interpolated at its seconds in log seconds, flat beyond the points (measured by a live "
        "tensor-parallel run: costs.rank_costs); None: rank_jitter for every compile")
    rank_compile_scale: tuple[float, ...] | None = Field(
        None, description="per-rank compile-time factors, one per rank (e.g. a slow rank); None: all 1"
    )
    rank_fill_jitter: float = Field(
        0.0, ge=0, description="tp ranks: lognormal sigma of another rank's mask fill of a step over rank 0's (the "
        "fill the grammar costs price), the step waiting for the slowest rank's (model and hybrid mode; measured by "
        "live mode's ranks: live.json's ranks.fill_sigma)")
    rank_fill_offset: float = Field(
        0.0, description="tp ranks: mean log of another rank's mask fill of a step over rank 0's (a rank whose host "
        "fills faster, < 0, or slower throughout; live.json's ranks.fill_offset)")
    rank_fill_ratios: tuple[tuple[float, float], ...] | None = Field(
        None, description="tp ranks: the steps of a measured tp run as (rank 0's fill s, the slowest rank's fill over "
        "rank 0's); a step waits for its fill times the ratio of one of the measured steps whose rank-0 fill is "
        "nearest its own (replaces rank_fill_offset and rank_fill_jitter; costs.rank_costs=live-run: sets it)")
    # measured: the median grammar all_gather_object (gloo, two rank processes) of two TP=2 live runs on 2 H200s,
    # 0.676 and 0.820 ms (reports/fidelity/live_vs_model.md, "Multi-GPU"; campaigns/ranks_vs_model.yaml)
    all_gather_s: float = Field(7.5e-4, ge=0, description="cost of one all_gather_object of (ready, failed) when ranks > 1")
    collectives: Literal["model", "gloo", "nccl"] = Field(
        "model", description="ranks' agreement: model (all_gather_s), or gloo / nccl (one local process per rank, a "
        "real all_gather_object whose measured time the step pays; hybrid mode (live mode's ranks are processes "
        "of their own, agreeing over gloo); nccl: a GPU per rank)")

    # --- the engine's own host CPU (measured from its code: reports/engine_costs/)
    schedule_s: float = Field(0.0, ge=0, description="CPU per iteration to form the batch")
    schedule_row_s: float = Field(0.0, ge=0, description="CPU per running row to form the batch")
    process_step_s: float = Field(0.0, ge=0, description="CPU per iteration to process the sampled results")
    process_row_s: float = Field(0.0, ge=0, description="CPU per sampled row to process results (detokenize, stop checks)")
    accept_row_s: float = Field(
        0.0, ge=0, description="CPU per structured sampled row in result processing: the engine's accept path around the grammar"
    )
    fill_step_s: float = Field(0.0, ge=0, description="CPU per iteration with mask rows: the engine's mask-building wrapper")
    fill_row_s: float = Field(
        0.0, ge=0, description="CPU per structured row the engine's wrapper adds to the grammar's own fill (holds the GIL: serial)"
    )
    mask_alloc_byte_s: float = Field(0.0, ge=0, description="CPU per byte of a mask allocated each iteration over the batch's rows")
    mask_build_byte_s: float = Field(
        0.0, ge=0, description="CPU per byte of the bitmask array the model runner builds after the forward's launch, "
        "before its copy, of every copied row (mask_copy_rows; vLLM 0.10 / 0.11: np.full of -1 each step): beside "
        "the forward, wherever the fill runs")
    mask_scatter_byte_s: float = Field(
        0.0, ge=0, description="CPU per byte of the mask rows the model runner copies into that array (one NumPy row "
        "assignment a structured row, with its index), beside the forward with mask_build_byte_s")
    sample_prep_s: float = Field(
        0.0, ge=0, description="CPU per step of the sampler's host work between the logits processors and its first "
        "GPU sync (vLLM V0's Sampler: SamplingTensors from the sampling metadata, the sampling kernels' calls): it "
        "runs beside the forward, unless a blocking per-row bitmask copy (mask_apply per_row, pinned_mask false) "
        "made the host wait out the forward, then after it (without overlap; in the step's duration and CPU, no "
        "step-log column of its own)")
    sample_prep_row_s: float = Field(0.0, ge=0, description="sample_prep_s's CPU per sampled row")
    sample_launch_s: float = Field(
        0.0, ge=0, description="host seconds per step of the sampler's calls before its GPU sync that launch GPU work "
        "(V0's Sampler on a GPU: its sampling tensors' pinned staging and copies, the logits' kernels), which a CPU "
        "measurement cannot time; paid where sample_prep_s is")
    sample_launch_row_s: float = Field(0.0, ge=0, description="sample_launch_s's host seconds per sampled row")
    row_launch_s: float = Field(
        0.0, ge=0, description="mask_apply per_row: host seconds per mask row of its launches after its copy (V0: "
        "xgrammar's apply kernel through Triton's launcher, the row's write-back into the logits), with its row: "
        "after the forward behind a blocking copy, beside it otherwise")
    mask_transfer: Literal["none", "ipc"] = Field(
        "none", description="none: the sampling worker shares the scheduler's process; ipc: the bitmask is serialized to it"
    )
    ipc_s: float = Field(0.0, ge=0, description="ipc: CPU per message carrying the bitmask (send and receive)")
    ipc_byte_s: float = Field(0.0, ge=0, description="ipc: CPU per bitmask byte (serialize, shared-memory copy, deserialize)")

    # --- the host's cores (cdbench/harness/contention.py)
    host_cpus: int = Field(
        32, ge=1, description="CPUs of the engine host, shared by the compile pool, the fill pool and the scheduler "
        "loop (the presets size their pools from it: policy.host_cpus)"
    )
    host_contention: bool = Field(
        True, description="when compiles, fill threads and the scheduler loop outnumber host_cpus, a step's host CPU "
        "work and a starting compile stretch by demand / cores (processor sharing); False: never"
    )
    compile_cores: float = Field(
        1.0, gt=0, description="cores one running compile keeps busy (xgrammar's compiler runs threads of its own)"
    )

    # --- mask building
    fill_parallel_threshold: int | None = Field(
        None, ge=0, description="fill in parallel when more structured rows than this (and no spec); None: always serial"
    )
    fill_chunk: int = Field(16, ge=1, description="requests per parallel fill task")
    fill_threads: int = Field(8, ge=1, description="threads of the parallel fill pool")
    accept_parallel: bool = Field(
        False, description="a step that fills in parallel also accepts its sampled tokens on the fill pool, in "
        "chunks of fill_chunk (llguidance's LLExecutor.consume_token_par; no engine preset does: vLLM and SGLang "
        "accept row by row); False: one accept after another (model mode)")
    pinned_mask: bool = Field(True, description="bitmask in pinned host memory (non-blocking copy)")
    pageable_staged_bytes: int | None = Field(
        None, ge=0, description="mask_apply batched, pinned_mask false: a non-blocking copy from pageable memory of at "
        "most this many bytes is staged by the CUDA driver at once, so its host goes on and only the GPU copies after "
        "the forward; a larger one holds its host until the forward is done (None: every one holds it)")
    mask_copy_rows: Literal["mask", "batch"] = Field(
        "mask", description="rows of the bitmask copied to the GPU in a step with mask rows: mask (those rows "
        "alone) or batch (every sampled row of the step: vLLM V1's apply_grammar_bitmask of 0.10 / 0.11 scatters "
        "the structured rows into an array of every logits row, -1 elsewhere, and copies all of it; the apply "
        "still covers the mask rows, by index). The bitmask crossing to another process (mask_transfer ipc) is "
        "the compact one either way (model and hybrid mode, mask_apply batched)")
    fill_beside_forward: bool = Field(
        True, description="without overlap, the mask fill and copy run while the forward runs (vLLM V1 since its "
        "async-scheduling rework); False: they run before it, on the step's critical path (vLLM V1 before it; V0's "
        "logits processors: mask_apply per_row)"
    )
    mask_apply: Literal["batched", "per_row"] = Field(
        "batched", description="batched: one bitmask of every mask row copied and applied at once; per_row: vLLM "
        "V0's per-sequence logits processors, each row filled, copied and applied alone after the forward's launch "
        "(a copy and an apply kernel a row); with pinned_mask false each row's copy blocks the host until the GPU has "
        "run what was queued before it (V0 before its non-blocking copy), so the fills after the first row and every "
        "copy run after the forward, in turn with the GPU (model and hybrid mode, without overlap)"
    )

    abort_on_reject: bool = Field(
        False, description="a token the grammar rejects aborts the request (SGLang); False: logged and ignored (vLLM)"
    )

    # --- pipeline
    overlap: bool = Field(True, description="overlap scheduling (SGLang) / async scheduling (vLLM)")
    sample_beside_schedule: bool = Field(
        False, description="with overlap, where the loop waits on a pageable bitmask copy (pinned_mask false, "
        "mask_transfer none): the loop returns once the copy is done and the apply and sampling run on the GPU while "
        "it schedules and launches the next step (vLLM #26866's async loop: sample_tokens returns before the sampled "
        "tokens are out); False: the step ends after its sampling")
    spec_grammar_overlap: bool = Field(
        True, description="with spec decoding, grammar CPU work still overlaps the verify forward; False: serialise such steps"
    )
    launch_s: float = Field(
        0.0, ge=0, description="host time per step that nothing hides: staging the forward's inputs, launching it, "
        "waking when its tokens are out (the GPU waits meanwhile)"
    )
    launch_prefill_s: float | None = Field(
        None, ge=0, description="launch_s of a step with prefill chunks, whose graph needs no decode inputs staged "
        "(None: launch_s)"
    )
    launch_row_s: float = Field(
        0.0, ge=0, description="host time per sampled row added to the launch: live mode's own loop stages and "
        "books each row around the step (fitted from a live run's steps by costs.host_costs=live-run:...; 0 in the "
        "presets, whose launch is a median over a live run's steps)"
    )
    cuda_graph_sizes: tuple[int, ...] = Field(
        (), description="decode query-token counts with a captured CUDA graph: a step of decode rows only runs padded "
        "up to the next size (each padding token attends to one key); beyond the largest, or with none, at its own size"
    )

    # --- speculative decoding, reasoning, jump-forward
    spec_tokens: int = Field(0, ge=0, description="draft tokens per request per step (1 + k mask rows)")
    spec_drafter: Literal["external", "mtp"] = Field(
        "external", description="who drafts: external (no forward cost) or mtp (the model's MTP head: its "
        "passes priced in each step's forward)")
    strict_thinking: bool = Field(False, description="while thinking, structured rows carry a token-filter mask")
    think_filter_s: float = Field(5e-6, ge=0, description="CPU per token-filter row (strict thinking, forced think-end)")
    jump_forward: bool = Field(False, description="what-if: tokens the grammar forces are emitted without a forward step")

    # --- idle
    idle_spin_s: float = Field(
        50e-6, gt=0, description="shortest iteration while requests wait but nothing can run (the loop spins)"
    )

    @property
    def sampler_host(self) -> bool:
        """Whether V0's sampler host work up to its GPU sync is priced (its CPU work or its launches)."""
        return bool(self.sample_prep_s or self.sample_prep_row_s or self.sample_launch_s or self.sample_launch_row_s)

    @model_validator(mode="after")
    def _check(self) -> SchedulerConfig:
        if self.rank_compile_scale is not None and len(self.rank_compile_scale) != self.ranks:
            raise ValueError(f"rank_compile_scale has {len(self.rank_compile_scale)} factors for {self.ranks} ranks")
        sizes = self.cuda_graph_sizes
        if any(n < 1 for n in sizes) or any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"cuda_graph_sizes must be positive and strictly increasing, got {list(sizes)}")
        if self.mask_apply == "per_row" and (self.overlap or not self.fill_beside_forward):
            raise ValueError("mask_apply 'per_row' is V0's logits processors, run after the forward's launch in a "
                             "loop without overlap: set overlap=false and fill_beside_forward=true")
        if self.sampler_host and (self.overlap or not self.fill_beside_forward):
            raise ValueError("sample_prep_s / sample_prep_row_s / sample_launch_s / sample_launch_row_s price V0's "
                             "sampler after the forward's launch in a loop without overlap: set overlap=false and "
                             "fill_beside_forward=true")
        if self.mask_copy_rows == "batch" and self.mask_apply == "per_row":
            raise ValueError("mask_copy_rows 'batch' is V1's one bitmask of the batch: per_row copies a row at a time")
        if self.row_launch_s and self.mask_apply != "per_row":
            raise ValueError("row_launch_s prices V0's per-row launches: set mask_apply='per_row'")
        if self.accept_parallel and self.fill_parallel_threshold is None:
            raise ValueError("accept_parallel spreads the accepts over the parallel fill pool: set fill_parallel_threshold")
        if self.readiness == "blocking_poll" and self.grammar_wait != "grammar_queue":
            raise ValueError("readiness 'blocking_poll' polls the grammar queue: set grammar_wait='grammar_queue'")
        return self


def _sglang(cpus: int) -> dict:
    return dict(
        name="sglang",
        host_cpus=cpus,
        max_running_requests=256,
        max_batched_tokens=8192,
        mixed_batches=False,
        compile_threads=min(32, cpus + 4),
        cache_write="harvest",
        cache_dedup_inflight=False,
        cache_failures=True,
        cache_hit_path="direct",
        cache_hit_s=5e-6,
        grammar_wait="grammar_queue",
        readiness="blocking_poll",
        max_poll_iterations=10_000,
        fill_parallel_threshold=None,
        spec_grammar_overlap=False,
        abort_on_reject=True,
        # the host's launch of a step (inputs staged, the graph replayed, the wake-up on the sampled tokens): the
        # engines' worker side needs a CUDA host and did not run (reports/engine_costs), so this is cdbench's live
        # executor, measured on an H100 host: the medians over a live run's decode steps and its steps with prefill
        # chunks (reports/live/launch_h100.csv, benchmarks/live_launch_cost.py)
        launch_s=3.278e-4,
        launch_prefill_s=1.617e-4,
        # ServerArgs.__post_init__ (python/sglang/srt/server_args.py): mem_fraction_static 0.88 at tp_size 1 (later
        # versions derive it from the GPU's memory less a reserve, about the same on an 80 GB GPU); page_size 1
        kv_cache="sglang",
        kv_memory_fraction=0.88,
        kv_block_size=1,
        # ServerArgs' default capture list without spec decoding, up to cuda_graph_max_bs 256 (one GPU of 80 GB)
        cuda_graph_sizes=(1, 2, 4, 8, 12, *range(16, 257, 8)),
        # host costs of sglang 0.5.23 with xgrammar 0.2.7 (reports/engine_costs/fitted.json, "sglang" entries, then
        # fit.py): SamplingBatchInfo.update_regex_vocab_mask (scripts/engine_costs/measure_sglang.py: the mask of
        # every batch row allocated each step, the wrapper per structured row) ...
        fill_step_s=2.866e-06,
        fill_row_s=1.419e-06,
        mask_alloc_byte_s=1.274e-10,
        # ... and the scheduler's decode steps with torchvision stubbed (measure_sglang_scheduler.py): batch forming
        # (ScheduleBatch.merge_batch + filter_batch + check_decode_mem + prepare_for_decode) per step and row, and
        # SchedulerBatchResultProcessor.process_batch_result_decode per row and per structured row (its grammar
        # accept path: _accept_grammar_tokens and grammar.finished), less xgrammar's own accept_token (measured
        # apart in the same environment, measure_grammar_accept.py: 3.484e-06), which model mode charges from the
        # grammar profile. process_step_s: the fit's intercept is 0 (below 0 unconstrained)
        schedule_s=3.278e-05,
        schedule_row_s=2.238e-06,
        process_step_s=0.0,
        process_row_s=6.729e-06,
        accept_row_s=7.876e-06,
        # the worker samples in the scheduler's process; with mask_transfer="ipc", vLLM's measured queue
        ipc_s=0.0003642,
        ipc_byte_s=2.526e-10,
    )


def _vllm(cpus: int) -> dict:
    return dict(
        name="vllm",
        host_cpus=cpus,
        max_running_requests=256,
        max_batched_tokens=8192,
        mixed_batches=True,
        compile_threads=max(1, (cpus + 1) // 2),
        cache_write="compile",
        cache_dedup_inflight=True,
        cache_capacity=1000,  # engine default: a 512 MB xgrammar compiler cache, about 1000 JSON schemas
        cache_failures=False,
        cache_hit_path="pool",
        grammar_wait="in_place",
        readiness="per_request_check",
        max_poll_iterations=None,
        fill_parallel_threshold=128,
        fill_chunk=16,
        fill_threads=max(1, min(cpus // 2, 8)),
        spec_grammar_overlap=True,
        # the host's launch of a step (inputs staged, the graph replayed, the wake-up on the sampled tokens): the
        # engines' worker side needs a CUDA host and did not run (reports/engine_costs), so this is cdbench's live
        # executor, measured on an H100 host: the medians over a live run's decode steps and its steps with prefill
        # chunks (reports/live/launch_h100.csv, benchmarks/live_launch_cost.py)
        launch_s=3.278e-4,
        launch_prefill_s=1.617e-4,
        # CacheConfig (vllm/config/cache.py): gpu_memory_utilization 0.9, block_size 16 on CUDA
        kv_cache="vllm",
        kv_memory_fraction=0.9,
        kv_block_size=16,
        # CompilationConfig's default capture sizes, up to min(2 * max_num_seqs, 512)
        cuda_graph_sizes=(1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)),
        # host costs of vllm 0.32.0 with xgrammar 0.2.8 (reports/engine_costs/fitted.json, "vllm" entries;
        # scripts/engine_costs/measure_vllm.py, then fit.py): Scheduler.schedule per iteration and row,
        # StructuredOutputManager.grammar_bitmask beyond the matchers' own fills, Scheduler.update_from_output
        # per iteration, row and structured row, and the executor's MessageQueue carrying the bitmask.
        # accept_row_s: update_from_output's accept path less xgrammar's own accept_token (measured apart in the
        # same environment, measure_grammar_accept.py), which model mode charges from the grammar profile
        schedule_s=8.02e-05,
        schedule_row_s=1.066e-05,
        process_step_s=2.033e-05,
        process_row_s=6.047e-06,
        accept_row_s=7.121e-06,
        fill_step_s=0.000227,
        fill_row_s=4.876e-06,
        # one GPU runs the uniprocess executor (no serialization); tensor parallelism or
        # distributed_executor_backend="mp" sends the bitmask through the queue: mask_transfer="ipc"
        mask_transfer="none",
        ipc_s=0.0003642,
        ipc_byte_s=2.526e-10,
    )


def _vllm_0_10(cpus: int) -> dict:
    """vLLM 0.10.1.1's V1 engine, the version behind the published results of mid-2025 (its code read and its host
    costs measured in its own environment: ``.venv-engines/vllm-0.10.1``, ``reports/engine_costs/``)."""
    return dict(
        _vllm(cpus),
        name="vllm-0.10",
        # EngineArgs' defaults of the OpenAI server on a GPU of 70 GiB or more: max_num_seqs 1024 (max_num_batched_tokens
        # 8192 as today), capture sizes [1, 2, 4] + every 8 up to min(2 * max_num_seqs, 512)
        max_running_requests=1024,
        cuda_graph_sizes=(1, 2, 4, *range(8, 513, 8)),
        # Scheduler.schedule() calls StructuredOutputManager.grammar_bitmask before the step is launched, and
        # async scheduling is opt-in (SchedulerConfig.async_scheduling = False)
        fill_beside_forward=False,
        overlap=False,
        # GPUModelRunner.apply_grammar_bitmask copies the batch's bitmask to the GPU from a NumPy array (pageable
        # memory) with non_blocking=True, which CUDA runs after the forward queued before it, the host waiting
        # (vLLM pins it since 0.24: PIN_MEMORY in vllm/v1/structured_output/utils.py). That array is np.full over
        # every logits row (-1: all allowed) with the structured rows scattered in, so once any row is structured
        # the copy's bytes follow the batch (0.10.1's GPUModelRunner.apply_grammar_bitmask; the same code in
        # vllm/v1/structured_output/utils.py of #26866's October 2025). The host's np.full and scatter, after the
        # forward's launch, are those steps timed on this CPU (measure_vllm_bitmask_build.py, fit.py: per byte of
        # the array and per byte scattered in)
        pinned_mask=False,
        # torch's .to(device, non_blocking=True) from pageable memory behind 20 ms of queued GPU work, on an H100 host
        # (torch 2.11, CUDA 13.0, driver 580): up to 1.99 MiB the host returned in 0.3 ms, from 2.17 MiB it waited out
        # the queue (reports/engine_costs/README.md, "The pageable copy on a GPU host"): the driver's 2 MiB staging
        pageable_staged_bytes=2 * 1024 * 1024,
        mask_copy_rows="batch",
        mask_build_byte_s=6.112e-11,
        mask_scatter_byte_s=1.361e-10,
        # with --async-scheduling (uniprocess), #26866's EngineCore.step_with_batch_queue calls sample_tokens, whose
        # model runner returns after the pageable copy (which held it until the forward was done) and the sampling's
        # launch, its tokens copied back on a stream of their own (AsyncGPUModelRunnerOutput): the loop schedules and
        # launches the next step while the GPU applies the bitmask and samples
        sample_beside_schedule=True,
        # host costs of vllm 0.10.1.1 with xgrammar 0.1.21 (reports/engine_costs/fitted.json, "vllm-0.10" entries;
        # scripts/engine_costs/measure_vllm.py in its environment, then fit.py). process_step_s: the fit's intercept
        # is 0 (update_from_output grows with the rows from 32 rows up); accept_row_s without xgrammar's own accept,
        # as in the vllm preset
        schedule_s=3.963e-05,
        schedule_row_s=6.903e-06,
        process_step_s=0.0,
        process_row_s=3.771e-06,
        accept_row_s=5.52e-06,
        fill_step_s=0.000214,
        fill_row_s=4.741e-06,
        # the bitmask rides in SchedulerOutput's execute_model message when the multiprocess executor runs
        ipc_s=0.0002272,
        ipc_byte_s=3.518e-10,
    )


def _vllm_0_6(cpus: int) -> dict:
    """vLLM 0.6.6.post1's V0 engine (December 2024, the version of the published V0 results): a logits processor
    per structured sequence (its code read and its per-row host path and its sampler's host work measured in its
    own environment: ``.venv-engines/vllm-0.6.6``, ``reports/engine_costs/``). V0's scheduler and output processing
    were not measured: their costs stay the ``vllm`` preset's (V1's)."""
    return dict(
        _vllm(cpus),
        name="vllm-0.6",
        # LogitsProcessor._apply_logits_processors calls each row's XGrammarLogitsProcessor after the forward's
        # launch, no async scheduling, no fill pool; the processor copies its bitmask with a blocking
        # .to(scores.device) (non-blocking since vLLM 0.7.1, #12563)
        overlap=False,
        fill_beside_forward=True,
        mask_apply="per_row",
        pinned_mask=False,
        fill_parallel_threshold=None,
        # EngineArgs: max_num_seqs 256 without V1; VllmConfig's V0 capture sizes [1, 2, 4] + every 8 up to 256
        max_running_requests=256,
        cuda_graph_sizes=(1, 2, 4, *range(8, 257, 8)),
        # the loop and the processor's call around the grammar, per step and per structured row (fitted.json
        # "vllm-0.6": measure_vllm_v0_processor.py, then fit.py); V1's accept path (update_from_output) does not
        # exist in V0: the accept is the grammar's own, inside the processor
        fill_step_s=3.179e-05,
        fill_row_s=3.822e-05,
        accept_row_s=0.0,
        # the sampler's host work up to its GPU sync, per step and per sampled row, greedy rows, less the calls that
        # launch GPU work (fitted.json "vllm-0.6": measure_vllm_v0_processor.py --part sampler, then fit.py)
        sample_prep_s=5.491e-05,
        sample_prep_row_s=2.213e-06,
        # what those calls that launch GPU work, and each row's apply kernel and write-back, cost the host on a GPU
        # (fitted.json "vllm-0.6": benchmarks/gpu_launch_costs.py on an H200, idle rows of
        # reports/engine_costs/vllm-0.6.6_v0_gpu_launch.csv.gz, then fit.py)
        sample_launch_s=0.0001858,
        sample_launch_row_s=8.989e-07,
        row_launch_s=7.654e-05,
    )


PRESETS = {"sglang": _sglang, "vllm": _vllm, "vllm-0.10": _vllm_0_10, "vllm-0.6": _vllm_0_6}

#: the engines' own host costs, measured from their code (``reports/engine_costs/``), and the step's launch
#: (measured from live mode, ``reports/live/launch_h100.csv``); zero them to see the grammar and GPU costs alone
HOST_COST_FIELDS = ("schedule_s", "schedule_row_s", "process_step_s", "process_row_s", "accept_row_s", "fill_step_s",
                    "fill_row_s", "mask_alloc_byte_s", "mask_build_byte_s", "mask_scatter_byte_s", "sample_prep_s",
                    "sample_prep_row_s", "sample_launch_s", "sample_launch_row_s", "row_launch_s", "ipc_s",
                    "ipc_byte_s", "launch_s", "launch_prefill_s", "launch_row_s")


def policy(name: str, host_cpus: int = 32, /, **overrides: object) -> SchedulerConfig:
    """The preset ``name`` for an engine host with ``host_cpus`` CPUs, with ``overrides`` applied.

    An override of the field ``host_cpus`` (as a dumped configuration holds)
    takes the argument's place, so the preset's pools are sized for it too:

    >>> policy("vllm", 32, host_cpus=4).compile_threads
    2

    Raises ``KeyError`` for an unknown preset and pydantic's ``ValidationError``
    for an unknown or invalid override.
    """
    if name not in PRESETS:
        raise KeyError(f"unknown scheduler policy {name!r}; known: {', '.join(sorted(PRESETS))}")
    return SchedulerConfig(**{**PRESETS[name](overrides.get("host_cpus", host_cpus)), **overrides})


def graph_size(sizes: Sequence[int], tokens: int) -> int | None:
    """The captured size a decode step of ``tokens`` query tokens replays: the smallest of ``sizes``
    (ascending) that holds them, or ``None`` beyond the largest (the step runs at its own size).

    >>> graph_size(policy("sglang").cuda_graph_sizes, 9), graph_size((1, 2, 4), 5)
    (12, None)
    """
    i = bisect_left(sizes, tokens)
    return sizes[i] if i < len(sizes) else None


def padded_decode(sizes: Sequence[int], tokens: int, context_tokens: int) -> tuple[int, int]:
    """A decode-only step's ``(tokens, context_tokens)`` as its graph replay costs them. The replay runs
    :func:`graph_size` rows, but the engines (and live mode) fill the padding rows with one token id at one
    position: a memory-bound decode reads the weights once whatever the rows, and the padding routes
    through a MoE's experts as one more token, so the padding costs one row, each padding token attending
    to one key (unchanged beyond the largest size). Measured on the live MoE: a step of 5 rows in the
    graph of 8 costs 13.4 ms, 4 rows 11.7 and 8 rows 15.2 (qwen3-30b-a3b on an H200,
    ``reports/fidelity/live_vs_model.md``, "A graph's padding rows").

    >>> padded_decode((1, 2, 4), 3, 300), padded_decode((1, 8), 5, 500), padded_decode((1, 2, 4), 5, 500)
    ((4, 301), (6, 503), (5, 500))
    """
    padded = graph_size(sizes, tokens) or tokens
    return min(padded, tokens + 1), context_tokens + padded - tokens
