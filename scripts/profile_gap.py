"""How far one set of grammar profiles sits from another, per backend and constraint kind.

Command (from the repository root)::

    .venv/bin/python scripts/profile_gap.py --base <dir of isolated profiles> --other <dir of in-situ profiles>

Each directory holds ``<backend>.parquet`` or ``<backend>.json`` profiles (``GrammarProfile``). Prints a
markdown table per backend: for each kind both profiles measured, the fill
p50 / p90 / p99 (µs) and compile p50 / p99 (ms) of each, and the ratio other ÷
base, with the sample counts. The pooled row covers all kinds (its mix is
each measurement's own).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cdbench.harness.costs.grammar_profile import (
    PROFILE_SUFFIXES,
    GrammarProfile,
    KindProfile,
)

BACKENDS = ("xgrammar", "llguidance", "outlines")


def _cell(a: float, b: float, scale: float) -> str:
    ratio = f"{b / a:.2f}×" if a > 0 else "–"
    return f"{a * scale:,.1f} → {b * scale:,.1f} ({ratio})"


def rows(base: KindProfile, other: KindProfile) -> list[str]:
    out = []
    for name, scale, dist in (("fill", 1e6, "fill_s"), ("compile", 1e3, "compile_s")):
        a, b = getattr(base, dist), getattr(other, dist)
        if not a.count or not b.count:
            out += ["–"] * (3 if name == "fill" else 2)
            continue
        quantiles = ("p50", "p90", "p99") if name == "fill" else ("p50", "p99")
        out += [_cell(getattr(a, q), getattr(b, q), scale) for q in quantiles]
    return out


def table(backend: str, base: GrammarProfile, other: GrammarProfile) -> str:
    head = ("| kind | fill p50 µs | fill p90 µs | fill p99 µs | compile p50 ms | compile p99 ms | fills | compiles |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [f"**{backend}** (base → other (other ÷ base))", "", head]
    kinds = [k for k in base.kinds if k in other.kinds]
    for kind, a, b in [*((k, base.kinds[k], other.kinds[k]) for k in kinds), ("pooled", base.overall, other.overall)]:
        counts = [f"{a.fill_s.count} / {b.fill_s.count}", f"{a.compile_s.count} / {b.compile_s.count}"]
        lines.append("| " + " | ".join([kind, *rows(a, b), *counts]) + " |")
    return "\n".join(lines)


def _file(folder: Path, backend: str) -> Path:
    """``backend``'s profile file in ``folder``: its ``.parquet``, else its ``.json``."""
    found = [folder / f"{backend}{suffix}" for suffix in PROFILE_SUFFIXES if (folder / f"{backend}{suffix}").is_file()]
    return found[0] if found else folder / f"{backend}.json"  # load names a missing file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--other", type=Path, required=True)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    args = parser.parse_args(argv)
    for backend in args.backends.split(","):
        base, other = (GrammarProfile.load(_file(folder, backend)) for folder in (args.base, args.other))
        print(table(backend, base, other), end="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
