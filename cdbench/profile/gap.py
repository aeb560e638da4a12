"""How far one set of grammar profiles sits from another, per backend and constraint kind (``cdbench
profile-gap``): e.g. the profiles measured in isolation (``cdbench profile``) against the ones measured in
situ by hybrid runs (reports/fidelity/profiles_in_situ.md).

A set is a folder of profiles (:class:`~cdbench.harness.costs.grammar_profile.GrammarProfile`), one a
backend: ``<backend>.parquet`` as shipped or ``profile_<backend>.parquet`` as ``cdbench profile`` writes them
(or ``.json``). Each backend gets a markdown table: for each
kind both profiles measured, the fill p50 / p90 / p99 (µs) and compile p50 / p99 (ms) of each and the ratio
other ÷ base, with the sample counts; the pooled row covers every kind (each measurement's own mix).
"""

from __future__ import annotations

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


def _quantiles(base: KindProfile, other: KindProfile) -> list[str]:
    out = []
    for name, scale, dist in (("fill", 1e6, "fill_s"), ("compile", 1e3, "compile_s")):
        a, b = getattr(base, dist), getattr(other, dist)
        quantiles = ("p50", "p90", "p99") if name == "fill" else ("p50", "p99")
        if not a.count or not b.count:
            out += ["–"] * len(quantiles)
            continue
        out += [_cell(getattr(a, q), getattr(b, q), scale) for q in quantiles]
    return out


def gap_table(backend: str, base: GrammarProfile, other: GrammarProfile) -> str:
    """The markdown table of one backend's two profiles."""
    lines = [f"**{backend}** (base → other (other ÷ base))", "",
             "| kind | fill p50 µs | fill p90 µs | fill p99 µs | compile p50 ms | compile p99 ms | fills | compiles |",
             "|---|---|---|---|---|---|---|---|"]
    kinds = [(k, base.kinds[k], other.kinds[k]) for k in base.kinds if k in other.kinds]
    for kind, a, b in [*kinds, ("pooled", base.overall, other.overall)]:
        counts = [f"{a.fill_s.count} / {b.fill_s.count}", f"{a.compile_s.count} / {b.compile_s.count}"]
        lines.append("| " + " | ".join([kind, *_quantiles(a, b), *counts]) + " |")
    return "\n".join(lines)


def profile_file(folder: Path, backend: str) -> Path:
    """``backend``'s profile file in ``folder``: ``<backend>`` (the shipped profiles' names) or
    ``profile_<backend>`` (``cdbench profile``'s), ``.parquet`` before ``.json`` (a missing file is named when
    it is loaded)."""
    names = [folder / f"{stem}{suffix}" for stem in (backend, f"profile_{backend}") for suffix in PROFILE_SUFFIXES]
    return next((path for path in names if path.is_file()), names[0])


def profile_gap(base: Path, other: Path, backends: tuple[str, ...] = BACKENDS) -> str:
    """Every backend's table, base folder against other folder."""
    return "\n\n".join(gap_table(backend, GrammarProfile.load(profile_file(base, backend)),
                                 GrammarProfile.load(profile_file(other, backend))) for backend in backends) + "\n"
