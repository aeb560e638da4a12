"""Time vLLM V1's own host-side code per engine step, on this CPU (run in .venv-engines/vllm).

Real objects throughout: a ``VllmConfig`` from ``EngineArgs`` (CPU platform), the V1
``Scheduler`` with its ``StructuredOutputManager`` and the xgrammar or guidance backend,
``Request`` objects carrying JSON schemas from a corpus, the shared-memory ``MessageQueue``
that carries RPCs to the workers of the multiprocess executor. The model is replaced by its
output: each step's ``ModelRunnerOutput`` samples the next token of a validated instance of
the request's schema (``export_requests.py``), so every structured row's grammar accepts it.

Per step it times CPU seconds (``time.thread_time``; ``time.process_time`` for the bitmask, whose
parallel path runs on the fill pool's threads), since this machine's 2 cores are shared and wall
time would measure the other processes; torch runs one intra-op thread for the same reason:

- ``schedule``: ``Scheduler.schedule()`` (batch formation, KV blocks, admission);
- ``bitmask``: ``Scheduler.get_grammar_bitmask()`` → ``StructuredOutputManager.grammar_bitmask``
  (fill through the backend's grammar wrapper, termination checks, the parallel path above
  128 structured rows), and ``raw_fill``: the backend matcher's own fill of the same rows
  afterwards (xgrammar only; llguidance caches the mask of a state, so a second fill is not
  a fill);
- ``enqueue`` / ``dequeue``: ``MessageQueue.enqueue(("sample_tokens", (grammar_output,), ...))``
  and the reader's ``dequeue`` (pickle into shared memory, and back), with the bytes;
  ``enqueue_so``: the same for ``("execute_model", (scheduler_output,), ...)``;
- ``update``: ``Scheduler.update_from_output()`` (accepting the sampled tokens into each
  grammar, stop checks, finished requests, outputs);
- ``encode``: the engine core's output thread's serialization of those outputs
  (``MsgpackEncoder.encode_into`` of each client's ``EngineCoreOutputs``, as
  ``EngineCoreProc.process_output_sockets`` does before its zmq send), with the bytes: Python
  under the GIL of the engine core's process, in a thread beside its loop.

    .venv-engines/vllm/bin/python scripts/engine_costs/measure_vllm.py \
        --requests /tmp/engine_requests.json --out reports/engine_costs/vllm_steps.csv.gz
"""

from __future__ import annotations

# ruff: noqa: E402  (vLLM 0.10's platform is chosen before its modules are imported)
import os
import pickle
import threading
import time
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the platform vLLM can build a config for here
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vllm.platforms
from packaging.version import Version

# vLLM before 0.11 (the 0.10 line): the bitmask is filled inside Scheduler.schedule() and travels to the workers
# inside SchedulerOutput; structured requests carry GuidedDecodingParams; no get_grammar_bitmask / sample_tokens
LEGACY = Version(version("vllm")) < Version("0.11")
if LEGACY:
    # 0.10 picks its CPU platform only for a CPU build of vLLM (a version string with "cpu"); PyPI's wheel is a
    # CUDA build, which finds no platform here. Select the CPU platform, as a CPU build would, before any vLLM
    # module reads it
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()

import numpy as np
import torch
from step_grid import grid_parser, grid_points, load_requests, model_dir, write_rows  # this folder's shared grid
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.serial_utils import MsgpackEncoder
from vllm.v1.structured_output import StructuredOutputManager

assert LEGACY != hasattr(Scheduler, "get_grammar_bitmask")
if LEGACY:
    from vllm.sampling_params import GuidedDecodingParams
    from vllm.utils import get_hash_fn_by_name
    from vllm.v1.structured_output.request import StructuredOutputRequest
else:
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.utils.hashing import get_hash_fn_by_name

BLOCK = 16
PROMPT = 32
NUM_BLOCKS = 200_000
FIELDS = ["engine", "version", "backend", "backend_version", "vocab", "batch", "share", "step", "rows",
          "structured_rows", "new_rows", "schedule_s", "bitmask_s", "raw_fill_s", "enqueue_s", "dequeue_s",
          "bitmask_bytes", "message_bytes", "enqueue_so_s", "dequeue_so_s", "so_bytes", "update_s",
          "encode_s", "output_bytes"]


