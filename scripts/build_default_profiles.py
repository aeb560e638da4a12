"""Build the default grammar profiles that ``model`` mode ships with, from in-situ hybrid runs.

Command (from the repository root; a few minutes a backend on 2 CPUs)::

    .venv/bin/python scripts/build_default_profiles.py --requests 1000 --seed 0

For each backend (``xgrammar``, ``llguidance``, ``outlines``) it records one
``hybrid`` run of the built-in default run config (cdbench/configs/default.yaml:
its workload, vocabulary, policy and load) with the backend swapped in::

    cdbench run --mode hybrid --set backend.name=<backend> --requests N --seed S --out <work-dir>/<backend>

and ships the run's ``grammar_profile.json`` (the costs measured inside the
run: per constraint kind, and per spec with compile time, fill scale and
position curve, accept) as
``cdbench/harness/costs/profiles/<backend>.json``, its ``source`` naming the
command, date, commit and engine versions. Costs measured in situ, between a
running batch's other work, are what ``model`` mode must reproduce; isolated
warm-loop measurements (``cdbench profile``) sit lower
(reports/fidelity/profiles_in_situ.md). ``none.json`` (every cost zero) is
written next to them. The run folders stay in ``--work-dir`` for inspection.

The default run has no speculative decoding, so it rolls nothing back; the
rollback costs come from a second hybrid run of the same config with drafts
(``--set workload.spec_decode.k=3 --set workload.spec_decode.alpha=0.6``,
``--spec-requests`` requests, into ``<work-dir>/<backend>-spec``): each kind's
(and each spec's) ``rollback_s`` is taken from it.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from cdbench.harness.costs.grammar_profile import PROFILE_DIR, GrammarProfile

BACKENDS = ("xgrammar", "llguidance", "outlines")
ENGINES = ("xgrammar", "llguidance", "outlines-core")
VOCAB = "qwen3.6"
CDBENCH = Path(sys.executable).with_name("cdbench")


def _versions() -> str:
    found = []
    for name in ENGINES:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def _run(backend: str, requests: int, seed: int, folder: Path, *extra: str) -> str:
    """Record one hybrid run of the default config with ``backend``; the command, as a user types it."""
    run = [str(CDBENCH), "run", "--mode", "hybrid", "--set", f"backend.name={backend}", "--requests", str(requests),
           "--seed", str(seed), *extra, "--out", str(folder), "--overwrite"]
    shown = shlex.join(["cdbench", *run[1:]])
    print("$", shown, file=sys.stderr)
    subprocess.run(run, check=True, stdout=subprocess.DEVNULL)
    return shown


def with_rollbacks(profile: GrammarProfile, spec_run: GrammarProfile) -> GrammarProfile:
    """``profile`` with each kind's, the pooled, and each spec's rollback costs taken from ``spec_run``."""
    kinds = {k: kp.model_copy(update={"rollback_s": spec_run.kind(k).rollback_s}) for k, kp in profile.kinds.items()}
    specs = {key: s.model_copy(update={"rollback_s": spec_run.specs[key].rollback_s})
             if key in spec_run.specs and spec_run.specs[key].rollback_s is not None else s
             for key, s in profile.specs.items()}
    overall = profile.overall.model_copy(update={"rollback_s": spec_run.overall.rollback_s})
    return profile.model_copy(update={"kinds": kinds, "overall": overall, "specs": specs})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests of each hybrid run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--spec-requests", type=int, default=100, help="requests of the run with drafts")
    parser.add_argument("--work-dir", type=Path, default=Path(".cache/default_profiles_in_situ"))
    parser.add_argument("--dest", type=Path, default=PROFILE_DIR)
    args = parser.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    command = shlex.join(["python", "scripts/build_default_profiles.py", *(sys.argv[1:] if argv is None else argv)])
    args.dest.mkdir(parents=True, exist_ok=True)
    for backend in backends:
        run = _run(backend, args.requests, args.seed, args.work_dir / backend)
        spec_run = _run(backend, args.spec_requests, args.seed, args.work_dir / f"{backend}-spec",
                        "--set", "workload.spec_decode.k=3", "--set", "workload.spec_decode.alpha=0.6")
        profile = with_rollbacks(GrammarProfile.load(args.work_dir / backend / "grammar_profile.json"),
                                 GrammarProfile.load(args.work_dir / f"{backend}-spec" / "grammar_profile.json"))
        when = datetime.now(UTC).strftime("%Y-%m-%d")
        profile = profile.model_copy(update={"source": (
            f"{command}: in situ, from `{run}`, rollbacks from `{spec_run}` (default run config, commit "
            f"{_commit()}, {when}; python {platform.python_version()}, {_versions()})")})
        profile.save(args.dest / f"{backend}.json")
        o = profile.overall
        print(f"{backend}: {o.items} compiles ({o.rate('ok'):.0%} ok), compile p50 {o.compile_s.p50 * 1e3:.2f} ms, "
              f"fill p50 {o.fill_s.p50 * 1e6:.1f} us p99 {o.fill_s.p99 * 1e6:.1f} us over {o.fill_s.count} tokens, "
              f"{len(profile.specs)} specs")
    GrammarProfile.zero("none", VOCAB).save(args.dest / "none.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
