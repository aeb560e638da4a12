"""Time SGLang's batch forming and batch result processing per engine step, on this CPU (run in .venv-engines/sglang).

``sglang.srt.managers.schedule_batch`` imports torchvision (through its multimodal helpers), and no CPU
torchvision installs here, so torchvision is replaced by a recording import stub (``import_stub.py``)
before SGLang is imported; every measured step runs in the stub's ``measure`` phase and the script
refuses to write anything if the stub was used there.

Real objects throughout, on the CPU: ``ServerArgs`` published as the scheduler's, ``ModelConfig`` of a
local Llama config, ``ReqToTokenPool``, an ``MHATokenToKVPool`` with its ``TokenToKVPoolAllocator``
(one layer, one head: the allocator's bookkeeping does not depend on the KV's size), ``RadixCache``,
``Req`` objects with the grammars of ``XGrammarGrammarBackend`` for the structured rows, and the
scheduler's own result processor (``SchedulerBatchResultProcessor`` with the real metrics reporter,
beam coordinator and output streamer, whose ``send_to_detokenizer`` is a zmq PUSH socket drained by a
PULL socket off the clock). The model is replaced by its output: each row's next token is the next
token of a validated instance of its schema (``export_requests.py``), or a random token for a free row.
``enable_overlap`` is off (the normal event loop); one request per row, a closed loop of ``batch`` rows.

Per step it times CPU seconds (``time.thread_time``), one torch thread:

- a decode step's ``schedule``: what ``Scheduler.update_running_batch`` does without retraction, plus the
  merge of the last prefill batch (``get_next_batch_to_run``): ``merge_batch``, ``filter_batch``,
  ``check_decode_mem``, ``prepare_for_decode``;
- a prefill step's ``schedule`` (the finished rows' replacements): ``_get_new_batch_prefill_raw``'s core,
  a ``PrefillAdder`` with ``init_next_round_input`` + ``add_one_req`` per waiting request, then
  ``ScheduleBatch.init_new`` and ``prepare_for_extend``;
- ``process``: ``process_batch_result_decode`` / ``process_batch_result_prefill`` (token append, finish
  checks, KV release into the radix cache, grammar accept for structured rows, streaming the outputs).

    .venv-engines/sglang/bin/python scripts/engine_costs/measure_sglang_scheduler.py \
        --requests /tmp/engine_requests.json --out reports/engine_costs/sglang_scheduler_steps.csv.gz
"""

from __future__ import annotations

import os
import sys

# ruff: noqa: E402  (SGLang is imported after the stub is installed)
from import_stub import RecordingStub

STUB = RecordingStub.install("torchvision")  # before anything imports SGLang

import tempfile
import time
from array import array
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import zmq
from measure_sglang import engine_meta, grammar_for, grid_backends
from sglang.srt.beam_search.coordinator import BeamCoordinator
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.managers.scheduler_components.batch_result_processor import (
    SchedulerBatchResultProcessor,
)
from sglang.srt.managers.scheduler_components.logprob_result_processor import (
    SchedulerLogprobResultProcessor,
)
from sglang.srt.managers.scheduler_components.metrics_reporter import (
    SchedulerMetricsReporter,
)
from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
from sglang.srt.managers.scheduler_components.output_streamer import (
    SchedulerOutputStreamer,
)
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
from sglang.srt.runtime_context import SpawnRanks, get_disagg, publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from step_grid import grid_parser, grid_points, load_requests, model_dir, write_rows  # (this folder's shared grid)

PROMPT = 32
KV_TOKENS = 400_000
FIELDS = ["engine", "version", "backend", "backend_version", "vocab", "batch", "share", "step", "kind", "rows",
          "structured_rows", "schedule_s", "process_s"]


