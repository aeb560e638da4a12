"""Time the grammar's own accept of each token (xgrammar's ``GrammarMatcher.accept_token``) in an engine's environment.

vLLM's ``update_from_output`` fit (``accept_row_s``, ``measure_vllm.py``) holds the engine's accept path per
structured row with the grammar's own accept inside it; model mode charges the grammar profile's accept as
well. This measures, with the same xgrammar, tokenizer, vocabularies and validated instances as those steps,
what the grammar's accept alone costs a token, so the fit can take it out (``fit.py``:
``xgrammar.accept_wrapper_row_s``). Per schema: compiled with the environment's xgrammar at each vocabulary
(``TokenizerInfo.from_huggingface`` with the model's ``vocab_size``, as vLLM builds it), then its validated
instance walked token by token through one matcher, each ``accept_token`` timed (``time.thread_time``: the
machine's 2 cores are shared). Every token is accepted (a refusal stops the script).

    .venv-engines/vllm-0.10.1/bin/python scripts/engine_costs/measure_grammar_accept.py \\
        --requests /tmp/engine_requests.json --out reports/engine_costs/vllm-0.10.1_grammar_accepts.csv.gz

``--fills`` also times the mask fill before each accept (``fill_next_token_bitmask`` into a one-row bitmask,
as an engine fills a row each step; ``fill_s``, the walk's sum), so that one xgrammar release's fills can be
set beside another's on the same schemas, tokens and vocabulary (e.g. an older release installed with
``pip install --target`` and put first on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import version
from pathlib import Path

import xgrammar as xgr
from step_grid import (  # this folder's shared grid helpers
    load_requests,
    model_dir,
    write_rows,
)
from transformers import AutoTokenizer

FIELDS = ["backend", "backend_version", "vocab", "schema", "tokens", "accept_s", "fill_s"]


def walk(grammar, tokens: list[int], bitmask) -> tuple[float, float] | None:
    """One walk of ``tokens`` through a fresh matcher: the thread CPU seconds of its accepts and (with a
    ``bitmask``) of the fill before each; ``None`` where the release refuses a token."""
    matcher = xgr.GrammarMatcher(grammar)
    accepts = fills = 0.0
    for token in tokens:
        if bitmask is not None:
            t = time.thread_time()
            matcher.fill_next_token_bitmask(bitmask)
            fills += time.thread_time() - t
        t = time.thread_time()
        ok = matcher.accept_token(token)
        accepts += time.thread_time() - t
        if not ok:
            return None
    return accepts, fills


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocabs", default="129280,151936")
    ap.add_argument("--repeats", type=int, default=3, help="walks of each instance (the first is a warm-up)")
    ap.add_argument("--fills", action="store_true", help="also time the mask fill before each accept")
    ap.add_argument("--skip-refused", action="store_true",
                    help="leave out a schema whose instance the release refuses (listed) instead of stopping")
    args = ap.parse_args()
    requests, _ = load_requests(args.requests)
    ver = version("xgrammar")
    rows = []
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir(Path("/tmp/grammar_accept"), vocab)))
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), max_threads=1)
        for i, request in enumerate(requests):
            schema = request["schema"] if isinstance(request["schema"], str) else json.dumps(request["schema"])
            grammar = compiler.compile_json_schema(schema)
            tokens = request["tokens"][:-1]  # the instance's tokens; its EOS ends the walk
            bitmask = xgr.allocate_token_bitmask(1, vocab) if args.fills else None
            walks = []
            for _ in range(args.repeats):
                walked = walk(grammar, tokens, bitmask)
                if walked is None:
                    break
                walks.append(walked)
            if len(walks) < args.repeats:
                refused = f"schema {i}: xgrammar {ver} refused a token of its validated instance"
                if not args.skip_refused:
                    raise SystemExit(refused)
                print(f"{refused}; left out")
                continue
            spent, filled = (list(x) for x in zip(*walks))
            rows.append({"backend": "xgrammar", "backend_version": ver, "vocab": vocab, "schema": i,
                         "tokens": len(tokens), "accept_s": min(spent[1:] or spent),
                         "fill_s": min(filled[1:] or filled) if args.fills else ""})
        print(f"vocab {vocab}: {sum(r['vocab'] == vocab for r in rows)} of {len(requests)} schemas walked")
    write_rows(rows, FIELDS, args.out)


if __name__ == "__main__":
    main()