def message_queue() -> tuple[MessageQueue, MessageQueue]:
    """A writer and its one local reader (the executor's broadcast queue), connected."""
    writer = MessageQueue(1, 1)
    handle = writer.export_handle()
    box: list[MessageQueue] = []

    def read_side() -> None:
        r = MessageQueue.create_from_handle(handle, 0)
        r.wait_until_ready()
        box.append(r)

    th = threading.Thread(target=read_side)
    th.start()
    writer.wait_until_ready()
    th.join()
    return writer, box[0]


def timed(fn, *a, clock=time.thread_time):
    t = clock()
    out = fn(*a)
    return out, clock() - t


def run_case(cfg, manager, backend, pool, eos, batch, share, steps, warmup, mq, rng, rows_out, vocab):
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer.0"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                                     **({"use_mla": False} if LEGACY else {})))])
    sched = Scheduler(cfg, kv, manager) if LEGACY else Scheduler(cfg, kv, manager, block_size=BLOCK)
    legacy_mask = {"s": 0.0, "thread_s": 0.0}
    if LEGACY:  # time the fill where 0.10 calls it: inside schedule()
        fill = manager.grammar_bitmask

        def timed_fill(*a):
            t, tt = time.process_time(), time.thread_time()
            out = fill(*a)
            legacy_mask["s"], legacy_mask["thread_s"] = time.process_time() - t, time.thread_time() - tt
            return out

        manager.grammar_bitmask = timed_fill
    tokens: dict[str, list[int]] = {}
    made = 0
    encoder = MsgpackEncoder()
    # as EngineCore builds it (prefix caching on)
    hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)

    def add(n: int) -> None:
        nonlocal made
        for _ in range(n):
            item = pool[made % len(pool)]
            structured = rng.random() < share
            toks = item["tokens"] if structured else [int(t) for t in rng.integers(2, 30000, len(item["tokens"]))]
            if LEGACY:
                sp = SamplingParams(max_tokens=len(toks), temperature=0.0, ignore_eos=not structured,
                                    guided_decoding=GuidedDecodingParams(json=item["schema"], backend=backend)
                                    if structured else None)
                # as Request.from_engine_core_request builds it in 0.10
                extra = dict(multi_modal_kwargs=None, multi_modal_hashes=None, multi_modal_placeholders=None,
                             eos_token_id=None, structured_output_request=StructuredOutputRequest(sampling_params=sp))
            else:
                sp = SamplingParams(max_tokens=len(toks), temperature=0.0, ignore_eos=not structured,
                                    structured_outputs=StructuredOutputsParams(json=item["schema"]) if structured else None)
                if structured:
                    sp.structured_outputs._backend = backend
                extra = {}
            req = Request(request_id=f"r{made}", prompt_token_ids=[int(t) for t in rng.integers(2, 30000, PROMPT)],
                          sampling_params=sp, pooling_params=None, arrival_time=time.time(),
                          block_hasher=hasher, **extra)
            if req.use_structured_output:
                manager.grammar_init(req)
                req.structured_output_request._grammar.result()  # compile off the clock
            tokens[req.request_id] = toks
            sched.add_request(req)
            made += 1

    for step in range(warmup + steps):
        add(batch - len(sched.requests))  # a closed loop: ``batch`` requests live, finished ones replaced
        so, t_sched = timed(sched.schedule)
        if LEGACY:  # schedule() held the fill: split it off
            go = so if so.grammar_bitmask is not None else None
            t_mask, t_sched = legacy_mask["s"], t_sched - legacy_mask["thread_s"]
            legacy_mask.update(s=0.0, thread_s=0.0)
        else:
            go, t_mask = timed(sched.get_grammar_bitmask, so, clock=time.process_time)
        raw = 0.0
        if go is not None and backend == "xgrammar":
            scratch = torch.from_numpy(go.grammar_bitmask.copy())
            order = sorted(go.structured_output_request_ids, key=go.structured_output_request_ids.get) if LEGACY \
                else go.structured_output_request_ids
            for i, rid in enumerate(order):
                g = sched.requests[rid].structured_output_request.grammar
                if not g.is_terminated():
                    t0 = time.thread_time()
                    g.matcher.fill_next_token_bitmask(scratch, i)
                    raw += time.thread_time() - t0
        enq = deq = enq_so = deq_so = 0.0
        nbytes = mbytes = so_bytes = 0
        if go is not None:
            # the message that carries the bitmask to the workers: 0.10's execute_model, later sample_tokens
            msg = ("execute_model", (so,), {}, 0) if LEGACY else ("sample_tokens", (go,), {}, 0)
            _, enq = timed(mq[0].enqueue, msg)
            _, deq = timed(mq[1].dequeue)
            nbytes = go.grammar_bitmask.nbytes
            mbytes = len(pickle.dumps(msg, protocol=5))
        _, enq_so = timed(mq[0].enqueue, ("execute_model", (so,), {}, 0))
        _, deq_so = timed(mq[1].dequeue)
        so_bytes = len(pickle.dumps(so, protocol=5))
        ids = list(so.num_scheduled_tokens)
        sampled = []
        new = 0
        for rid in ids:
            req = sched.requests[rid]
            done = req.num_computed_tokens + so.num_scheduled_tokens[rid] >= req.num_prompt_tokens
            if not done:
                sampled.append([])
                continue
            if req.num_output_tokens == 0:
                new += 1
            sampled.append([tokens[rid][req.num_output_tokens]])
        legacy_fields = dict(spec_token_ids=None, logprobs=None, prompt_logprobs_dict={}, pooler_output=[]) if LEGACY else {}
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, **legacy_fields)
        outputs, t_upd = timed(sched.update_from_output, so, out)
        buf, t_enc, out_bytes = bytearray(), 0.0, 0
        for client_outputs in outputs.values():  # the output thread, a message a client
            t0 = time.thread_time()
            frames = encoder.encode_into(client_outputs, buf)
            t_enc += time.thread_time() - t0
            out_bytes += sum(len(f) for f in frames)
        if step < warmup:
            continue
        n_struct = len(go.structured_output_request_ids) if go is not None else 0  # a list, or 0.10's dict
        rows_out.append({
            "engine": "vllm", "version": version("vllm"), "backend": backend,
            "backend_version": version("xgrammar" if backend == "xgrammar" else "llguidance"), "vocab": vocab,
            "batch": batch, "share": share, "step": step - warmup, "rows": len(ids), "structured_rows": n_struct, "new_rows": new,
            "schedule_s": t_sched, "bitmask_s": t_mask, "raw_fill_s": raw, "enqueue_s": enq, "dequeue_s": deq,
            "bitmask_bytes": nbytes, "message_bytes": mbytes, "enqueue_so_s": enq_so, "dequeue_so_s": deq_so,
            "so_bytes": so_bytes, "update_s": t_upd, "encode_s": t_enc, "output_bytes": out_bytes})


