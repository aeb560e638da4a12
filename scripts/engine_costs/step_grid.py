"""What the two engine measurement scripts share: the grid's command line and the CSV they write."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


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


def write_rows(rows: list[dict], fields: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        w.writerows(rows)
    print(f"{len(rows)} rows -> {out}")
