"""A model or hybrid run with its decode forwards priced as a live run measured them: is a gap to live the
scheduler's or the forward model's?

``live_forward_in_situ.py`` gives a live run's measured / modelled decode forward per decode batch-size bucket.
This runs a config (``cdbench run``) with every decode-only step's forward multiplied by that ratio for its
bucket (steps with prefill chunks, and buckets the live run never ran, stay as modelled). The scheduler, the
grammar costs and the host costs are the config's own; only the forward's price changes, for this process.
When the run then meets the live run's figures, what was missing was the forward's price, not a mechanism of
the scheduler. It is a diagnosis, not a fidelity result: the ratios come from the reference run itself.
Usage::

    python benchmarks/forward_in_situ_replay.py LIVE_RUN CONFIG --out FOLDER [--rows LO HI] [cdbench run options ...]

``--rows LO HI``: only the buckets of more than ``LO`` and at most ``HI`` rows take their ratio (which batch
sizes a gap comes from).

Found (reports/kv_capacity/README.md, the held-out BFCL case): live-a's decode forwards are 1.0-6.0 % above the
model per bucket (4.8 % over all decode steps, live-b the same); replayed at those ratios, model's p99 TTFT goes
from -13.7 % to +6.4 % of live-a's and hybrid's from -14.3 % to +8.3 %, all six checked figures within bar; the
buckets of 33 rows and more alone give model +5.5 %, those of 1-32 rows alone -14.6 %.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from cdbench.harness.costs.gpu import RooflineGpuCosts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_forward_in_situ import BUCKETS, by_batch, priced  # noqa: E402


def bucket_ratios(live: str) -> np.ndarray:
    """Measured / modelled (padded) decode forward of the live run per decode batch-size bucket
    (``BUCKETS``' upper edges; 1 where the run has no step)."""
    table = by_batch(priced(live))
    uppers = [int(b.strip("(]").split(",")[1]) for b in table["bucket"]]
    ratios = np.ones(len(BUCKETS))
    ratios[np.searchsorted(BUCKETS, uppers)] = table["padded_ratio"].to_numpy()
    return ratios


def replay(ratios: np.ndarray) -> None:
    """Price decode-only forwards at ``ratios`` (per bucket) in this process."""
    modelled = RooflineGpuCosts.forward_s

    def forward_s(self, prefill_chunks, prefill_cached, decode_rows, decode_kv_tokens) -> float:
        seconds = modelled(self, prefill_chunks, prefill_cached, decode_rows, decode_kv_tokens)
        if len(prefill_chunks) or decode_rows <= 0 or decode_rows > BUCKETS[-1]:
            return seconds
        return seconds * ratios[np.searchsorted(BUCKETS, decode_rows)]

    RooflineGpuCosts.forward_s = forward_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("live", help="the live run (a folder or PACK::RUN_ID) whose decode forwards set the price")
    parser.add_argument("config", type=Path, help="the run config to run (model or hybrid mode)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs=2, metavar=("LO", "HI"), default=(0, BUCKETS[-1]),
                        help="only buckets of more than LO and at most HI decode rows take their ratio")
    args, rest = parser.parse_known_args()
    ratios = bucket_ratios(args.live)
    edges = np.array(BUCKETS)
    ratios[(edges <= args.rows[0]) | (edges > args.rows[1])] = 1.0
    print("decode forward ratio per bucket: " + ", ".join(
        f"<={b} {r:.4f}" for b, r in zip(BUCKETS[1:], ratios[1:], strict=True) if r != 1.0), flush=True)
    replay(ratios)
    from cdbench.cli.app import app

    app(["run", str(args.config), "--out", str(args.out), "--overwrite", *rest])


if __name__ == "__main__":
    main()
