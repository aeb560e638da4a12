"""Live runs' forward steps priced by several forward calibrations: which fits live steps best.

Each run's steps are priced as ``costs.forward_speed=live-run:`` prices them
(:func:`cdbench.results.live_forward_speed.step_ratios`: decode-only steps at the CUDA graph's padded rows,
steps with prefill chunks at their prompts) by each calibration given, and the measured forward over the
price is summed up per run: mean |ratio - 1| and the median ratio - 1, decode steps and steps with prefill
apart. Usage (CPU; runs as folders or ``PACK::RUN_ID``)::

    python benchmarks/forward_fit_in_situ.py --model qwen3-30b-a3b --gpu h200 \\
        --calibration shipped=cdbench/harness/costs/calibrations/qwen3-30b-a3b__h200.json \\
        --calibration refit=/tmp/refit.json  RUN [RUN ...]
"""

from __future__ import annotations

import argparse

import numpy as np

from cdbench.harness.config import RunConfig
from cdbench.harness.costs.calibration import ForwardCalibration
from cdbench.harness.costs.forward import ForwardCostModel
from cdbench.results.live_forward_speed import step_ratios
from cdbench.results.pack import open_run


def summary(ratios: np.ndarray) -> str:
    if not len(ratios):
        return "none"
    return f"{len(ratios)} steps {np.mean(np.abs(ratios - 1)):.1%} ({np.median(ratios) - 1:+.1%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--model", required=True)
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--calibration", action="append", required=True, help="NAME=PATH, repeated")
    args = parser.parse_args()
    fits = {name: ForwardCalibration.load(path) for name, path in (c.split("=", 1) for c in args.calibration)}
    for ref in args.runs:
        run = open_run(ref)
        config = RunConfig.model_validate(run.config)
        sizes = config.scheduler_config().cuda_graph_sizes
        spec = config.workload.spec_decode
        drafts = spec.k if spec.drafter == "mtp" else 0  # a run drafting with the MTP head: its passes as well
        print(ref)
        for name, cal in fits.items():
            forward = ForwardCostModel(args.model, args.gpu, forward_calibration=cal)
            decode, prefill, left_out = step_ratios(run.steps, run.requests, forward, sizes, drafts)
            print(f"  {name:>10}: decode {summary(decode)} | with prefill {summary(prefill)} ({left_out} left out)")


if __name__ == "__main__":
    main()
