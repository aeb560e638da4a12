"""Grammar compiles timed the way the compile probe times them and the way a live run's process meets them.

The compile probe (``cdbench host --probe-specs``) compiles a store's specs in a worker process, one at a
time, each on an engine cleared and warmed first; a live run compiles on its scheduler's thread, in the
process that holds the model on the GPU, keeping every grammar it compiled. On an H100 host, live compiles
took 1.3-2x the probe's time for the same specs (``reports/spec_costs/out_of_sample.md``, "A probe on the
target's whole CPU"). This benchmark times a probe file's specs spec by spec, interleaved, in three
conditions:

- ``worker``: a spawned worker process, the probe's way (``warm_up_engine`` before each compile);
- ``idle``: this process, a model's weights on the device and nothing running, its own engine keeping its
  grammars as a live run's does;
- ``busy``: the same with another engine, while a thread replays a decode step of the model (a CUDA graph on
  a GPU, eager on a CPU) back to back.

    python benchmarks/compile_beside_forward.py --probe spec_probe.json --store STORE --out compiles.csv

Prints each spec's three times and, per band of the stored compile time, the median ratio of ``idle`` and
``busy`` over ``worker``.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_forward import ReferenceForward  # noqa: E402

from cdbench.backends.base import ConstraintSpec  # noqa: E402
from cdbench.backends.measure_worker import warm_up_engine  # noqa: E402
from cdbench.backends.registry import create_backend  # noqa: E402
from cdbench.backends.vocab import load_vocab  # noqa: E402
from cdbench.harness.costs.hardware import resolve_model  # noqa: E402
from cdbench.harness.costs.spec_probe import SpecProbe, entry_spec  # noqa: E402
from cdbench.harness.costs.spec_store import SpecCostStore  # noqa: E402

BANDS = [(0.0, 0.02), (0.02, 0.2), (0.2, 1.0), (1.0, float("inf"))]


def worker(conn, backend: str, vocab: str) -> None:
    """Compile each spec sent, the probe's way; answer its seconds (``None``: it failed)."""
    engine = create_backend(backend, load_vocab(vocab))
    conn.send("ready")
    for spec in iter(conn.recv, None):
        warm_up_engine(engine)
        start = time.perf_counter()
        try:
            engine.compile(spec)
            conn.send(time.perf_counter() - start)
        except Exception:  # a failed compile is reported, not timed
            conn.send(None)


def write_rows(path: str, rows: list[dict]) -> None:
    """``rows`` (one mapping a compile, all with the same keys) as a CSV file, and say where."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"compiles: {path}")


def timed(engine, spec: ConstraintSpec, kept: list) -> float | None:
    start = time.perf_counter()
    try:
        kept.append(engine.compile(spec))
    except Exception:
        return None
    return time.perf_counter() - start


class StepLoop:
    """A decode step of the model (:attr:`replay` launches one), replayed back to back on a thread while entered."""

    def __init__(self, model: str, device: str, rows: int, kv: int) -> None:
        self.ref = ReferenceForward(resolve_model(model), device)
        cache = self.ref.cache(rows, kv)
        tokens = torch.arange(rows, device=self.ref.device) * 7919 % self.ref.spec.vocab_size
        routing = self.ref.routing(rows)
        self.cuda = self.ref.device.type == "cuda"
        if self.cuda:
            stream = torch.cuda.Stream(self.ref.device)
            stream.wait_stream(torch.cuda.current_stream(self.ref.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.ref.step(tokens, cache, routing)
            torch.cuda.current_stream(self.ref.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.ref.step(tokens, cache, routing)
            self.replay = graph.replay
        else:
            def run():
                self.ref.step(tokens, cache, routing)
            self.replay = run
        self.steps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.replay()
            if self.cuda:
                torch.cuda.synchronize(self.ref.device)
            self.steps += 1

    def __enter__(self) -> StepLoop:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", required=True, help="a spec-cost probe file (cdbench host --probe-specs)")
    parser.add_argument("--store", required=True, help="the spec-cost store it probed")
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64, help="decode rows of the busy condition's step")
    parser.add_argument("--kv", type=int, default=1024, help="cached tokens a row of that step")
    parser.add_argument("--out", help="CSV of every compile")
    args = parser.parse_args(argv)

    probe = SpecProbe.model_validate_json(Path(args.probe).read_text())
    store = SpecCostStore(args.store)
    specs = []
    for probed in probe.specs:
        entry = next(e for e in store.entries(probed.digest) if e.host.id == probe.measured_on.id)
        specs.append((probed, entry_spec(entry)))
    ctx = mp.get_context("spawn")  # before the device is touched: the worker holds no model
    here, there = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(there, probe.backend, probe.vocab), daemon=True)
    proc.start()
    loop = StepLoop(args.model, args.device, args.rows, args.kv)
    vocab = load_vocab(probe.vocab)
    idle_engine, busy_engine = create_backend(probe.backend, vocab), create_backend(probe.backend, vocab)
    for engine in (idle_engine, busy_engine):  # a live run's engine has compiled before its first timed spec
        warm_up_engine(engine)
    kept_idle: list = []
    kept_busy: list = []
    here.recv()
    rows = []
    print(f"{'spec':28} {'stored ms':>10} {'worker':>9} {'idle':>9} {'busy':>9}  busy steps")
    for probed, spec in specs:
        here.send(spec)
        alone = here.recv()
        idle = timed(idle_engine, spec, kept_idle)
        with loop:
            before = loop.steps
            busy = timed(busy_engine, spec, kept_busy)
            steps = loop.steps - before
        rows.append({"spec": probed.label, "stored_s": probed.there_s, "worker_s": alone, "idle_s": idle,
                     "busy_s": busy, "busy_steps": steps})
        cells = " ".join(f"{v * 1e3:9.1f}" if v is not None else f"{'failed':>9}" for v in (alone, idle, busy))
        print(f"{probed.label:28} {probed.there_s * 1e3:10.1f} {cells}  {steps}")
    here.send(None)
    proc.join(timeout=30)
    for low, high in BANDS:
        band = [r for r in rows if low <= r["stored_s"] < high and None not in (r["worker_s"], r["idle_s"],
                                                                                  r["busy_s"])]
        if band:
            idle = statistics.median(r["idle_s"] / r["worker_s"] for r in band)
            busy = statistics.median(r["busy_s"] / r["worker_s"] for r in band)
            print(f"stored {low:g}-{high:g} s: {len(band)} specs, idle / worker {idle:.2f}, busy / worker {busy:.2f}")
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