def main() -> None:
    ap = grid_parser(__doc__.splitlines()[0], shares="0,0.5,1")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cdbench_engine_models"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    pool, eos = load_requests(args.requests)
    mq = message_queue()
    rows: list[dict] = []
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        ea = EngineArgs(model=str(model_dir(args.workdir, vocab)), max_num_seqs=256, max_model_len=8192,
                        max_num_batched_tokens=8192, enforce_eager=True, load_format="dummy")
        cfg = ea.create_engine_config()
        cfg.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the workers' memory profiling would set
        for backend in args.backends.split(","):
            manager = StructuredOutputManager(cfg)
            for batch, share, rng in grid_points(args):
                t0 = time.perf_counter()
                run_case(cfg, manager, backend, pool, eos, batch, share, args.steps, args.warmup, mq, rng,
                         rows, vocab)
                last = rows[-args.steps:]
                print(f"V={vocab} {backend} B={batch} s={share}: "
                      f"sched {np.median([r['schedule_s'] for r in last])*1e3:.2f} ms, "
                      f"mask {np.median([r['bitmask_s'] for r in last])*1e3:.2f} ms, "
                      f"update {np.median([r['update_s'] for r in last])*1e3:.2f} ms, "
                      f"encode {np.median([r['encode_s'] for r in last])*1e3:.2f} ms "
                      f"({time.perf_counter()-t0:.1f} s)", flush=True)
    write_rows(rows, FIELDS, args.out)


if __name__ == "__main__":
    main()