class Engine:
    """The scheduler's pools, cache, batch and result processor, built as ``Scheduler.__init__`` builds them."""

    def __init__(self, model: Path, batch: int):
        sa = ServerArgs(model_path=str(model), device="cpu", disable_cuda_graph=True, skip_server_warmup=True,
                        max_running_requests=batch)
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))  # as the launcher places a 1-GPU scheduler
        self.model_config = ModelConfig.from_server_args(sa)
        disagg = DisaggregationMode(get_disagg().disaggregation_mode)
        self.req_pool = ReqToTokenPool(size=batch + 8, max_context_len=self.model_config.context_len + 4,
                                       device="cpu", enable_memory_saver=False)
        kv = MHATokenToKVPool(KV_TOKENS, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=8, layer_num=1,
                              device="cpu", enable_memory_saver=False)
        self.allocator = TokenToKVPoolAllocator(KV_TOKENS, dtype=torch.bfloat16, device="cpu", kvcache=kv,
                                                need_sort=False)
        self.tree_cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=self.req_pool,
                                                     token_to_kv_pool_allocator=self.allocator, page_size=1))
        self.spec = SpeculativeAlgorithm.NONE
        ctx = SchedulerMetricsCollector.init_new(server_args=sa, enable_priority_scheduling=False, enable_lora=False,
                                                 enable_hierarchical_cache=False)
        self.zctx = zmq.Context()
        push, self.pull = self.zctx.socket(zmq.PUSH), self.zctx.socket(zmq.PULL)
        self.push = push
        address = f"ipc://{tempfile.mkdtemp()}/detokenizer"  # the engine's detokenizer channel is an ipc socket
        self.pull.bind(address)
        push.connect(address)
        self.device = "cpu"
        reporter = SchedulerMetricsReporter(scheduler=self, metrics_collector_context=ctx,
                                            metrics_collector=ctx.collector)
        streamer = SchedulerOutputStreamer(send_to_detokenizer=SenderWrapper(push), tree_cache=self.tree_cache, server_args=sa,
                                           is_generation=True, spec_algorithm=self.spec,
                                           disaggregation_mode=disagg,
                                           enable_hicache_storage=lambda: False)
        beams = BeamCoordinator(model_config=self.model_config, spec_algorithm=self.spec, dllm_enabled=False,
                                max_req_len=self.model_config.context_len, req_to_token_pool=self.req_pool,
                                token_to_kv_pool_allocator=self.allocator, tree_cache=self.tree_cache, future_map=None)
        self.processor = SchedulerBatchResultProcessor(
            is_generation=True, disaggregation_mode=disagg, enable_overlap=False,
            enable_overlap_mlx=False, model_config=self.model_config, token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree_cache, hisparse_coordinator=None, req_to_token_pool=self.req_pool,
            decode_offload_manager=None, metrics_collector=ctx.collector, metrics_reporter=reporter, draft_worker=None,
            model_worker=None, logprob_result_processor=SchedulerLogprobResultProcessor(model_config=self.model_config),
            output_streamer=streamer, beam_coordinator=beams, abort_request=None)
        self.tp_worker = self.draft_worker = None

    def new_batch(self, reqs: list) -> ScheduleBatch:
        return ScheduleBatch.init_new(reqs, self.req_pool, self.allocator, self.tree_cache, self.model_config, False,
                                      self.spec)

    def drain(self) -> None:
        while self.pull.poll(0):
            self.pull.recv()

    def close(self) -> None:
        """Close the channel (a context with unsent messages would wait for ever when collected)."""
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.zctx.term()


