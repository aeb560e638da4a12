"""Build the default grammar profiles that ``model`` mode ships with.

Command (from the repository root; a few minutes on 2 CPUs)::

    .venv/bin/python scripts/build_default_profiles.py --per-kind 12 --seed 0

It measures ``xgrammar``, ``llguidance`` and ``outlines`` with real engine calls
through the runner of ``cdbench profile`` (one worker process per backend
slot, a cold compile per item, the item's oracle instances walked token by
token with the first fill after each token, accept and rollback timed) on the
``qwen3.6`` vocabulary, over up to ``--per-kind`` items of each constraint kind
of the embedded sample corpus (a seeded choice). The resulting
``profile_<backend>.json`` files are copied to
``cdbench/harness/costs/profiles/<backend>.json``, and ``none.json`` (every
cost zero) is written next to them. The full profile output (parquet tables,
report, plots) stays in ``--work-dir`` for inspection; re-running resumes there.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np

from cdbench.harness.costs.grammar_profile import PROFILE_DIR, GrammarProfile
from cdbench.profile.outputs import write_outputs
from cdbench.profile.runner import ProfileConfig, prepare_tasks, profile_tasks

BACKENDS = ("xgrammar", "llguidance", "outlines")
VOCAB = "qwen3.6"


def choose_per_kind(tasks: list, per_kind: int, seed: int) -> list:
    """Up to ``per_kind`` tasks of each kind, a seeded choice, in corpus order."""
    rng = np.random.default_rng(seed)
    by_kind: dict[str, list[int]] = {}
    for index, task in enumerate(tasks):
        by_kind.setdefault(task.kind, []).append(index)
    chosen: list[int] = []
    for indices in by_kind.values():
        take = min(per_kind, len(indices))
        chosen.extend(rng.choice(indices, size=take, replace=False).tolist())
    return [tasks[i] for i in sorted(chosen)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-kind", type=int, default=12, help="items per constraint kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default="embedded")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--compile-timeout", type=float, default=60.0, help="seconds per compile")
    parser.add_argument("--work-dir", type=Path, default=Path(".cache/default_profiles"))
    parser.add_argument("--dest", type=Path, default=PROFILE_DIR)
    args = parser.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    command = shlex.join(["python", "scripts/build_default_profiles.py", *(sys.argv[1:] if argv is None else argv)])

    config = ProfileConfig(backends=backends, corpora=[args.corpus], vocab=VOCAB, seed=args.seed,
                           compile_timeout_s=args.compile_timeout, valid_instances=1, invalid_instances=0)
    prepared = prepare_tasks(config)
    for line in prepared.skipped:
        print(f"skipped: {line}", file=sys.stderr)
    tasks = choose_per_kind(prepared.tasks, args.per_kind, args.seed)
    kinds = sorted({t.kind for t in tasks})
    print(f"profiling {len(tasks)} items ({', '.join(kinds)}) on {', '.join(backends)}", file=sys.stderr)
    store, _ = profile_tasks(config, tasks, args.work_dir)
    results = [store.results[(t.corpus, t.item_id, b)] for t in tasks for b in backends]
    write_outputs(results, config, args.work_dir, command=command)

    args.dest.mkdir(parents=True, exist_ok=True)
    for backend in backends:
        shutil.copyfile(args.work_dir / f"profile_{backend}.json", args.dest / f"{backend}.json")
        profile = GrammarProfile.load(args.dest / f"{backend}.json")
        o = profile.overall
        print(f"{backend}: {o.items} compiles ({o.rate('ok'):.0%} ok), compile p50 {o.compile_s.p50 * 1e3:.2f} ms, "
              f"fill p50 {o.fill_s.p50 * 1e6:.1f} us p99 {o.fill_s.p99 * 1e6:.1f} us over {o.fill_s.count} tokens")
    GrammarProfile.zero("none", VOCAB).save(args.dest / "none.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
