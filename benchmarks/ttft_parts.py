"""Each structured request's TTFT in parts, in a reference run and in runs of the same workload, and which
part moves the median.

A structured request's time to first token is, from its requests table: the wait before its compile starts
(``compile_start_s - arrival_s``), its compile, the lag until the scheduler takes the ready grammar
(``grammar_ready_s - compile_end_s``: the step in progress, then a poll), the wait for admission
(``admitted_s - grammar_ready_s``) and its first step (``first_token_s - admitted_s``). Per run, each part's
quartiles and p90; then, for the requests every run answered, the median TTFT of each compared run with
one or two of its parts replaced request by request by the reference's: the parts whose swap brings the
median to the reference's are where the runs differ. Usage::

    python benchmarks/ttft_parts.py REFERENCE RUN [RUN ...]      # run folders or PACK::RUN

``reports/spec_costs/out_of_sample.md`` ("A compile probe") has what it found for the saturated SGLang
case of ``batch_fills.pack``.
"""

from __future__ import annotations

import argparse
import itertools

import pandas as pd

from cdbench.results.pack import open_run

PARTS = ("to_compile", "compile", "ready_lag", "admit_wait", "first_step")


def ttft_parts(requests: pd.DataFrame) -> pd.DataFrame:
    """Per request that got a first token (indexed by ``request_id``): its TTFT and its parts, seconds.

    >>> r = pd.DataFrame({"request_id": [0], "arrival_s": [0.0], "compile_start_s": [0.0], "compile_end_s": [0.02],
    ...                   "grammar_ready_s": [0.03], "admitted_s": [0.03], "first_token_s": [0.055]})
    >>> ttft_parts(r).round(3).iloc[0].tolist()
    [0.055, 0.0, 0.02, 0.01, 0.0, 0.025]
    """
    r = requests[requests["first_token_s"].notna() & requests["grammar_ready_s"].notna()]
    return pd.DataFrame({
        "ttft": r["first_token_s"] - r["arrival_s"],
        "to_compile": r["compile_start_s"] - r["arrival_s"],
        "compile": r["compile_end_s"] - r["compile_start_s"],
        "ready_lag": r["grammar_ready_s"] - r["compile_end_s"],
        "admit_wait": r["admitted_s"] - r["grammar_ready_s"],
        "first_step": r["first_token_s"] - r["admitted_s"],
    }).set_axis(r["request_id"].to_numpy())


def part_table(runs: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per run and part: p25, median, p75, p90 and mean, milliseconds."""
    rows = []
    for name, parts in runs.items():
        for part in ("ttft", *PARTS):
            v = parts[part] * 1e3
            rows.append({"run": name, "part": part, "p25": v.quantile(0.25), "median": v.median(),
                         "p75": v.quantile(0.75), "p90": v.quantile(0.9), "mean": v.mean()})
    return pd.DataFrame(rows).round(2)


def swaps(reference: pd.DataFrame, run: pd.DataFrame) -> pd.DataFrame:
    """``run``'s median TTFT (ms) with each part, and each pair of parts, replaced by ``reference``'s, request by
    request, over the requests both answered (parts equal in both are left out)."""
    common = reference.index.intersection(run.index)
    ref, own = reference.loc[common], run.loc[common]
    moving = [p for p in PARTS if not ref[p].equals(own[p])]
    rows = [{"swapped": "nothing", "median_ttft_ms": own["ttft"].median() * 1e3}]
    for n in (1, 2):
        for parts in itertools.combinations(moving, n):
            ttft = own["ttft"] - own[list(parts)].sum(axis=1) + ref[list(parts)].sum(axis=1)
            rows.append({"swapped": " + ".join(parts), "median_ttft_ms": ttft.median() * 1e3})
    rows.append({"swapped": "everything (the reference)", "median_ttft_ms": ref["ttft"].median() * 1e3})
    return pd.DataFrame(rows).round(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", help="run folder or PACK::RUN the others are compared with")
    parser.add_argument("runs", nargs="+", help="run folders or PACK::RUN of the same workload")
    args = parser.parse_args()
    runs = {ref: ttft_parts(open_run(ref).requests) for ref in (args.reference, *args.runs)}
    with pd.option_context("display.width", 200, "display.max_rows", 200):
        print(part_table(runs).to_string(index=False))
        for ref in args.runs:
            print(f"\n{ref}: median TTFT with the reference's parts swapped in")
            print(swaps(runs[args.reference], runs[ref]).to_string(index=False))


if __name__ == "__main__":
    main()