def run_case(engine: Engine, backend, pool, batch, share, steps, warmup, rng, vocab, eos, rows_out, meta):
    made = 0
    plans: dict[str, list[int]] = {}

    def fresh() -> Req:
        nonlocal made
        structured = rng.random() < share
        grammar, toks = None, None
        while structured:  # a schema the backend refuses is aborted before it reaches a batch, as in the engine
            item = pool[int(rng.integers(len(pool)))]
            g = grammar_for(backend, item["schema"])
            if not isinstance(g, InvalidGrammarObject):
                grammar, toks = g, list(item["tokens"])
                break
        if toks is None:
            toks = [int(t) for t in rng.integers(2, 30000, int(rng.integers(16, 200)))]
        sp = SamplingParams(max_new_tokens=len(toks), temperature=0.0, ignore_eos=grammar is None,
                            json_schema="{}" if grammar is not None else None)
        sp.normalize(None)
        req = Req(f"r{made}", "", array("q", rng.integers(2, 30000, PROMPT).tolist()), sp, eos_token_ids={eos},
                  vocab_size=vocab)
        req.grammar = grammar
        plans[req.rid] = toks
        made += 1
        return req

    waiting = [fresh() for _ in range(batch)]
    running: ScheduleBatch | None = None
    last_prefill: ScheduleBatch | None = None

    def next_tokens(reqs: list) -> torch.Tensor:
        return torch.tensor([plans[r.rid][len(r.output_ids)] for r in reqs], dtype=torch.int64)

    for step in range(warmup + steps):
        STUB.phase("measure")
        if waiting:  # SGLang runs a prefill batch alone whenever requests wait
            t0 = time.thread_time()
            adder = PrefillAdder(1, engine.tree_cache, engine.allocator, running or engine.new_batch([]), 0.7,
                                 rem_input_tokens=16384, rem_chunk_tokens=8192, max_running_requests=batch)
            admitted = []
            for req in waiting:
                req.init_next_round_input(engine.tree_cache)
                if adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) != AddReqResult.CONTINUE:
                    break
            admitted = adder.can_run_list
            work = engine.new_batch(admitted)
            work.prepare_for_extend()
            t_sched = time.thread_time() - t0
            waiting = waiting[len(admitted):]
            kind = "prefill"
        else:
            t0 = time.thread_time()
            if last_prefill is not None:  # get_next_batch_to_run merges the last prefill batch
                if running is None or running.is_empty():
                    running = last_prefill
                else:
                    running.merge_batch(last_prefill)
                last_prefill = None
            running.filter_batch()
            ok = running.check_decode_mem()
            running.prepare_for_decode()
            t_sched = time.thread_time() - t0
            if not ok:
                raise RuntimeError("KV pool too small: the step would retract")
            work, kind = running, "decode"
        # the worker's output without logprobs or hidden states (their per-request extend lengths stay unset)
        result = GenerationBatchResult(next_token_ids=next_tokens(work.reqs))
        n_struct = sum(r.grammar is not None for r in work.reqs)
        t0 = time.thread_time()
        if kind == "prefill":
            engine.processor.process_batch_result_prefill(work, result)
        else:
            engine.processor.process_batch_result_decode(work, result)
        t_proc = time.thread_time() - t0
        STUB.phase("between")
        engine.drain()
        if kind == "prefill":
            work.filter_batch()
            if running is None or running.is_empty():
                running = work
            else:
                last_prefill = work
        # a closed loop: the rows that finished in this step (each finishes once) are replaced
        waiting += [fresh() for r in work.reqs if r.finished()]
        if step >= warmup:
            rows_out.append({**meta, "batch": batch, "share": share, "step": step - warmup, "kind": kind,
                             "rows": len(work.reqs), "structured_rows": n_struct, "schedule_s": t_sched,
                             "process_s": t_proc})


def main() -> None:
    ap = grid_parser(__doc__.splitlines()[0], shares="0,0.5,1")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cdbench_engine_models"))
    ap.set_defaults(backends="xgrammar", vocabs="151936")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pool, eos = load_requests(args.requests)
    rows: list[dict] = []
    for vocab, name, backend in grid_backends(args, eos):
        meta = engine_meta(name, vocab)
        for batch, share, rng in grid_points(args):
            engine = Engine(model_dir(args.workdir, vocab), batch)  # empty pools and cache for each case
            t0 = time.perf_counter()
            run_case(engine, backend, pool, batch, share, args.steps, args.warmup, rng, vocab, eos, rows, meta)
            engine.close()
            last = [r for r in rows[-args.steps:] if r["kind"] == "decode"]
            print(f"V={vocab} {name} B={batch} s={share}: decode steps {len(last)}, schedule "
                  f"{np.median([r['schedule_s'] for r in last]) * 1e3:.2f} ms, process "
                  f"{np.median([r['process_s'] for r in last]) * 1e3:.2f} ms ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
    STUB.require_unused("measure")  # the measured paths never touched torchvision
    print(f"torchvision stub: {len(STUB.uses('import'))} uses while importing, none while measuring")
    write_rows(rows, FIELDS, args.out)


if __name__ == "__main__":
    sys.exit(main())
