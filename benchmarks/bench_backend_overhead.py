"""What cdbench's Matcher layer adds to each engine's own per-token work.

For each engine (xgrammar, llguidance, outlines) and each instance (a JSON
object and a regex match), one repetition walks the instance's tokens on fresh
matchers in lockstep, each token stepped on every arm, the arms' order cycling
through all permutations (so each arm runs after each other arm equally often):

* **engine**: the engine's own calls, the cheapest way to make them with the
  contract of :class:`cdbench.backends.base.Matcher` (an accept that refuses a
  token leaves the state as it was): xgrammar
  ``GrammarMatcher.fill_next_token_bitmask`` / ``accept_token``; llguidance
  ``LLMatcher.unsafe_compute_mask_ptr``, the call inside
  ``llguidance.torch.fill_next_token_bitmask``, / ``try_consume_tokens``;
  outlines-core ``Guide.write_mask_into`` / ``advance``; row pointers computed
  once per walk;
* **cdbench**: :class:`~cdbench.backends.base.Matcher` ``fill_mask`` + ``accept``;
* **reasoner**: :class:`~cdbench.backends.reasoner.ReasonerMatcher` in the answer
  phase (a thinking matcher that has just accepted ``</think>``), wrapping the
  cdbench matcher (left out, with a note, on a vocabulary where ``</think>`` is
  not one token, such as cl100k);
* **consume** (llguidance only, for reference): ``consume_token`` instead of
  ``try_consume_tokens``. It is what vLLM and SGLang call after masking, but a
  token it refuses puts the matcher into an error state for good, so it cannot
  serve ``Matcher.accept``; the report shows how much its validation costs.

A step is one fill (the first of that state, so llguidance's per-state mask
cache never serves it) and one accept, timed alone. An arm's walk time is the
sum over token positions of the median step time over repetitions, so a step
that another process interrupted does not count; the ratio of two arms is the
ratio of those sums. The issue's bar is wrapper / engine <= 1.05 for each
backend: cdbench / engine and reasoner / engine, judged per backend on its
per-token time over both instances together (each instance's own ratio is
reported beside it); the script exits 1 when any judged ratio is over it.

Usage::

    python benchmarks/bench_backend_overhead.py [--vocab NAME ...] [--reps 1000] [--out reports/backend_overhead.md]

``--vocab`` may be repeated (default: qwen3.6); the report has one section per vocabulary.
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
from functools import cache
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

# --- the ways to step ------------------------------------------------------------------------
# Each binder takes an engine-level matcher (or a cdbench one) and the mask and
# returns ``step(token)`` (fill, then accept) and ``fill()``; the calls are
# bound to locals so that the arms differ only in what they call.

Binder = Callable[[object, torch.Tensor], tuple[Callable[[int], object], Callable[[], object]]]


def _steps(fill: Callable[[], object], accept: Callable[[int], object]):
    return (lambda token: (fill(), accept(token))), fill


# engine: the cheapest calls, no checks, the row pointer computed once per walk (the bar's baseline).
def _xgrammar_engine(matcher, mask: torch.Tensor):
    fill, accept = matcher._handle.fill_next_token_bitmask, matcher._handle.accept_token
    return _steps(lambda: fill(mask, 0, False), lambda token: accept(token, False))


def _llguidance_engine(matcher, mask: torch.Tensor):
    fill, consume = matcher.unsafe_compute_mask_ptr, matcher.try_consume_tokens
    ptr, nbytes = mask.data_ptr(), mask.shape[1] * 4
    return _steps(lambda: fill(ptr, nbytes), lambda token: consume([token]))


def _outlines_engine(guide, mask: torch.Tensor):
    write, advance = guide.write_mask_into, guide.advance
    ptr, words = mask.data_ptr(), mask.shape[1]
    return _steps(lambda: write(ptr, words, 4), lambda token: advance(token, return_tokens=False))


# public: each engine's own documented Python calls for a torch mask.
def _xgrammar_public(matcher, mask: torch.Tensor):
    fill, accept = matcher.fill_next_token_bitmask, matcher.accept_token
    return _steps(lambda: fill(mask, 0), accept)


def _llguidance_public(matcher, mask: torch.Tensor):
    from llguidance.torch import fill_next_token_bitmask

    consume = matcher.try_consume_tokens
    return _steps(lambda: fill_next_token_bitmask(matcher, mask, 0), lambda token: consume([token]))


def _outlines_public(guide, mask: torch.Tensor):
    from outlines_core.kernels.torch import fill_next_token_bitmask

    advance = guide.advance
    return _steps(lambda: fill_next_token_bitmask(guide, mask), lambda token: advance(token, return_tokens=False))


# frames: the engine calls behind one Python method each, taking (mask, row) and a token as a
# Matcher does, with nothing else: the least any Python Matcher can cost.
class _XGrammarFrames:
    __slots__ = ("_fill", "_accept")

    def __init__(self, matcher, mask: torch.Tensor) -> None:
        self._fill, self._accept = matcher._handle.fill_next_token_bitmask, matcher._handle.accept_token

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        self._fill(mask, row, False)

    def accept(self, token: int) -> bool:
        return self._accept(token, False)


class _LLGuidanceFrames:
    __slots__ = ("_fill", "_consume", "_base", "_size")

    def __init__(self, matcher, mask: torch.Tensor) -> None:
        self._fill, self._consume = matcher.unsafe_compute_mask_ptr, matcher.try_consume_tokens
        self._base, self._size = mask.data_ptr(), mask.shape[1] * 4

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        self._fill(self._base + row * self._size, self._size)

    def accept(self, token: int) -> bool:
        return self._consume([token]) == 1


class _OutlinesFrames:
    __slots__ = ("_write", "_advance", "_base", "_size")

    def __init__(self, guide, mask: torch.Tensor) -> None:
        self._write, self._advance = guide.write_mask_into, guide.advance
        self._base, self._size = mask.data_ptr(), mask.shape[1] * 4

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        self._write(self._base + row * self._size, self._size >> 2, 4)

    def accept(self, token: int) -> bool:
        self._advance(token, return_tokens=False)
        return True


def _bind_matcher(matcher, mask: torch.Tensor):
    fill, accept = matcher.fill_mask, matcher.accept
    return _steps(lambda: fill(mask, 0), accept)


def _frames(cls: type) -> Binder:
    return lambda matcher, mask: _bind_matcher(cls(matcher, mask), mask)


def _llguidance_consume(matcher, mask: torch.Tensor):
    fill, consume = matcher.unsafe_compute_mask_ptr, matcher.consume_token
    ptr, nbytes = mask.data_ptr(), mask.shape[1] * 4
    return _steps(lambda: fill(ptr, nbytes), consume)


BINDERS: dict[str, dict[str, Binder]] = {
    "xgrammar": {"engine": _xgrammar_engine, "public": _xgrammar_public, "frames": _frames(_XGrammarFrames)},
    "llguidance": {"engine": _llguidance_engine, "public": _llguidance_public, "frames": _frames(_LLGuidanceFrames),
                   "consume": _llguidance_consume},
    "outlines": {"engine": _outlines_engine, "public": _outlines_public, "frames": _frames(_OutlinesFrames)},
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


@dataclass
class Case:
    vocab: str
    engine: str
    instance: Instance
    tokens: list[int]
    eos: int
    mask: torch.Tensor
    arms: tuple[Arm, ...]
    step_ns: dict[str, list[np.ndarray]] = field(default_factory=dict)  # arm -> per repetition, ns per step

    def has(self, arm: str) -> bool:
        return any(a.name == arm for a in self.arms)


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


def _answering(reasoner: ReasonerBackend, grammar: CompiledGrammar):
    """A reasoner matcher in the answer phase, reached as a thinking request reaches it."""
    matcher = reasoner.matcher(grammar)
    if not matcher.accept(reasoner.think_end_id):
        raise SystemExit("the reasoner refused its think-end token")
    return matcher


def build_cases(vocab_name: str) -> tuple[list[Case], str | None]:
    """The cases of one vocabulary, and why the reasoner arm is left out (``None`` when it is there)."""
    vocab = load_vocab(vocab_name)
    cases = []
    no_reasoner = None
    mask = None  # one mask for every case, as a server has one batch mask that every request's matcher fills
    with Progress(transient=True) as progress:
        task = progress.add_task(f"compiling on {vocab_name}", total=len(ENGINES) * len(INSTANCES))
        for engine in ENGINES:
            backend = create_backend(engine, vocab)
            try:
                reasoner = ReasonerBackend(vocab, inner=backend)
            except ValueError as err:  # '</think>' is not one token of this vocabulary
                reasoner, no_reasoner = None, str(err)
            for instance in INSTANCES:
                grammar = backend.compile(instance.spec)
                make_engine = _engine_matcher_factory(engine, backend, grammar)
                arms = [Arm(name, make_engine, bind) for name, bind in BINDERS[engine].items()]
                arms.append(Arm("cdbench", lambda b=backend, g=grammar: b.matcher(g), _bind_matcher))
                if reasoner is not None:
                    arms.append(Arm("reasoner", lambda r=reasoner, g=grammar: _answering(r, g),
                                    _bind_matcher))
                mask = backend.allocate_mask(1) if mask is None else mask
                case = Case(vocab_name, engine, instance, vocab.encode(instance.text), vocab.eos_token_ids[0],
                            mask, tuple(arms))
                _check_same_work(case)
                cases.append(case)
                progress.advance(task)
    return cases, no_reasoner


@cache
def _orders(arms: tuple[Arm, ...]) -> list[tuple[Arm, ...]]:
    """A Williams design: orders of the arms in which each arm runs right after each other arm
    equally often. With one fixed cyclic order, the arm that always ran right after the engine
    arm came out 5-10 % slower than an identical copy of itself placed elsewhere."""
    n = len(arms)
    base = [0] + [(i + 1) // 2 if i % 2 else n - i // 2 for i in range(1, n)]
    rows = [[(b + shift) % n for b in base] for shift in range(n)]
    if n % 2:  # an odd count needs the mirrored orders too
        rows += [row[::-1] for row in rows]
    return [tuple(arms[i] for i in row) for row in rows]


def run(cases: list[Case], reps: int, warmup: int) -> None:
    """Step every case's arms in lockstep ``warmup + reps`` times, timing each step alone."""
    clock = time.perf_counter_ns
    with Progress(transient=True) as progress:
        task = progress.add_task("walking instances", total=(warmup + reps) * len(cases))
        for rep in range(warmup + reps):
            for case in cases:
                orders = _orders(case.arms)
                order = orders[rep % len(orders)]
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

    @property
    def within_bar(self) -> bool:
        return self.ratio <= THRESHOLD

    def cells(self) -> str:
        return (f"{self.base_us_per_token:.2f} | {self.arm_us_per_token:.2f} | {self.ratio:.3f} "
                f"({self.ratio_iqr[0]:.2f}–{self.ratio_iqr[1]:.2f}) | {self.added_ns_per_token:+.0f}")


