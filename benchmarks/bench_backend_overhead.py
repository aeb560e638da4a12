"""What cdbench's Matcher layer adds to each engine's own per-token work.

For each engine (xgrammar, llguidance, outlines) and each instance (a JSON
object and a regex match), one repetition walks the instance's tokens on three
fresh matchers in lockstep, each token stepped on all three in rotating order:

* **engine**: the engine's own calls, the cheapest way to make them (xgrammar
  ``GrammarMatcher.fill_next_token_bitmask`` / ``accept_token``; llguidance
  ``LLMatcher.unsafe_compute_mask_ptr``, the call inside
  ``llguidance.torch.fill_next_token_bitmask``, / ``consume_token``; outlines-core
  ``Guide.write_mask_into`` / ``advance``; row pointers computed once per walk);
* **cdbench**: :class:`cdbench.backends.base.Matcher` ``fill_mask`` + ``accept``;
* **reasoner**: :class:`~cdbench.backends.reasoner.ReasonerMatcher` in the answer
  phase, wrapping the cdbench matcher.

A step is one fill (the first of that state, so llguidance's per-state mask
cache never serves it) and one accept, timed alone. An arm's walk time is the
sum over token positions of the median step time over repetitions, so a step
that another process interrupted does not count; the ratio of two arms is the
ratio of those sums. The issue's bar is cdbench / engine <= 1.05 for each
engine; the script exits 1 when an engine is over it.

Usage::

    python benchmarks/bench_backend_overhead.py [--vocab qwen3.6] [--reps 1000] [--out reports/backend_overhead.md]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from cdbench.backends.base import CompiledGrammar, ConstraintSpec, GrammarBackend
from cdbench.backends.reasoner import ReasonerBackend
from cdbench.backends.registry import create_backend
from cdbench.backends.vocab import load_vocab

ENGINES = ("xgrammar", "llguidance", "outlines")
THRESHOLD = 1.05

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Instance:
    name: str
    spec: ConstraintSpec
    text: str


INSTANCES = (
    Instance(
        "json",
        ConstraintSpec("json_schema", SCHEMA),
        '{"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry", "engines"], "active": true}',
    ),
    Instance(
        "regex",
        ConstraintSpec("regex", r"[0-9]{1,5} [A-Z][a-z]+ (Street|Avenue|Road), [A-Z][a-z]+, [A-Z]{2} [0-9]{5}"),
        "221 Baker Street, Springfield, IL 62704",
    ),
)

# --- the three ways to step -------------------------------------------------------------------
# Each binder takes a matcher and the mask and returns ``step(token)`` (fill,
# then accept) and ``fill()``; the calls are bound to locals so that the arms
# differ only in what they call.

Binder = Callable[[object, torch.Tensor], tuple[Callable[[int], object], Callable[[], object]]]


def _bind_xgrammar(matcher, mask: torch.Tensor):
    fill, accept = matcher.fill_next_token_bitmask, matcher.accept_token
    return (lambda token: (fill(mask, 0), accept(token))), (lambda: fill(mask, 0))


def _bind_llguidance(matcher, mask: torch.Tensor):
    fill, consume = matcher.unsafe_compute_mask_ptr, matcher.consume_token
    ptr, nbytes = mask.data_ptr(), mask.shape[1] * 4
    return (lambda token: (fill(ptr, nbytes), consume(token))), (lambda: fill(ptr, nbytes))


def _bind_outlines(guide, mask: torch.Tensor):
    write, advance = guide.write_mask_into, guide.advance
    ptr, words = mask.data_ptr(), mask.shape[1]
    return (lambda token: (write(ptr, words, 4), advance(token, return_tokens=False))), (lambda: write(ptr, words, 4))


def _bind_cdbench(matcher, mask: torch.Tensor):
    fill, accept = matcher.fill_mask, matcher.accept
    return (lambda token: (fill(mask, 0), accept(token))), (lambda: fill(mask, 0))


ENGINE_BINDERS: dict[str, Binder] = {
    "xgrammar": _bind_xgrammar,
    "llguidance": _bind_llguidance,
    "outlines": _bind_outlines,
}


def _engine_matcher_factory(engine: str, backend: GrammarBackend, grammar: CompiledGrammar) -> Callable[[], object]:
    """A fresh engine-level matcher, built the way the cdbench backend builds its own."""
    if engine == "xgrammar":
        import xgrammar as xgr

        return lambda: xgr.GrammarMatcher(grammar.handle)
    if engine == "llguidance":
        return grammar.handle.deep_copy
    from outlines_core import Guide

    return lambda: Guide(grammar.handle, max_rollback=backend.max_rollback)


@dataclass(frozen=True)
class Arm:
    name: str
    make: Callable[[], object]
    bind: Binder


ARMS = ("engine", "cdbench", "reasoner")


@dataclass
class Case:
    engine: str
    instance: Instance
    tokens: list[int]
    eos: int
    mask: torch.Tensor
    arms: tuple[Arm, ...]
    step_ns: dict[str, list[np.ndarray]] = field(default_factory=dict)  # arm -> per repetition, ns per step


def _check_same_work(case: Case) -> None:
    """Every arm fills identical masks at each step and ends where EOS is allowed."""
    reference = None
    for arm in case.arms:
        step, fill = arm.bind(arm.make(), case.mask)
        rows = []
        for token in case.tokens:
            step(token)
            rows.append(case.mask[0].clone())
        fill()
        if not (int(case.mask[0, case.eos // 32]) >> (case.eos % 32)) & 1:
            raise SystemExit(f"{case.engine}/{case.instance.name}: {arm.name} did not accept the whole instance")
        steps = torch.stack(rows)
        if reference is None:
            reference = steps
        elif not torch.equal(steps, reference):
            raise SystemExit(f"{case.engine}/{case.instance.name}: {arm.name} masks differ from the engine's")


def build_cases(vocab_name: str) -> list[Case]:
    vocab = load_vocab(vocab_name)
    cases = []
    with Progress(transient=True) as progress:
        task = progress.add_task(f"compiling on {vocab_name}", total=len(ENGINES) * len(INSTANCES))
        for engine in ENGINES:
            backend = create_backend(engine, vocab)
            reasoner = ReasonerBackend(vocab, inner=backend)
            for instance in INSTANCES:
                grammar = backend.compile(instance.spec)
                arms = (
                    Arm("engine", _engine_matcher_factory(engine, backend, grammar), ENGINE_BINDERS[engine]),
                    Arm("cdbench", lambda b=backend, g=grammar: b.matcher(g), _bind_cdbench),
                    Arm("reasoner", lambda r=reasoner, g=grammar: r.matcher(g, thinking=False), _bind_cdbench),
                )
                case = Case(engine, instance, vocab.encode(instance.text), vocab.eos_token_ids[0],
                            backend.allocate_mask(1), arms)
                _check_same_work(case)
                cases.append(case)
                progress.advance(task)
    return cases


def run(cases: list[Case], reps: int, warmup: int) -> None:
    """Step every case's arms in lockstep ``warmup + reps`` times, timing each step alone."""
    clock = time.perf_counter_ns
    with Progress(transient=True) as progress:
        task = progress.add_task("walking instances", total=(warmup + reps) * len(cases))
        for rep in range(warmup + reps):
            for case in cases:
                shift = rep % len(case.arms)
                order = case.arms[shift:] + case.arms[:shift]
                steps = [arm.bind(arm.make(), case.mask)[0] for arm in order]
                times = np.empty((len(order), len(case.tokens)), dtype=np.int64)
                gc.disable()
                for i, token in enumerate(case.tokens):
                    for j, step in enumerate(steps):
                        start = clock()
                        step(token)
                        times[j, i] = clock() - start
                gc.enable()
                if rep >= warmup:
                    for j, arm in enumerate(order):
                        case.step_ns.setdefault(arm.name, []).append(times[j])
                progress.advance(task)


