"""Time vLLM V0's per-row logits-processor path around the grammar, on this CPU (run in .venv-engines/vllm-0.6.6).

V0 (vLLM 0.6.6.post1: December 2024, the releases of the published V0 results) constrains a request with a
logits processor per sequence: ``LogitsProcessor._apply_logits_processors`` loops over the batch's sequence
groups and, per row, reads the row of the logits, the sequence's output tokens
(``SequenceData.output_token_ids``, a tuple built each call), inspects the processor's signature and calls
it; ``XGrammarLogitsProcessor.__call__`` accepts the last sampled token, fills the row's bitmask, moves the
bitmask to the logits' device and applies it; the row is written back into the logits. The real objects,
loaded from the installed files of vllm 0.6.6.post1 (``logits_processor.py``, ``xgrammar_decoding.py``,
``sequence.py``), every other vllm module replaced by a recording import stub (``import_stub.py``: the
measurement is refused if a timed call touched it), xgrammar 0.1.6 with the DeepSeek tokenizer
(``export_requests.py``'s schemas and validated instances).

Per step it times (``time.thread_time``: the 2 cores are shared) the whole loop over a batch of ``batch``
rows, then replays the same grammar calls (``is_terminated``, ``accept_token``, ``fill_next_token_bitmask``)
on a twin set of matchers alone, and the CPU-only detour the processor takes when the logits are not on a
CUDA device (``to("cpu").unsqueeze(0)`` ... ``to(device).squeeze()``), which a GPU run does not take. The
engine's own per-row host work is the first less the other two. Not measured: the CUDA work a GPU run adds
per row, the bitmask's host-to-device copy (priced from the kernel tables) and the launch of xgrammar's
apply kernel (replaced here by a call that does nothing, on one-element logits rows, so that neither a CPU
copy of the row nor a CPU apply is timed).

    .venv-engines/vllm-0.6.6/bin/python scripts/engine_costs/measure_vllm_v0_processor.py \\
        --requests /tmp/engine_requests.json --out reports/engine_costs/vllm-0.6.6_v0_processor.csv.gz

``--part sampler`` times V0's sampler around those processors instead (``measure_sampler``): per decode step of
``batch`` rows, ``SamplingMetadata.prepare`` (the model runner's, before the forward's launch), then
``Sampler.forward`` up to its first GPU-to-host sync (``skip_sampler_cpu_output``: ``SamplingTensors`` from the
sampling metadata, the min-tokens pass, the sampling kernels' calls) and whole (the sync's Pythonized tokens and
logprobs, ``SamplerOutput``). The real ``sampling_metadata.py``, ``layers/sampler.py``, ``sequence.py``,
``sampling_params.py`` and ``vllm/utils.py`` (``PyObjectCache``, ``async_tensor_h2d``, ``make_tensor_with_pad``),
loaded from their files, every other vllm module stubbed; the logits are CPU rows of 8 (a GPU run's kernels
would work on 128256), and the torch calls that launch GPU work in a GPU run (``DEVICE_OPS``) are timed apart
in a second pass under a ``TorchFunctionMode``, so the host's own work is each span less its device calls.
vLLM's platform is asked once whether memory can be pinned, and answers no (a CPU has no pinned memory):
pinning is not timed.

    .venv-engines/vllm-0.6.6/bin/python scripts/engine_costs/measure_vllm_v0_processor.py --part sampler \\
        --out reports/engine_costs/vllm-0.6.6_v0_sampler.csv.gz
"""

from __future__ import annotations

# ruff: noqa: E402  (vllm's modules are loaded after the stub is installed)
import argparse
import importlib.util
import json
import sys
import time
from importlib.metadata import distribution, version
from pathlib import Path
from types import ModuleType, SimpleNamespace

from import_stub import RecordingStub

STUB = RecordingStub.install("vllm")  # every vllm module but the three loaded from their files below
# xgrammar 0.1.6 imports triton for its CUDA apply kernel, which no CPU run reaches (and is replaced below)
TRITON = RecordingStub.install("triton")

import torch
import xgrammar as xgr
from step_grid import (  # this folder's shared grid helpers
    load_requests,
    model_dir,
    write_rows,
)
from torch.overrides import TorchFunctionMode
from transformers import AutoTokenizer

FIELDS = ["vllm", "xgrammar", "vocab", "batch", "step", "total_s", "grammar_s", "cpu_detour_s"]
SAMPLER_FIELDS = ["vllm", "params", "batch", "step", "prepare_s", "prepare_device_s", "presync_s", "presync_device_s",
                  "presync_device_calls", "sampler_s", "sampler_device_s", "sampler_device_calls"]
