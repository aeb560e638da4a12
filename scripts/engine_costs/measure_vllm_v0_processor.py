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
from transformers import AutoTokenizer

FIELDS = ["vllm", "xgrammar", "vocab", "batch", "step", "total_s", "grammar_s", "cpu_detour_s"]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--batches", default="1,8,20")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
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
