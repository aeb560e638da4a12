"""Time llguidance's batched accept, ``LLExecutor.consume_token_par``, against one ``consume_token`` per row.

``scheduler.accept_parallel`` spreads the grammar's accepts of a step over the fill pool, as llguidance's
executor does with ``consume_token_par(matchers_and_tokens)``. Its price is the rows' accepts (the grammar
profile's) in the pool's makespan; this measures what that leaves out: the batched call's own cost per row
and per call beside the same rows accepted one by one. Real matchers of JSON schemas from a corpus
(``export_requests.py``), each consuming the next token of its schema's validated instance, so every
accept succeeds (a refused token stops the script). Two matcher sets walk the same tokens: one accepts
row by row, the other through the executor, in alternate order per step.

CPU seconds (``time.process_time``: the executor's threads are this process's) with one executor thread,
since the machine's 2 cores are shared and wall time would measure the neighbours; the parallel speed-up
over threads is the makespan's, not measured here.

    .venv/bin/python scripts/engine_costs/measure_llguidance_accept.py \
        --requests /tmp/engine_requests.json --out reports/engine_costs/llguidance_accept_par.csv
"""

from __future__ import annotations

import argparse
import time
from importlib.metadata import version
from pathlib import Path

import llguidance
import llguidance.hf
from step_grid import (  # this folder's shared grid helpers
    load_requests,
    model_dir,
    write_rows,
)
from transformers import AutoTokenizer

FIELDS = ["llguidance", "batch", "step", "serial_s", "par_s"]


class Walks:
    """``batch`` matchers, each walking its schema's validated instance (restarted at its end, untimed)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, usable: list[tuple[dict, str]], batch: int) -> None:
        self.tokenizer = tokenizer
        self.rows = [usable[i % len(usable)][0] for i in range(batch)]
        self.grammars = [usable[i % len(usable)][1] for i in range(batch)]
        self.matchers = [self._matcher(g) for g in self.grammars]
        self.at = [0] * batch

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, grammar)

    def pairs(self) -> list[tuple[llguidance.LLMatcher, int]]:
        """Each row's matcher and its next token; a walk at its instance's end restarts first."""
        out = []
        for i, row in enumerate(self.rows):
            if self.at[i] >= len(row["tokens"]) - 1:  # (the last token is EOS: the walk is over)
                self.matchers[i] = self._matcher(self.grammars[i])
                self.at[i] = 0
            out.append((self.matchers[i], row["tokens"][self.at[i]]))
            self.at[i] += 1
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args()
    requests, _ = load_requests(args.requests)
    hf = AutoTokenizer.from_pretrained(str(model_dir(Path("/tmp/llguidance_accept"), 129280)))
    tokenizer = llguidance.hf.from_tokenizer(hf)
    # the schemas llguidance takes (it refuses oneOf, as the engines' guidance backends do at compile)
    usable = []
    for r in requests:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(r["schema"])
        if not llguidance.LLMatcher(tokenizer, grammar).is_error():
            usable.append((r, grammar))
    print(f"{len(usable)} of {len(requests)} schemas taken")
    executor = llguidance.LLExecutor(num_threads=1)
    ver = version("llguidance")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        one, par = Walks(tokenizer, usable, batch), Walks(tokenizer, usable, batch)
        for step in range(args.warmup + args.steps):
            p_one, p_par = one.pairs(), par.pairs()
            times = {}
            for which in (("serial", "par") if step % 2 else ("par", "serial")):
                t = time.process_time()
                if which == "serial":
                    ok = [m.consume_token(tok) for m, tok in p_one]
                else:
                    ok = executor.consume_token_par(p_par)
                times[which] = time.process_time() - t
                if not all(ok):
                    raise SystemExit(f"a matcher refused its instance's token ({which}, batch {batch}, step {step})")
            if step >= args.warmup:
                rows.append({"llguidance": ver, "batch": batch, "step": step - args.warmup,
                             "serial_s": times["serial"], "par_s": times["par"]})
        print(f"batch {batch}: done")
    write_rows(rows, FIELDS, args.out)


if __name__ == "__main__":
    main()