#: the sampler's torch calls that launch GPU work in a GPU run: host-to-device copies and dtype casts (``to``,
#: ``long``), the logits' kernels and the gather of the sampled rows. Views, shape reads, ``empty`` /
#: ``empty_like`` (the caching allocator) and CPU tensors built from Python lists are host work in either run;
#: ``tolist`` (after the sync) is the copy back and its Python list
DEVICE_OPS = frozenset({"to", "long", "float", "div_", "softmax", "log_softmax", "argmax", "exponential_",
                        "__getitem__", "__setitem__"})
#: sampling parameters timed: temperature 0 (greedy, the benchmarks' default) and plain random sampling
PARAMS = {"greedy": {"temperature": 0.0}, "random": {"temperature": 1.0, "top_p": 1.0}}


def load(relpath: str) -> ModuleType:
    """A module of the installed vllm 0.6.6.post1, executed from its file under its own dotted name."""
    name = relpath.removesuffix(".py").replace("/", ".")
    path = Path(distribution("vllm").locate_file(relpath))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Row:
    """One sequence: its processor (real), its sequence data (real) and a twin matcher for the grammar replay."""

    def __init__(self, dec: ModuleType, seq: ModuleType, config, request: dict, prompt: list[int]) -> None:
        # the processor's lazy set-up of its first call (compile, its matcher, its bitmask), done before timing
        self.processor = p = dec.XGrammarLogitsProcessor(config)
        p._ensure_ctx()
        p.matchers = [xgr.GrammarMatcher(p.ctx)]
        p.token_bitmask = xgr.allocate_token_bitmask(1, config.vocab_size)
        self.twin = xgr.GrammarMatcher(p.ctx)
        self.tokens = request["tokens"][:-1]  # the instance; its EOS ends the walk
        self.data = seq.SequenceData.from_seqs(prompt)
        self.at = 0

    def done(self) -> bool:
        return self.at >= len(self.tokens)


