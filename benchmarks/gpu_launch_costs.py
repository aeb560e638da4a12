"""Host time of each GPU-launching call of vLLM 0.6.6.post1's V0 sampler (to its sync) and xgrammar row path.

The CPU measurement (``scripts/engine_costs/measure_vllm_v0_processor.py``) cannot time what these calls cost the
host on a GPU. This replays them call for call with plain torch and xgrammar (vLLM does not install on the GPU
host), read from vLLM 0.6.6.post1's files, greedy, Llama-3.1's 128256 bf16 logits:

- part ``sampler``, ``Sampler.forward`` (``model_executor/layers/sampler.py``) up to ``_sample_with_torch``'s sync:
  ``SamplingTensors.from_lists`` (``model_executor/sampling_metadata.py``) stages 7 lists with
  ``torch.tensor(..., pin_memory=True)`` (``stage_*``; ``ref_stage_pageable`` is one unpinned, as the CPU run
  staged them) and sends 9 with ``.to(device, non_blocking=True)`` (``to_*``; greedy has no penalties, so the
  token tensors are empty device tensors); ``forward``: ``logits.to(torch.float)``, ``div_`` by the
  temperatures, ``softmax``, ``log_softmax``; ``_sample_with_torch``: ``sample_indices.long()``, the gather
  ``logprobs[...]``, ``torch.argmax``. These are the CPU run's 16 ``DEVICE_OPS`` calls.
- part ``processor``, per structured row: ``_apply_logits_processors`` (``model_executor/layers/logits_processor.py``)
  calls ``XGrammarLogitsProcessor.__call__`` (``model_executor/guided_decoding/xgrammar_decoding.py``):
  ``token_bitmask.to(scores.device)`` (pinned, as xgrammar 0.1.6's ``allocate_token_bitmask`` makes it on CUDA;
  blocking in 0.6.6, ``non_blocking=True`` since #12563), ``xgr.apply_token_bitmask_inplace`` (in 0.1.6 a
  ``torch.arange`` and the Triton kernel through Triton's Python launcher); the loop writes the row back,
  ``logits[row] = logits_row``.

``perf_counter`` around each call, per step of ``--reps``, after ``--warmup`` steps. Mode ``idle``: the GPU
synchronized before each step (the blocking copy of row k waits for row k-1's kernels, as in 0.6.6). Mode
``busy``: a sleep kernel queued first, so no launch waits (its copy is the non-blocking one; CUDA only).
CSV: ``part,name,rows,mode,n,host_us,p10_us,p90_us`` under a ``#`` line naming the device and versions. On the
GPU host xgrammar 0.1.6 (vLLM 0.6.6's) travels as wheels with pydantic 2.10.4, pydantic-core 2.27.2 and
annotated-types 0.7.0; torch and Triton are the host's, not December 2024's 2.5.1 / 3.1::

    python3 benchmarks/gpu_launch_costs.py --reps 1000 --out $OUT/gpu_launch_costs.csv
"""

from __future__ import annotations

import argparse
import csv
import platform
import time
from collections import defaultdict
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr

STAGED = ("temperatures", "top_ps", "min_ps", "presence_penalties", "frequency_penalties", "repetition_penalties",
          "top_ks")
SENT = ("temperatures", "top_ps", "top_ks", "min_ps", "presence_penalties", "frequency_penalties",
        "repetition_penalties", "prompt_tokens", "output_tokens")  # from_lists' order of .to calls
SLEEP_CYCLES = 20_000_000  # about 10 ms at H100 clocks: longer than any step's launches


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


