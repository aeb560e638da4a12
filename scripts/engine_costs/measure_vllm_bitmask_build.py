"""Time the model runner's host work on the grammar bitmask in vLLM 0.10 / 0.11, on this CPU.

In vLLM 0.10.1 (``GPUModelRunner.apply_grammar_bitmask``) and in October 2025's main, #26866's time
(the same steps moved to ``vllm/v1/structured_output/utils.py``'s ``apply_grammar_bitmask``), the worker
receives the bitmask of the structured rows alone, compact, and before the apply kernel it

1. walks every row of the batch to find the logits index of each structured request (a dict of
   structured request ids to indices; 0.10.1 sorts the batch's ``req_id_to_index`` items first,
   October's walks ``input_batch.req_ids`` against a set),
2. allocates an int32 array of every logits row, ``np.full((rows, words), -1)`` (all allowed),
3. copies each structured row's mask into its place, one NumPy row assignment a row, appending its index,
4. wraps the array with ``torch.from_numpy`` (no copy) and, when not every row is structured, builds
   the index list's tensor (``torch.tensor(out_indices, dtype=torch.int32)``; pinned where CUDA is,
   not here),

then sends the array to the GPU (priced by the kernel tables' copy, ``reports/kernels/``) and launches
xgrammar's apply (the GPU table's apply). This times steps 1-4, the host work the scheduler loop does not
price elsewhere, as one call per step. The engine's environment is not installed here
(``.venv-engines/vllm-0.10.1`` is built by ``scripts/setup_engines.sh``), and the steps are plain NumPy,
torch and dict operations, so they are written out here from the source read (the two versions differ
only in step 1's walk, both timed: ``version`` 0.10.1 and 2025-10) and run on this environment's NumPy
and torch. The engine allocates the array afresh each step, so each timed call does too.

CPU seconds of the calling thread (``time.thread_time``: its user and system time, page faults of the
fresh array included), since this machine's 2 cores are shared and wall time would measure the other
processes; the median of ``--reps`` calls a case. Pin it (``taskset -c 1``). Fitted by ``fit.py``.

    taskset -c 1 .venv/bin/python scripts/engine_costs/measure_vllm_bitmask_build.py \
        --out reports/engine_costs/vllm-0.10.1_bitmask_build.csv.gz
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
import torch
from step_grid import write_rows  # this folder's shared CSV writer

FIELDS = ["version", "numpy", "torch", "cpu", "vocab", "words", "batch", "structured", "reps", "build_s", "build_p25_s",
          "build_p75_s", "wall_s"]
#: the logits widths of the published entries' models (Llama-3.1 128,256; Qwen3 151,936) and Qwen3.6's 248,077
VOCABS = (128256, 151936, 248077)
BATCHES = (16, 64, 100, 256, 512, 800, 1024)
SHARES = (0.2, 0.5, 1.0)


def build_0_10_1(req_id_to_index: dict[str, int], structured: dict[str, int], compact: np.ndarray,
                 rows: int) -> tuple[np.ndarray, torch.Tensor | None]:
    """Steps 1-4 as vLLM 0.10.1's model runner runs them (no speculative tokens: one logits row a request)."""
    index_of: dict[str, int] = {}
    for req_id, batch_index in sorted(req_id_to_index.items(), key=lambda x: x[1]):
        if req_id in structured:
            index_of[req_id] = batch_index
    out_indices: list[int] = []
    full = np.full((rows, compact.shape[1]), -1, dtype=compact.dtype)
    for k, (req_id, _) in enumerate(sorted(structured.items(), key=lambda x: x[1])):
        at = index_of[req_id]
        full[at] = compact[k]
        out_indices.append(at)
    array = torch.from_numpy(full).contiguous()
    index = None if len(out_indices) == rows else torch.tensor(out_indices, dtype=torch.int32)
    return array.numpy(), index


def build_2025_10(req_ids: list[str], structured_ids: list[str], compact: np.ndarray,
                  rows: int) -> tuple[np.ndarray, torch.Tensor | None]:
    """Steps 1-4 as October 2025's ``apply_grammar_bitmask`` runs them (the batch's ids walked against a set)."""
    wanted = set(structured_ids)
    index_of: dict[str, int] = {}
    for batch_index, req_id in enumerate(req_ids):
        if req_id in wanted:
            index_of[req_id] = batch_index
    out_indices: list[int] = []
    full = np.full((rows, compact.shape[1]), -1, dtype=compact.dtype)
    for k, req_id in enumerate(structured_ids):
        if (at := index_of.get(req_id)) is not None:
            full[at] = compact[k]
            out_indices.append(at)
    array = torch.from_numpy(full)
    index = None if len(out_indices) == rows else torch.tensor(out_indices, dtype=torch.int32)
    return array.numpy(), index


def cases(reps: int, rng: np.random.Generator) -> list[dict]:
    """Every (version, vocabulary, batch, share) case: the median and quartiles of ``reps`` timed calls."""
    rows_out = []
    meta = {"numpy": np.__version__, "torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    for vocab in VOCABS:
        words = -(-vocab // 32)
        for batch in BATCHES:
            req_ids = [f"cmpl-{i:05d}-{rng.integers(1 << 30):x}" for i in range(batch)]
            for share in SHARES:
                n = max(1, round(batch * share))
                picked = np.sort(rng.choice(batch, n, replace=False))  # spread over the batch, in batch order
                structured_ids = [req_ids[i] for i in picked]
                compact = rng.integers(-(1 << 31), 1 << 31, (n, words), dtype=np.int64).astype(np.int32)
                calls = {"0.10.1": lambda: build_0_10_1({r: i for i, r in enumerate(req_ids)},
                                                        {r: k for k, r in enumerate(structured_ids)}, compact, batch),
                         "2025-10": lambda: build_2025_10(req_ids, structured_ids, compact, batch)}
                for version, call in calls.items():
                    for _ in range(3):  # warm: the allocator's first large blocks
                        call()
                    cpu, wall = np.empty(reps), np.empty(reps)
                    for rep in range(reps):
                        t0, w0 = time.thread_time(), time.perf_counter()
                        full, _ = call()
                        cpu[rep], wall[rep] = time.thread_time() - t0, time.perf_counter() - w0
                    # the structured rows' masks in their places, the others all allowed
                    others = np.setdiff1d(np.arange(batch), picked)
                    assert (full[picked] == compact).all() and (full[others] == -1).all()
                    p25, p50, p75 = np.percentile(cpu, [25, 50, 75])
                    rows_out.append(dict(meta, version=version, vocab=vocab, words=words, batch=batch, structured=n,
                                         reps=reps, build_s=f"{p50:.4g}", build_p25_s=f"{p25:.4g}",
                                         build_p75_s=f"{p75:.4g}", wall_s=f"{np.median(wall):.4g}"))
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)  # (the engine's worker runs torch's CPU ops on its own thread too)
    write_rows(cases(args.reps, np.random.default_rng(args.seed)), FIELDS, args.out)


if __name__ == "__main__":
    main()