class DeviceClock(TorchFunctionMode):
    """CPU seconds spent in, and the number of, the torch calls of ``DEVICE_OPS`` made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds, self.calls = 0.0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in DEVICE_OPS:
            return func(*args, **(kwargs or {}))
        t = time.thread_time()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.thread_time() - t
        self.calls += 1
        return out


def measure_sampler(args: argparse.Namespace) -> None:
    """V0's sampler host work per decode step (module docstring, ``--part sampler``)."""
    torch.set_num_threads(1)  # the 2 cores are shared: one intra-op thread (reports/engine_costs/README.md)
    utils = load("vllm/utils.py")
    # the platform's one answer, cached by the real lru_cache'd is_pin_memory_available: no pinned memory here
    utils.current_platform = SimpleNamespace(is_pin_memory_available=lambda: False)
    assert utils.is_pin_memory_available() is False
    params_mod = load("vllm/sampling_params.py")
    seq = load("vllm/sequence.py")
    meta_mod = load("vllm/model_executor/sampling_metadata.py")
    sampler_mod = load("vllm/model_executor/layers/sampler.py")
    prompt_len = 350
    rows_out = []
    for name, params in PARAMS.items():
        sampling = params_mod.SamplingParams(max_tokens=4096, **params)
        for batch in [int(b) for b in args.batches.split(",")]:
            groups = [seq.SequenceGroupMetadata(request_id=str(k), is_prompt=False, sampling_params=sampling,
                                                seq_data={k: seq.SequenceData.from_seqs(list(range(100, 100 + prompt_len)))},
                                                block_tables={k: [0]}, do_sample=True)
                      for k in range(batch)]
            cache, sampler = meta_mod.SamplingMetadataCache(), sampler_mod.Sampler()
            logits = torch.zeros(batch, 8)
            query_lens = [1] * batch

            def prepare(seq_lens: list[int]):
                return meta_mod.SamplingMetadata.prepare(groups, seq_lens, query_lens, "cpu", False, {}, cache)

            for step in range(args.warmup + args.steps):
                seq_lens = [prompt_len + step + 1] * batch
                STUB.phase("measure")
                spans = {}
                # the two spans in alternating order (the first sampler call of a step runs on colder caches)
                for skip in (True, False) if step % 2 else (False, True):
                    t = time.thread_time()
                    meta = prepare(seq_lens)
                    spans["prepare", skip] = time.thread_time() - t
                    meta.skip_sampler_cpu_output = skip  # True: up to the first GPU-to-host sync
                    t = time.thread_time()
                    result = sampler(logits, meta)
                    spans["sampler", skip] = time.thread_time() - t
                    if not skip:
                        out = result
                prepare_s, presync, whole = spans["prepare", True], spans["sampler", True], spans["sampler", False]
                # again, the device calls timed apart
                clocks = [DeviceClock() for _ in range(3)]
                with clocks[0]:
                    meta = prepare(seq_lens)
                meta.skip_sampler_cpu_output = True
                with clocks[1]:
                    sampler(logits, meta)
                meta = prepare(seq_lens)
                with clocks[2]:
                    sampler(logits, meta)
                STUB.phase("setup")
                assert len(out.outputs) == batch
                for g, o in zip(groups, out.outputs):  # each row takes its sampled token
                    (data,) = g.seq_data.values()
                    data.append_token_id(o.samples[0].output_token, 0.0)
                if step >= args.warmup:
                    rows_out.append({"vllm": version("vllm"), "params": name, "batch": batch, "step": step - args.warmup,
                                     "prepare_s": prepare_s, "prepare_device_s": clocks[0].seconds,
                                     "presync_s": presync, "presync_device_s": clocks[1].seconds,
                                     "presync_device_calls": clocks[1].calls, "sampler_s": whole,
                                     "sampler_device_s": clocks[2].seconds, "sampler_device_calls": clocks[2].calls})
            print(f"{name} batch {batch}: done")
    STUB.require_unused("measure")
    write_rows(rows_out, SAMPLER_FIELDS, args.out)
    print(f"vllm stub: {len(STUB.uses('import'))} uses while importing, none while measuring")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("processor", "sampler"), default="processor")
    ap.add_argument("--requests", type=Path, help="export_requests.py's pool (--part processor)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--batches", default=None, help="decode rows a step, comma-separated (processor: 1,8,20; "
                    "sampler: 1,2,4,8,16,20,32)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if args.part == "sampler":
        args.batches = args.batches or "1,2,4,8,16,20,32"
        measure_sampler(args)
        return
    if args.requests is None:
        ap.error("--part processor needs --requests")
    args.batches = args.batches or "1,8,20"
    requests, _ = load_requests(args.requests)
    lp = load("vllm/model_executor/layers/logits_processor.py")
    dec = load("vllm/model_executor/guided_decoding/xgrammar_decoding.py")
    seq = load("vllm/sequence.py")
    applied = []
    xgr.apply_token_bitmask_inplace = lambda logits, bitmask, indices=None: applied.append(1)  # the GPU kernel
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir(Path("/tmp/v0_processor"), args.vocab)))
    data = dec.TokenizerDataCache.get_tokenizer_data(tokenizer)
    prompt = list(range(100, 450))  # 350 prompt tokens (their values do not enter the path)
    configs = [dec.GrammarConfig(tokenizer_hash=hash(tokenizer), vocab_size=args.vocab, tokenizer_data=data,
                                 json_str=r["schema"] if isinstance(r["schema"], str) else json.dumps(r["schema"]))
               for r in requests]
    mask = xgr.allocate_token_bitmask(1, args.vocab)
    rows_out = []
    for batch in [int(b) for b in args.batches.split(",")]:
        picks = [i % len(requests) for i in range(batch)]
        rows = [Row(dec, seq, configs[i], requests[i], prompt) for i in picks]
        for step in range(args.warmup + args.steps):
            for r, i in zip(rows, picks):  # a walk at its instance's end starts over (untimed)
                if r.done():
                    rows[rows.index(r)] = Row(dec, seq, configs[i], requests[i], prompt)
            groups = [SimpleNamespace(seq_ids=[k], sampling_params=SimpleNamespace(logits_processors=[r.processor]),
                                      sample_indices=[k], prompt_logprob_indices=[], seq_data={k: r.data})
                      for k, r in enumerate(rows)]
            meta = SimpleNamespace(seq_groups=groups)
            logits = torch.zeros(batch, 1)
            STUB.phase("measure")
            TRITON.phase("measure")
            t = time.thread_time()
            lp._apply_logits_processors(logits, meta)
            total = time.thread_time() - t
            STUB.phase("setup")
            TRITON.phase("setup")
            # the same grammar calls on the twins, alone
            t = time.thread_time()
            for r in rows:
                if r.at and not r.twin.is_terminated():
                    r.twin.accept_token(r.tokens[r.at - 1])
            for r in rows:
                if not r.twin.is_terminated():
                    r.twin.fill_next_token_bitmask(mask, 0)
            grammar = time.thread_time() - t
            # the CPU-only detour around the apply, per row
            row = torch.zeros(1)
            t = time.thread_time()
            for _ in rows:
                row.to("cpu").unsqueeze(0).to("cpu").squeeze()
            detour = time.thread_time() - t
            for r in rows:  # the row samples its instance's next token
                r.data.append_token_id(r.tokens[r.at], 0.0)
                r.at += 1
            if step >= args.warmup:
                rows_out.append({"vllm": version("vllm"), "xgrammar": version("xgrammar"), "vocab": args.vocab,
                                 "batch": batch, "step": step - args.warmup, "total_s": total, "grammar_s": grammar,
                                 "cpu_detour_s": detour})
        print(f"batch {batch}: done")
    STUB.require_unused("measure")
    TRITON.require_unused("measure")
    assert applied, "the apply kernel was never reached"
    write_rows(rows_out, FIELDS, args.out)
    print(f"vllm stub: {len(STUB.uses('import'))} uses while importing, triton stub: {len(TRITON.uses('import'))}; "
          "none while measuring")


if __name__ == "__main__":
    main()
