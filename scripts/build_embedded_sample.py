"""Rebuild cdbench/workloads/data/embedded_sample.jsonl.gz from the shared corpus.

Deterministic (fixed seed): small, cheap-to-compile specs of every kind, each
kept only if a valid oracle instance can be drawn for it. Lines keep their
source and license fields.

    python scripts/build_embedded_sample.py [--corpora ../shared/corpora]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np

from cdbench.workloads.corpora import (
    EMBEDDED_SAMPLE,
    CorpusItem,
    read_corpus,
    shared_corpora_dir,
)
from cdbench.workloads.instances import InstanceFailure, valid_instances

SEED = 20260501
# (file stem, how many, largest spec text in characters)
PLAN = [
    ("jsonschemabench_github_trivial", 30, 1200),
    ("jsonschemabench_github_easy", 50, 1500),
    ("jsonschemabench_glaiveai2k", 40, 1200),
    ("bfcl_v4_live_tools", 40, 2500),
    ("regex_from_json_schemas", 50, 80),
    ("choice_from_json_schema_enums", 50, 300),
    ("gbnf_llama_cpp", 20, 3000),
    ("gbnf_transformers_cfg", 20, 3000),
    ("llguidance_sample_data", 20, 3000),
    ("lark_lark_parser", 20, 3000),
    ("lark_outlines", 20, 3000),
    ("lark_syncode", 20, 3000),
]


def _size(item: CorpusItem) -> int:
    return len(json.dumps(item.spec, ensure_ascii=False))


# Grammar engines expand bounded repeats and optional-property orders: long
# length bounds and many optional properties make compiles take seconds.
MAX_LENGTH_BOUND = 32
MAX_OPTIONAL_PROPERTIES = 4

# Measured by hand (compile + mask fill along an oracle instance, xgrammar
# 0.2.8, qwen3.6): items too slow for a default run.
EXCLUDED = {
    "lark/lark-parser/examples/composition/csv": "mask fills of up to 6 s per token (65 s for 31 tokens)",
}


def cheap_to_compile(node: object) -> bool:
    """No length bound over MAX_LENGTH_BOUND, no object with many optional properties."""
    if isinstance(node, list):
        return all(cheap_to_compile(x) for x in node)
    if not isinstance(node, dict):
        return True
    for key in ("maxLength", "minLength", "maxItems", "minItems"):
        if isinstance(node.get(key), int) and node[key] > MAX_LENGTH_BOUND:
            return False
    props = node.get("properties")
    if isinstance(props, dict):
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if len([p for p in props if p not in required]) > MAX_OPTIONAL_PROPERTIES:
            return False
    return all(cheap_to_compile(v) for v in node.values())


def select(folder: Path) -> list[CorpusItem]:
    chosen: list[CorpusItem] = []
    for stem, count, max_chars in PLAN:
        load = read_corpus(folder / f"{stem}.jsonl")
        small = [it for it in load.items
                 if _size(it) <= max_chars and cheap_to_compile(it.spec) and it.id not in EXCLUDED]
        rng = np.random.default_rng([SEED, len(chosen)])
        kept = 0
        for index in rng.permutation(len(small)):
            item = small[int(index)]
            try:
                valid_instances(item.id, item.to_spec(), 1, SEED)
            except InstanceFailure as failure:
                print(f"skip {item.id}: {failure.reason[:100]}")
                continue
            chosen.append(item)
            kept += 1
            if kept >= count:
                break
        print(f"{stem}: {kept} items")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpora", type=Path, default=shared_corpora_dir())
    parser.add_argument("--out", type=Path, default=EMBEDDED_SAMPLE)
    args = parser.parse_args()
    if args.corpora is None or not args.corpora.is_dir():
        raise SystemExit("shared corpora folder not found: pass --corpora or set CDBENCH_CORPORA")
    items = select(args.corpora)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(item.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n" for item in items)
    args.out.write_bytes(gzip.compress(lines.encode("utf-8"), mtime=0))  # mtime 0: the same items, the same bytes
    print(f"wrote {len(items)} items to {args.out}")


if __name__ == "__main__":
    main()
