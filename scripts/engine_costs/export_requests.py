"""Export real structured requests for the engine measurements (run in the project's .venv).

The engines' environment (.venv-engines) does not hold cdbench, so this writes what the
measurement scripts need: JSON schemas from a corpus and, per schema, one validated instance
tokenized with the DeepSeek-V4 vocabulary (the only Hugging Face ``tokenizer.json`` installed
here, which the engines load through their own tokenizer paths), EOS last.

    .venv/bin/python scripts/engine_costs/export_requests.py --out /tmp/engine_requests.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import load_vocab
from cdbench.workloads.corpora import known_corpora, read_corpus
from cdbench.workloads.instances import InstanceFailure, build_pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="jsonschemabench_glaiveai2k")
    ap.add_argument("--count", type=int, default=48, help="schemas to export")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    vocab = load_vocab("deepseek-v4")
    load = read_corpus(known_corpora()[args.corpus], kinds=["json_schema"], sample=4 * args.count, seed=args.seed)
    out, failed = [], 0
    for item in load.items:
        if len(out) == args.count:
            break
        spec = ConstraintSpec("json_schema", item.spec)
        try:
            pool = build_pool(item.id, spec, vocab, size=1, seed=args.seed)
        except InstanceFailure as e:
            failed += 1
            print(f"skipped {e}")
            continue
        schema = item.spec if isinstance(item.spec, str) else json.dumps(item.spec)
        out.append({"id": item.id, "schema": schema, "tokens": list(pool.tokens[0])})
    args.out.write_text(json.dumps({"corpus": args.corpus, "vocab": "deepseek-v4", "seed": args.seed,
                                    "eos": vocab.eos_token_ids[0], "requests": out}))
    print(f"{len(out)} requests ({failed} schemas without an instance) -> {args.out}")


if __name__ == "__main__":
    main()