def comparisons(cases: list[Case]) -> list[tuple[str, str, str, Comparison]]:
    """``(arm, engine, instance, arm / engine)`` for cdbench and (where measured) the reasoner over
    each engine, per instance and for both instances together (``"both"``, the judged one)."""
    out = []
    for arm in ("cdbench", "reasoner"):
        for engine in ENGINES:
            mine = [c for c in cases if c.engine == engine and c.has(arm)]
            if mine:
                out += [(arm, engine, c.instance.name, Comparison.of([c], arm, "engine")) for c in mine]
                out.append((arm, engine, "both", Comparison.of(mine, arm, "engine")))
    return out


def judged(cases: list[Case]) -> list[tuple[str, str, str, Comparison]]:
    """The comparisons the bar applies to: each backend's per-token time over both instances."""
    return [row for row in comparisons(cases) if row[2] == "both"]


def _verdict(instance: str, comp: Comparison) -> str:
    if instance != "both":
        return "(this instance alone)"
    return "ok" if comp.within_bar else "**over the bar**"


def render_vocab(cases: list[Case], vocab: str, no_reasoner: str | None) -> list[str]:
    lines = [f"## {vocab}", ""]
    for arm, title in (("cdbench", "cdbench Matcher over the engine"),
                       ("reasoner", "Reasoner (answer phase, over the cdbench Matcher) over the engine")):
        lines += [f"### {title}", ""]
        rows = [(engine, instance, comp) for a, engine, instance, comp in comparisons(cases) if a == arm]
        if not rows:
            lines += [f"Not measured on {vocab}: {no_reasoner}.", ""]
            continue
        lines += [
            f"| engine | instance | tokens | engine µs/token | {arm} µs/token | {arm} / engine (IQR) "
            f"| added ns/token | verdict |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for engine, instance, comp in rows:
            tokens = sum(len(c.tokens) for c in cases if c.engine == engine and instance in ("both", c.instance.name))
            name = f"**{instance}**" if instance == "both" else instance
            lines.append(f"| {engine} | {name} | {tokens} | {comp.cells()} | {_verdict(instance, comp)} |")
        lines.append("")
    lines += [
        "### Where the added time goes, and the engines' own Python calls",
        "",
        "ns per token over the engine arm: *frames* is the least any Python Matcher adds (the engine calls",
        "behind one method each); cdbench − frames is what cdbench's checks and bookkeeping add; *public* is",
        "each engine's own documented Python call for a torch mask, against which cdbench / public is given.",
        "",
        "| engine | instance | frames | cdbench − frames | reasoner − cdbench | public | cdbench / public |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case in cases:
        frames = Comparison.of([case], "frames", "engine").added_ns_per_token
        mine = Comparison.of([case], "cdbench", "engine").added_ns_per_token
        reasoner = (f"{Comparison.of([case], 'reasoner', 'cdbench').added_ns_per_token:+.0f}"
                    if case.has("reasoner") else "–")
        public = Comparison.of([case], "public", "engine").added_ns_per_token
        lines.append(f"| {case.engine} | {case.instance.name} | {frames:+.0f} | {mine - frames:+.0f} | {reasoner} "
                     f"| {public:+.0f} | {Comparison.of([case], 'cdbench', 'public').ratio:.3f} |")
    lines += [
        "",
        "### llguidance's `consume_token` (cannot refuse a token) against `try_consume_tokens`",
        "",
        "| instance | consume µs/token | engine (try) µs/token | try / consume (IQR) | added ns/token |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for case in [c for c in cases if c.has("consume")]:
        lines.append(f"| {case.instance.name} | {Comparison.of([case], 'engine', 'consume').cells()} |")
    return lines + [""]


def render(runs: dict[str, tuple[list[Case], str | None]], command: str, reps: int, warmup: int,
           load: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    over = [(vocab, arm, engine, instance) for vocab, (cases, _) in runs.items()
            for arm, engine, instance, comp in judged(cases) if not comp.within_bar]
    verdict = ("cdbench and the reasoner are within the bar over every engine and vocabulary"
               if not over else "over the bar: " + ", ".join(f"{a} over {e} ({v})" for v, a, e, _ in over))
    lines = [
        "# Backend wrapper overhead",
        "",
        f"Command: `{command}`",
        "",
        f"Verdict (cdbench / engine and reasoner / engine <= {THRESHOLD:.2f} for each backend, judged on its "
        f"per-token time over both instances together; each instance's own ratio is shown too): {verdict}.",
        "",
        f"Method: {reps} repetitions after {warmup} warm-up ones. A repetition walks each instance on fresh",
        "matchers in lockstep, one per arm, timing every step (one mask fill, the first of that state so",
        "llguidance's mask cache never serves it, and one accept) alone, garbage collector off. The arms run",
        "in the orders of a Williams design, so each runs right after each other equally often (with one",
        "fixed cyclic order the arm right after the engine arm came out 5-10 % slower than an identical copy",
        "of itself). All arms were checked to fill identical masks at every step. An arm's time is the sum over",
        "token positions of the median step time over repetitions, in µs per token; a ratio is the ratio of",
        "two such sums (in brackets the interquartile range of per-repetition walk-time ratios, which shows",
        "the machine's noise); *added* is the difference in ns per token.",
        "",
        "Arms. *engine* (the bar's baseline): the cheapest calls into each engine with the contract of",
        "`Matcher.accept` (a refused token leaves the state unchanged), no checks, the row pointer computed",
        "once per walk: xgrammar's native `GrammarMatcher._handle.fill_next_token_bitmask` / `accept_token`;",
        "llguidance `LLMatcher.unsafe_compute_mask_ptr` / `try_consume_tokens`; outlines-core",
        "`Guide.write_mask_into` / `advance`. *public*: each engine's own Python API for a torch mask",
        "(xgrammar `GrammarMatcher.fill_next_token_bitmask` / `accept_token`, `llguidance.torch.",
        "fill_next_token_bitmask`, `outlines_core.kernels.torch.fill_next_token_bitmask`, which check the",
        "mask on every call). *frames*: the engine calls behind one Python method each, as a Matcher takes",
        "them. *cdbench*: `Matcher.fill_mask` / `accept`, which check on every fill that the mask is the one",
        "the matcher checked last (a full check runs once per tensor) and that the row is in it, and count the",
        "accepted tokens (`history_length`) and keep what rollback and copy need (llguidance also checks the",
        "id's range, since an id past its vocabulary breaks its matcher). *reasoner*: the reasoner in its",
        "answer phase (a thinking matcher that has accepted `</think>`) over the cdbench matcher.",
        "*consume*: llguidance's `consume_token`, which vLLM and SGLang call after masking but which leaves the",
        "matcher in an error state for good when it refuses a token, so it cannot serve `Matcher.accept`.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, CPU affinity {sorted(os.sched_getaffinity(0))}, "
        f"load average (1, 5, 15 min) {_load(load[0])} at the start and {_load(load[1])} at the end; "
        f"Python {platform.python_version()}, torch {torch.__version__}, xgrammar {version('xgrammar')}, "
        f"llguidance {version('llguidance')}, outlines-core {version('outlines-core')}.",
        "",
    ]
    for vocab, (cases, no_reasoner) in runs.items():
        lines += render_vocab(cases, vocab, no_reasoner)
    lines += ["## Instances", ""]
    for inst in INSTANCES:
        lines.append(f"- **{inst.name}** ({inst.spec.kind}): `{inst.text}`")
    lines.append(f"- JSON schema: `{json.dumps(SCHEMA)}`")
    return "\n".join(lines) + "\n"


def _load(avg: tuple[float, ...]) -> str:
    return "/".join(f"{x:.2f}" for x in avg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", action="append", help="a vocabulary to measure on; repeat for several "
                        "(default: qwen3.6)")
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_backend_overhead.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    load_start = os.getloadavg()
    runs = {}
    for vocab in args.vocab or ["qwen3.6"]:
        cases, no_reasoner = build_cases(vocab)
        run(cases, args.reps, args.warmup)
        runs[vocab] = (cases, no_reasoner)
    report = render(runs, command.strip(), args.reps, args.warmup, (load_start, os.getloadavg()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, encoding="utf-8")
    print(report)
    within = all(comp.within_bar for cases, _ in runs.values() for *_, comp in judged(cases))
    return 0 if within else 1


if __name__ == "__main__":
    raise SystemExit(main())
