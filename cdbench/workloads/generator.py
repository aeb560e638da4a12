"""Expanding a :class:`WorkloadConfig` into requests.

>>> from cdbench.backends.vocab import load_vocab
>>> wl = generate(WorkloadConfig(num_requests=5, kinds=["choice"]), load_vocab("cl100k"), progress=False)
>>> len(wl.requests), wl.requests[0].output_tokens[-1] in load_vocab("cl100k").eos_token_ids
(5, True)

Every random choice draws from its own stream of ``SeedSequence(config.seed)``
(arrivals, structured mix, specs, lengths, reasoning, instances, random walk,
kind mix),
so changing one aspect of the config does not reshuffle the others.

Corpus items are told apart by their spec, not their id: items whose spec has
the same canonical text as an earlier item are dropped (listed in
``Workload.duplicate_specs``), and instance pools are keyed by the spec's hash.
A spec's pool comes from ``config.instance_seed``, not the workload seed (the
same instances at every seed), and its requests take the pool's instances in
turn from a seeded start.
A config with ``trace`` replays that trace instead (:func:`cdbench.workloads.trace.replay`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from rich.progress import Progress, TaskID

from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import Vocabulary
from cdbench.workloads.config import WorkloadConfig
from cdbench.workloads.corpora import CorpusItem, SkippedLine, load_corpora
from cdbench.workloads.instances import (
    InstanceFailure,
    InstancePool,
    PoolCache,
    spec_hash,
)
from cdbench.workloads.request import Request, WalkParams
from cdbench.workloads.trace import replay
from cdbench.workloads.workload import Workload

# Append new streams at the end: a stream's seed is its index here, so earlier streams stay the same.
_STREAMS = ("arrivals", "structured", "specs", "prompt", "output", "reasoning", "instances", "walk", "kinds")


def unique_copy(item: CorpusItem, copy: int) -> tuple[str, ConstraintSpec]:
    """A spec equal in meaning to ``item`` but distinct in canonical text (see SpecReuse)."""
    spec = item.to_spec()
    if copy == 0:
        return item.id, spec
    if spec.kind == "json_schema" and isinstance(spec.spec, dict):
        return f"{item.id}#copy{copy}", ConstraintSpec(spec.kind, {**spec.spec, "$comment": f"cdbench copy {copy}"}, spec.options)
    return f"{item.id}#copy{copy}", ConstraintSpec(spec.kind, spec.spec, {**spec.options, "unique_copy": copy})


def original_of_copy(spec: ConstraintSpec) -> ConstraintSpec:
    """The corpus spec a :func:`unique_copy` was made from (``spec`` itself when it is no copy): a copy
    costs what its original costs, so measurements are shared between them."""
    if spec.kind == "json_schema" and isinstance(spec.spec, dict) and \
            str(spec.spec.get("$comment", "")).startswith("cdbench copy "):
        return ConstraintSpec(spec.kind, {k: v for k, v in spec.spec.items() if k != "$comment"}, spec.options)
    if "unique_copy" in spec.options:
        return ConstraintSpec(spec.kind, spec.spec, {k: v for k, v in spec.options.items() if k != "unique_copy"})
    return spec


class _SpecPicker:
    """Draws specs for structured requests, building pools lazily and skipping failed specs.

    Items are distinct by spec (``items`` already deduplicated); pools and
    failures are keyed by the spec's hash, so an id can never lend its pool to
    another spec.
    """

    def __init__(self, config: WorkloadConfig, items: list[CorpusItem], hashes: dict[str, str], vocab: Vocabulary,
                 rng: np.random.Generator, cache: PoolCache, progress: Progress | None, task: TaskID | None,
                 label: str = "") -> None:
        self.config, self.vocab, self.rng, self.cache, self.progress = config, vocab, rng, cache, progress
        self.order = [items[i] for i in rng.permutation(len(items))]
        self.hashes = hashes
        self.pools: dict[str, InstancePool] = {}
        self.failed: dict[str, InstanceFailure] = {}
        self.turns: dict[str, int] = {}  # item hash -> its next request's turn through the item's pool
        self.next_unique = 0
        self.label = label
        if config.spec_reuse.mode == "zipf" and self.order:
            weights = 1.0 / np.arange(1, len(self.order) + 1) ** config.spec_reuse.zipf_s
            self.zipf_p = weights / weights.sum()
        self.task = task

    def pool(self, item: CorpusItem) -> InstancePool | None:
        """The item's pool (``None`` without an oracle source); failures are remembered."""
        if self.config.token_source != "oracle":
            return None
        key = self.hashes[item.id]
        if key not in self.pools and key not in self.failed:
            try:
                self.pools[key] = self.cache.get(item.id, item.to_spec(), self.vocab,
                                                 size=self.config.instances_per_spec, seed=self.config.instance_seed)
            except InstanceFailure as failure:
                self.failed[key] = failure
            if self.progress is not None:
                self.progress.advance(self.task)
        return self.pools.get(key)

    def instance(self, item: CorpusItem, pool: InstancePool, rng: np.random.Generator) -> int:
        """The pool index of ``item``'s next request: its instances in turn from a seeded start, so that a
        spec drawn as often as its pool is large answers with each instance once (a draw per request
        would leave some out and repeat others)."""
        key = self.hashes[item.id]
        turn = self.turns.get(key)
        if turn is None:
            turn = int(rng.integers(len(pool.tokens)))
        self.turns[key] = turn + 1
        return turn % len(pool.tokens)

    def usable(self, item: CorpusItem) -> bool:
        self.pool(item)
        return self.hashes[item.id] not in self.failed

    def draw(self) -> tuple[CorpusItem, int]:
        """The next (item, copy number)."""
        mode = self.config.spec_reuse.mode
        n = len(self.order)
        for _ in range(10 * n + 100):
            if len(self.failed) >= n:
                break
            if mode == "same":
                item = next((it for it in self.order if self.usable(it)), None)
                if item is None:
                    break
                return item, 0
            if mode == "unique":
                index = self.next_unique
                self.next_unique += 1
                item, copy = self.order[index % n], index // n
            else:
                item, copy = self.order[int(self.rng.choice(n, p=self.zipf_p))], 0
            if self.usable(item):
                return item, copy
        raise ValueError(f"no {self.label}spec of the corpus has a valid instance ({len(self.failed)} failed)")