class Clock:
    """Host microseconds of each named call, in the order the step makes them."""

    def __init__(self) -> None:
        self.us: dict[str, list[float]] = defaultdict(list)
        self.on = False

    def __call__(self, name: str, fn: Callable, *args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.on:
            self.us[name].append(1e6 * (time.perf_counter() - t))
        return out


def sampler_step(clock: Clock, logits: torch.Tensor, indices: torch.Tensor, pin: bool) -> None:
    """The sampler's calls up to its sync, greedy rows (temperature 0 is staged as 1.0, top_k as the vocab)."""
    rows, vocab = logits.shape
    lists = {"temperatures": [1.0] * rows, "top_ps": [1.0] * rows, "min_ps": [0.0] * rows,
             "presence_penalties": [0.0] * rows, "frequency_penalties": [0.0] * rows,
             "repetition_penalties": [1.0] * rows, "top_ks": [vocab] * rows}
    empty = torch.empty(0, device=logits.device, dtype=torch.long)
    staged = {name: clock(f"stage_{name}", torch.tensor, lists[name], device="cpu", pin_memory=pin,
                          dtype=torch.int if name == "top_ks" else logits.dtype) for name in STAGED}
    clock("ref_stage_pageable", torch.tensor, lists["temperatures"], device="cpu", dtype=logits.dtype)
    staged["prompt_tokens"] = staged["output_tokens"] = empty
    sent = {name: clock(f"to_{name}", staged[name].to, device=logits.device, non_blocking=True) for name in SENT}
    x = clock("logits_to_float", logits.to, torch.float)
    clock("div_temperatures", x.div_, sent["temperatures"].unsqueeze(dim=1))
    probs = clock("softmax", torch.softmax, x, dim=-1, dtype=torch.float)
    logprobs = clock("log_softmax", torch.log_softmax, x, dim=-1, dtype=torch.float)
    long_indices = clock("indices_long", indices.long)
    picked = clock("gather_rows", logprobs.__getitem__, long_indices)
    clock("argmax", torch.argmax, picked, dim=-1)
    del probs


def processor_step(clock: Clock, logits: torch.Tensor, bitmask: torch.Tensor, non_blocking: bool) -> None:
    """Each row's GPU-launching calls of V0's processor loop (the grammar's own calls are CPU work, priced apart)."""
    cuda = logits.device.type == "cuda"
    for row in range(logits.shape[0]):
        scores = logits[row]
        mask = clock("copy_nonblocking" if non_blocking else "copy_blocking", bitmask.to, logits.device,
                     non_blocking=non_blocking)
        # off CUDA vLLM applies on a 2-D view (its CPU detour); the launch on CUDA takes the 1-D row
        clock("apply_bitmask", xgr.apply_token_bitmask_inplace, scores if cuda else scores.unsqueeze(0), mask)
        clock("write_back", logits.__setitem__, row, scores)


def measure(device: torch.device, rows_list: list[int], vocab: int, reps: int, warmup: int) -> list[dict]:
    cuda = device.type == "cuda"
    out = []
    for rows in rows_list:
        logits = torch.randn(rows, vocab, device=device).to(torch.bfloat16)
        indices = torch.arange(rows, dtype=torch.int, device=device)
        bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32, pin_memory=cuda)
        for mode in ("idle", "busy") if cuda else ("idle",):
            for part in ("sampler", "processor"):
                clock, overran = Clock(), 0
                for step in range(warmup + reps):
                    clock.on = step >= warmup
                    if cuda:
                        torch.cuda.synchronize()
                        if mode == "busy":
                            torch.cuda._sleep(SLEEP_CYCLES)
                            slept = torch.cuda.Event()
                            slept.record()
                    if part == "sampler":
                        sampler_step(clock, logits, indices, pin=cuda)
                    else:
                        processor_step(clock, logits, bitmask, non_blocking=mode == "busy")
                    overran += mode == "busy" and slept.query()  # the GPU went idle before the step's last launch
                if overran:
                    print(f"warning: {part} rows {rows}: the sleep ended before the launches in {overran} steps")
                for name, us in clock.us.items():
                    p10, med, p90 = np.percentile(us, [10, 50, 90])
                    out.append({"part": part, "name": name, "rows": rows, "mode": mode, "n": len(us),
                                "host_us": round(med, 2), "p10_us": round(p10, 2), "p90_us": round(p90, 2)})
                print(f"{part} rows {rows} {mode}: " + ", ".join(f"{r['name']} {r['host_us']}"
                                                               for r in out if (r["part"], r["rows"], r["mode"])
                                                               == (part, rows, mode)), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default="1,20", help="batch rows, comma-separated")
    ap.add_argument("--vocab", type=int, default=128256, help="logits per row (Llama-3.1)")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    rows = measure(device, [int(r) for r in args.rows.split(",")], args.vocab, args.reps, args.warmup)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        f.write(f"# device={name}; torch={torch.__version__}; triton={_version('triton')}; "
                f"xgrammar={_version('xgrammar')}; python={platform.python_version()}\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out} ({name})")


if __name__ == "__main__":
    main()