@dataclass(frozen=True)
class Comparison:
    """Arm ``arm`` against arm ``base`` over the same cases and repetitions."""

    base_us_per_token: float
    arm_us_per_token: float
    ratio: float
    ratio_iqr: tuple[float, float]  # of per-repetition walk-time ratios
    added_ns_per_token: float

    @classmethod
    def of(cls, cases: list[Case], arm: str, base: str) -> Comparison:
        tokens = sum(len(c.tokens) for c in cases)

        def walk_ns(name: str) -> float:  # sum over positions of the median step time
            return float(sum(np.median(np.stack(c.step_ns[name]), axis=0).sum() for c in cases))

        def per_rep(name: str) -> np.ndarray:
            return np.sum([np.stack(c.step_ns[name]).sum(axis=1) for c in cases], axis=0).astype(np.float64)

        mine, theirs = walk_ns(arm), walk_ns(base)
        spread = per_rep(arm) / per_rep(base)
        return cls(
            base_us_per_token=theirs / tokens / 1e3,
            arm_us_per_token=mine / tokens / 1e3,
            ratio=mine / theirs,
            ratio_iqr=(float(np.percentile(spread, 25)), float(np.percentile(spread, 75))),
            added_ns_per_token=(mine - theirs) / tokens,
        )

    def cells(self) -> str:
        return (f"{self.base_us_per_token:.2f} | {self.arm_us_per_token:.2f} | {self.ratio:.3f} "
                f"({self.ratio_iqr[0]:.2f}–{self.ratio_iqr[1]:.2f}) | {self.added_ns_per_token:+.0f}")


