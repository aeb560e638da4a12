"""Build the default grammar profiles that ``model`` mode ships with, from in-situ hybrid runs.

Command (from the repository root; a few minutes a backend on 2 CPUs)::

    .venv/bin/python scripts/build_default_profiles.py --backends xgrammar,llguidance --seed 0

For each backend (``xgrammar``, ``llguidance``, ``outlines``) it records one
``hybrid`` run of the built-in default run config (cdbench/configs/default.yaml:
its workload, vocabulary, policy and load) with the backend swapped in::

    cdbench run --mode hybrid --set backend.name=<backend> --requests N --seed S --out <work-dir>/<backend>

and ships the run's ``grammar_profile.json`` (the costs measured inside the
run: per constraint kind, and per spec with compile time, fill scale and
position curve, residual spread, outlier fills, accept, refusals) as
``cdbench/harness/costs/profiles/<backend>.parquet`` (the compressed profile
file, read a spec at a time: :class:`~cdbench.harness.costs.grammar_profile.LazySections`),
its ``source`` naming the
commands, date, commit and engine versions. Costs measured in situ, between a
running batch's other work, are what ``model`` mode must reproduce; isolated
warm-loop measurements (``cdbench profile``) sit lower
(reports/fidelity/profiles_in_situ.md). ``none.parquet`` (every cost zero) is
written next to them. The run folders stay in ``--work-dir`` for inspection.

Every instance of every spec of the corpus is profiled in situ: without
``--requests``, N is the smallest request count at which the default mix gives
each kind at least as many requests as it has spec instances (its distinct
specs times ``instances_per_spec``: :func:`covering_requests`; 3851 for the
embedded sample, whose 29 EBNF specs get 3 % of the requests). The workload
draws each kind's specs without repeats until all were drawn (``spec_reuse:
unique``), and a spec's requests take its instances in turn, so one run of
the default mix walks every instance at least once (a spec's fill cost depends
on the text it walks: ``model`` mode replays each walked text's own fills), and
the per-kind pools keep the default mix; the common kinds' specs are walked
many times (as copies, which ``model`` mode replays by their own or their
item's section). Instance pools are fixed by ``workload.instance_seed``, not
the workload seed, so these are the texts runs at any seed walk. After the
run, :func:`uncovered` lists the corpus specs the profile has no in-situ walk
of (a spec whose compile failed is covered by its failure).

The default run has no speculative decoding, so it rolls nothing back and
builds no draft rows; a second hybrid run of the same config with drafts
(``--set workload.spec_decode.k=3 --set workload.spec_decode.alpha=0.6``,
``--spec-requests`` requests, by default the fewest that walk every spec once, into
``<work-dir>/<backend>-spec``) gives each kind's and each spec's
``rollback_s`` and draft validity (``draft_tried``/``draft_valid``:
:func:`with_drafts`). The default workload has neither random walks nor the
``reasoner`` backend, so ``walk_ends`` and ``think_accept_s`` stay empty.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from cdbench.harness.config import RunConfig
from cdbench.harness.costs.grammar_profile import PROFILE_DIR, GrammarProfile
from cdbench.results.config_files import (
    builtin_config_path,
    read_yaml_mapping,
    validate_config,
)
from cdbench.workloads.config import WorkloadConfig
from cdbench.workloads.corpora import load_corpora
from cdbench.workloads.generator import distinct_specs, kind_groups, kind_sequence

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


def corpus_specs(workload: WorkloadConfig) -> dict[str, list[str]]:
    """The ids of the distinct specs ``workload`` draws from, per kind it gives a weight (all kinds: ``""``)."""
    load = load_corpora(workload.corpus, kinds=workload.kinds, id_prefix=workload.id_prefix,
                        sample=workload.corpus_sample, seed=workload.seed, limit=workload.corpus_limit)
    items = distinct_specs(load.items)[0]
    kinds, groups, _ = kind_groups(items, workload.kind_weights)
    return {kind: [item.id for item in group] for kind, group in zip(kinds, groups)}


def covering_requests(specs: Mapping[str, int], weights: Mapping[str, float] | None) -> int:
    """The fewest structured requests at which the mix ``weights`` gives every kind at least ``specs[kind]``
    requests (the generator's own rounding, :func:`~cdbench.workloads.generator.kind_sequence`), so that
    drawing each kind's specs without repeats walks all of them.

    >>> covering_requests({"json_schema": 160, "regex": 50, "choice": 50, "ebnf": 29},
    ...                   {"json_schema": 0.85, "regex": 0.06, "choice": 0.06, "ebnf": 0.03})
    951
    >>> covering_requests({"json_schema": 640, "regex": 200, "choice": 200, "ebnf": 116},
    ...                   {"json_schema": 0.85, "regex": 0.06, "choice": 0.06, "ebnf": 0.03})
    3851
    """
    kinds = list(specs)
    need = np.array([specs[k] for k in kinds])
    if weights is None:  # one group: the whole corpus alike
        return int(need.sum())
    p = np.array([weights[k] for k in kinds], dtype=float)
    p /= p.sum()
    rng = np.random.default_rng(0)  # only orders the sequence; the counts do not depend on it
    n = int(need.sum())
    while np.any(np.bincount(kind_sequence(p, n, rng), minlength=len(kinds)) < need):
        n += 1
    return n


def uncovered(profile: GrammarProfile, specs: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """Per kind, the spec ids of ``specs`` that ``profile`` has no in-situ walk of and no failed compile of."""
    seen = {s.spec_id for s in profile.specs.values() if s.fills or (s.status not in (None, "ok"))}
    seen |= set(profile.failed_specs)
    return {kind: missing for kind, ids in specs.items() if (missing := [i for i in ids if i not in seen])}


def _run(backend: str, requests: int, seed: int, folder: Path, *extra: str) -> str:
    """Record one hybrid run of the default config with ``backend``; the command, as a user types it."""
    run = [str(CDBENCH), "run", "--mode", "hybrid", "--set", f"backend.name={backend}", "--requests", str(requests),
           "--seed", str(seed), *extra, "--out", str(folder), "--overwrite"]
    shown = shlex.join(["cdbench", *run[1:]])
    print("$", shown, file=sys.stderr)
    subprocess.run(run, check=True, stdout=subprocess.DEVNULL)
    return shown


_DRAFT_FIELDS = ("rollback_s", "draft_tried", "draft_valid")


def with_drafts(profile: GrammarProfile, spec_run: GrammarProfile) -> GrammarProfile:
    """``profile`` with the rollback costs and draft validity (``draft_tried``/``draft_valid``) of
    ``spec_run`` (a run with drafts): each kind's, the pooled rollback, and each spec's that ``spec_run``
    measured (matched by spec key)."""
    kinds = {k: kp.model_copy(update={f: getattr(spec_run.kind(k), f) for f in _DRAFT_FIELDS})
             for k, kp in profile.kinds.items()}
    specs = {}
    for key, s in profile.specs.items():
        drafted = spec_run.specs.get(key)
        update = {} if drafted is None else {f: getattr(drafted, f) for f in _DRAFT_FIELDS
                                             if getattr(drafted, f) not in (None, [])}
        specs[key] = s.model_copy(update=update)
    overall = profile.overall.model_copy(update={"rollback_s": spec_run.overall.rollback_s})
    return profile.model_copy(update={"kinds": kinds, "overall": overall, "specs": specs})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=None,
                        help="requests of the hybrid run (default: the fewest that walk every instance of every corpus spec)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--spec-requests", type=int, default=None,
                        help="requests of the run with drafts (default: the fewest that walk every corpus spec)")
    parser.add_argument("--work-dir", type=Path, default=Path(".cache/default_profiles_in_situ"))
    parser.add_argument("--dest", type=Path, default=PROFILE_DIR)
    args = parser.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    command = shlex.join(["python", "scripts/build_default_profiles.py", *(sys.argv[1:] if argv is None else argv)])
    default = validate_config(RunConfig, read_yaml_mapping(builtin_config_path("default")), "default.yaml")
    if default.workload.structured_ratio != 1.0:
        raise SystemExit("the default workload has plain requests: covering_requests counts structured ones only")
    specs = corpus_specs(default.workload)
    weights, per_spec = default.workload.kind_weights, default.workload.instances_per_spec
    covering = covering_requests({k: len(ids) * per_spec for k, ids in specs.items()}, weights)
    requests = args.requests or covering
    spec_requests = args.spec_requests or covering_requests({k: len(ids) for k, ids in specs.items()}, weights)
    print(f"corpus: {sum(map(len, specs.values()))} distinct specs "
          f"({', '.join(f'{k} {len(v)}' for k, v in specs.items())}); {covering} requests walk each of their "
          f"{per_spec} instances; running {requests}", file=sys.stderr)
    args.dest.mkdir(parents=True, exist_ok=True)
    for backend in backends:
        run = _run(backend, requests, args.seed, args.work_dir / backend)
        spec_run = _run(backend, spec_requests, args.seed, args.work_dir / f"{backend}-spec",
                        "--set", "workload.spec_decode.k=3", "--set", "workload.spec_decode.alpha=0.6")
        profile = with_drafts(GrammarProfile.load(args.work_dir / backend / "grammar_profile.json"),
                              GrammarProfile.load(args.work_dir / f"{backend}-spec" / "grammar_profile.json"))
        missing = uncovered(profile, specs)
        coverage = (f"walks all {sum(map(len, specs.values()))} corpus specs" if not missing else
                    "no in-situ walk of " + "; ".join(f"{k}: {', '.join(ids)}" for k, ids in missing.items()))
        coverage += f", {len(profile.instances)} instances"
        when = datetime.now(UTC).strftime("%Y-%m-%d")
        profile = profile.model_copy(update={"source": (
            f"{command}: in situ, from `{run}` ({coverage}), rollbacks and draft validity from `{spec_run}` "
            f"(default run config, commit {_commit()}, {when}; python {platform.python_version()}, {_versions()})")})
        profile.save(args.dest / f"{backend}.parquet")
        o = profile.overall
        print(f"{backend}: {o.items} compiles ({o.rate('ok'):.0%} ok), compile p50 {o.compile_s.p50 * 1e3:.2f} ms, "
              f"fill p50 {o.fill_s.p50 * 1e6:.1f} us p99 {o.fill_s.p99 * 1e6:.1f} us over {o.fill_s.count} tokens, "
              f"{len(profile.specs)} specs; {coverage}")
    GrammarProfile.zero("none", VOCAB).save(args.dest / "none.parquet")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