def kind_groups(items: list[CorpusItem], weights: dict[str, float] | None
                ) -> tuple[list[str], list[list[CorpusItem]], np.ndarray]:
    """The kinds to draw, each kind's items and its probability (``config.kind_weights``
    over the kinds ``items`` has); one group of every item, kind ``""``, without weights (or items)."""
    if weights is None or not items:
        return [""], [items], np.ones(1)
    kinds = [k for k, w in weights.items() if w > 0 and any(it.kind == k for it in items)]
    if not kinds:
        present = sorted({it.kind for it in items})
        raise ValueError(f"kind_weights gives no weight to a kind the corpus has (its kinds: {', '.join(present)})")
    p = np.array([weights[k] for k in kinds], dtype=float)
    return kinds, [[it for it in items if it.kind == k] for k in kinds], p / p.sum()


def kind_sequence(p: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` group indices in a seeded random order, group ``g`` exactly ``p[g] * count`` times
    (largest-remainder rounding), so a small workload has the configured mix rather than a draw of it."""
    exact = p * count
    counts = np.floor(exact).astype(np.intp)
    counts[np.argsort(counts - exact, kind="stable")[: count - counts.sum()]] += 1
    return rng.permutation(np.repeat(np.arange(len(p)), counts))


def distinct_specs(items: list[CorpusItem]) -> tuple[list[CorpusItem], dict[str, str], dict[str, str]]:
    """``items`` without repeats of an earlier item's spec (canonical text), the dropped ids
    (id → kept id), and each kept id's spec hash."""
    kept: list[CorpusItem] = []
    dropped: dict[str, str] = {}
    first: dict[str, str] = {}  # spec hash -> first id
    hashes: dict[str, str] = {}
    for item in items:
        h = spec_hash(item.to_spec())
        if h in first:
            dropped[item.id] = first[h]
            continue
        first[h] = item.id
        hashes[item.id] = h
        kept.append(item)
    return kept, dropped, hashes


def generate(config: WorkloadConfig, vocab: Vocabulary, *, cache: PoolCache | None = None,
             progress: bool = True, on_progress: Callable[[float], None] | None = None) -> Workload:
    """Expand ``config`` into a :class:`Workload` of ``config.num_requests`` requests
    (or replay ``config.trace``).

    ``progress`` shows this function's own progress bar; ``on_progress``, for a
    caller that owns the display, is called with the fraction of requests built
    (at most about a hundred times).
    """
    if config.trace is not None:
        return replay(config, vocab)
    assert config.num_requests is not None  # WorkloadConfig requires it without a trace
    if on_progress is not None:
        on_progress(0.0)  # before the corpora load and the per-request draws, which take a while for large runs
    streams = dict(zip(_STREAMS, (np.random.default_rng(s) for s in np.random.SeedSequence(config.seed).spawn(len(_STREAMS)))))
    n = config.num_requests
    items: list[CorpusItem] = []
    hashes: dict[str, str] = {}
    duplicates: dict[str, str] = {}
    skipped: list[SkippedLine] = []
    libraries: list[str] = []
    structured = streams["structured"].random(n) < config.structured_ratio
    if structured.any():
        load = load_corpora(config.corpus, kinds=config.kinds, id_prefix=config.id_prefix,
                            sample=config.corpus_sample, seed=config.seed, limit=config.corpus_limit)
        skipped, libraries = load.skipped, load.library_ids
        if not load.items:
            raise ValueError(f"corpus {config.corpus} has no items after filtering (kinds={config.kinds}, "
                             f"id_prefix={config.id_prefix!r})")
        items, duplicates, hashes = distinct_specs(load.items)
    kinds, groups, kind_p = kind_groups(items, config.kind_weights)
    kind_of = np.zeros(n, dtype=np.intp)
    if len(kinds) > 1:  # only then, so a config without weights keeps its workload
        kind_of[structured] = kind_sequence(kind_p, int(structured.sum()), streams["kinds"])
    arrivals = config.arrival.times(n, streams["arrivals"])
    prompt = np.maximum(config.prompt_len.sample(n, streams["prompt"]), 1)
    output = np.maximum(config.output_len.sample(n, streams["output"]), 1)
    thinks = streams["reasoning"].random(n) < config.reasoning.fraction
    think_len = config.reasoning.think_len.sample(n, streams["reasoning"])
    instance_rng = streams["instances"]
    walk = None
    if config.token_source == "random_walk":
        walk = WalkParams(seed=int(streams["walk"].integers(2**63)), eos_bias=config.random_walk.eos_bias,
                          max_tokens=config.random_walk.max_tokens)

    bar = Progress(transient=True, disable=not progress)
    requests: list[Request] = []
    with bar:
        shown = bar if progress else None
        task = shown.add_task("instance pools", total=None) if shown else None
        pool_cache = cache or PoolCache()
        pickers = [_SpecPicker(config, group, hashes, vocab, streams["specs"], pool_cache, shown, task,
                               f"{kind} " if kind else "")
                   for kind, group in zip(kinds, groups)]
        pools: dict[str, InstancePool] = {}
        report_every = max(n // 100, 1)
        for i in range(n):
            if on_progress is not None and i % report_every == 0:
                on_progress(i / n)
            spec = spec_id = tokens = index = None
            out_len = int(output[i])
            if structured[i]:
                picker = pickers[kind_of[i]]
                item, copy = picker.draw()
                spec_id, spec = unique_copy(item, copy)
                pool = picker.pool(item)
                if pool is not None:
                    index = picker.instance(item, pool, instance_rng)
                    tokens = pool.tokens[index]
                    out_len = len(tokens)
                    pools[spec_id] = pool
            requests.append(Request(
                request_id=i,
                arrival_s=float(arrivals[i]),
                prompt_len=int(prompt[i]),
                output_len=out_len,
                spec=spec,
                spec_id=spec_id,
                output_tokens=tokens,
                think_len=int(think_len[i]) if thinks[i] else 0,
                thinking_budget=config.reasoning.thinking_budget if thinks[i] else None,
                closed_loop=config.arrival.closed_loop,
                instance_index=index,
                random_walk=walk if structured[i] else None,
            ))
    # Arrival times are already sorted (cumulative gaps); keep ids in arrival order.
    failed = [failure for picker in pickers for failure in picker.failed.values()]
    return Workload(config, vocab.name, requests, pools, failed, skipped, libraries, duplicates)