def render(cases: list[Case], command: str, vocab: str, reps: int, warmup: int) -> str:
    lines = [
        "# Backend wrapper overhead",
        "",
        f"Command: `{command}`",
        "",
        f"Vocabulary {vocab}; {reps} repetitions after {warmup} warm-up ones. A repetition walks each instance",
        "on three fresh matchers in lockstep (engine, cdbench, reasoner; the order rotates), timing every step",
        "(one mask fill, the first of that state so llguidance's mask cache never serves it, and one accept)",
        "alone, garbage collector off. All arms were checked to fill identical masks at every step.",
        "An arm's time is the sum over token positions of the median step time over repetitions, in µs per",
        "token; a ratio is the ratio of two such sums (in brackets the interquartile range of per-repetition",
        "walk-time ratios, which shows the machine's noise); *added* is the difference in ns per token.",
        f"Bar: cdbench / engine <= {THRESHOLD:.2f} for each engine.",
        "",
        "Engine arm, the cheapest way to call each engine: xgrammar `GrammarMatcher.fill_next_token_bitmask`",
        "+ `accept_token`; llguidance `LLMatcher.unsafe_compute_mask_ptr` + `consume_token` (the public",
        "`llguidance.torch.fill_next_token_bitmask` is that call after dtype/device/shape asserts and a row",
        "view, which cost more than cdbench's whole `fill_mask`); outlines-core `Guide.write_mask_into` +",
        "`Guide.advance`. The engine arm computes mask row pointers once per walk.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, xgrammar {version('xgrammar')}, llguidance {version('llguidance')}, "
        f"outlines-core {version('outlines-core')}.",
        "",
        "## cdbench Matcher over the engine (both instances)",
        "",
        "| engine | engine µs/token | cdbench µs/token | cdbench / engine | added ns/token | verdict |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for engine in ENGINES:
        comp = Comparison.of([c for c in cases if c.engine == engine], "cdbench", "engine")
        verdict = "ok" if comp.ratio <= THRESHOLD else "over the bar"
        lines.append(f"| {engine} | {comp.cells()} | {verdict} |")
    lines += [
        "",
        "## Reasoner (answer phase) over the cdbench Matcher (both instances)",
        "",
        "| engine | cdbench µs/token | reasoner µs/token | reasoner / cdbench | added ns/token |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for engine in ENGINES:
        lines.append(f"| {engine} | {Comparison.of([c for c in cases if c.engine == engine], 'reasoner', 'cdbench').cells()} |")
    lines += [
        "",
        "## Per instance",
        "",
        "| engine | instance | tokens | engine µs/token | cdbench µs/token | cdbench / engine | added ns/token "
        "| reasoner / cdbench | reasoner added ns/token |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case in cases:
        comp = Comparison.of([case], "cdbench", "engine")
        reasoner = Comparison.of([case], "reasoner", "cdbench")
        lines.append(
            f"| {case.engine} | {case.instance.name} | {len(case.tokens)} | {comp.cells()} "
            f"| {reasoner.ratio:.3f} | {reasoner.added_ns_per_token:+.0f} |"
        )
    lines += ["", "## Instances", ""]
    for inst in INSTANCES:
        lines.append(f"- **{inst.name}** ({inst.spec.kind}): `{inst.text}`")
    lines.append(f"- JSON schema: `{json.dumps(SCHEMA)}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="qwen3.6")
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_backend_overhead.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    cases = build_cases(args.vocab)
    run(cases, args.reps, args.warmup)
    report = render(cases, command.strip(), args.vocab, args.reps, args.warmup)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, encoding="utf-8")
    print(report)
    over = [e for e in ENGINES if Comparison.of([c for c in cases if c.engine == e], "cdbench", "engine").ratio > THRESHOLD]
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
