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

from collections.abc import Callable, Iterator, Mapping
from typing import Any

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
        return f"{item.id}#copy{copy}", _SchemaCopy(spec.spec, spec.options, copy)
    return f"{item.id}#copy{copy}", ConstraintSpec(spec.kind, spec.spec, {**spec.options, "unique_copy": copy})


class _SchemaCopy(ConstraintSpec):
    """A JSON Schema copy of a corpus item: the item's schema with ``"$comment": "cdbench copy N"``, built
    each time it is read rather than held (a run of copies holds one a request: a schema dict each would
    be a third of a long run's workload). Equal, hashed and serialised as the spec it reads as; pickled
    (to a rank's process) as that plain spec."""

    def __init__(self, schema: dict, options: Mapping[str, Any], copy: int) -> None:
        object.__setattr__(self, "kind", "json_schema")
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "_schema", schema)  # the item's own (shared, not copied)
        object.__setattr__(self, "_copy", copy)

    @property
    def spec(self) -> dict:  # type: ignore[override]
        return {**self._schema, "$comment": f"cdbench copy {self._copy}"}

    def __repr__(self) -> str:
        return repr(ConstraintSpec(self.kind, self.spec, self.options))

    def __reduce__(self):
        return ConstraintSpec, (self.kind, self.spec, self.options)


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
    # (int8: a byte a request; a shuffle's draws do not depend on the item size)
    return rng.permutation(np.repeat(np.arange(len(p), dtype=np.int8), counts))


class _PackedKinds:
    """A kind sequence packed at the fewest bits a value of 1, 2, 4 or 8 holds ``kinds`` in (the default's
    four kinds: 2 bits a structured request, not a byte: the sequence is held for the whole run)."""

    def __init__(self, sequence: np.ndarray, kinds: int) -> None:
        self.bits = next(b for b in (1, 2, 4, 8) if kinds <= 1 << b)
        per = 8 // self.bits
        padded = np.zeros(-(-len(sequence) // per) * per, np.uint8)
        padded[:len(sequence)] = sequence
        columns = padded.reshape(-1, per)
        self.packed = np.zeros(len(columns), np.uint8)
        for j in range(per):
            self.packed |= columns[:, j] << np.uint8(j * self.bits)

    def slice(self, start: int, count: int) -> np.ndarray:
        """The sequence's values ``start`` to ``start + count`` (as ``sequence[start:start + count]``)."""
        at = np.arange(start, start + count) * self.bits
        return ((self.packed[at >> 3] >> (at & 7).astype(np.uint8)) & np.uint8((1 << self.bits) - 1)).astype(np.int8)


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


CHUNK = 1 << 16
"""Requests whose per-request draws (arrival gaps, lengths, ...) are made at once by :class:`RequestStream`."""


class RequestStream:
    """The requests of ``config``, built as they are iterated, :data:`CHUNK` at a time: the same requests,
    value for value, as drawing every stream for all of them at once (each stream is read in order, a
    chunk after another; the reasoning stream's second use starts where its first ends, by advancing a
    copy of it), while holding only a chunk's draws, the instance pools and, under ``kind_weights``, one
    byte a structured request (its kind, from a seeded permutation of them all).

    What the requests drew on is kept as they are built: ``pools`` (each structured request's
    ``spec_id`` → its instance pool), ``failures`` (specs without a valid instance), and from the start
    ``skipped_lines``, ``library_ids`` and ``duplicates`` of the corpus. A stream is iterated once; once it
    has been, :attr:`counts` holds its requests, structured requests and distinct spec ids. ``on_progress``
    is called with the fraction of requests built (at most about a hundred times). ``keep_pools=False``:
    ``pools`` stays empty (a run that reads the requests' tokens from the requests themselves; under
    unique reuse it would hold an entry a request).
    """

    def __init__(self, config: WorkloadConfig, vocab: Vocabulary, *, cache: PoolCache | None = None,
                 progress: Progress | None = None, on_progress: Callable[[float], None] | None = None,
                 chunk: int = CHUNK, keep_pools: bool = True) -> None:
        assert config.num_requests is not None  # WorkloadConfig requires it without a trace
        self.config, self.vocab, self.chunk, self.on_progress = config, vocab, chunk, on_progress
        self.keep_pools = keep_pools
        self._structured = self._copies = 0
        self._items_used: set[str] = set()  # ids of corpus items drawn as themselves (copy 0)
        if on_progress is not None:
            on_progress(0.0)  # before the corpora load and the per-request draws, which take a while for large runs
        self.streams = dict(zip(_STREAMS, (np.random.default_rng(s) for s in
                                           np.random.SeedSequence(config.seed).spawn(len(_STREAMS)))))
        n = self.n = config.num_requests
        # a pass over a copy of the structured stream: whether any request is structured, and how many
        counting = _copy(self.streams["structured"])
        structured_count = sum(int(np.count_nonzero(counting.random(size) < config.structured_ratio))
                               for size in _sizes(n, chunk))
        items: list[CorpusItem] = []
        hashes: dict[str, str] = {}
        self.duplicates: dict[str, str] = {}
        self.skipped_lines: list[SkippedLine] = []
        self.library_ids: list[str] = []
        if structured_count:
            load = load_corpora(config.corpus, kinds=config.kinds, id_prefix=config.id_prefix,
                                sample=config.corpus_sample, seed=config.seed, limit=config.corpus_limit)
            self.skipped_lines, self.library_ids = load.skipped, load.library_ids
            if not load.items:
                raise ValueError(f"corpus {config.corpus} has no items after filtering (kinds={config.kinds}, "
                                 f"id_prefix={config.id_prefix!r})")
            items, self.duplicates, hashes = distinct_specs(load.items)
        kinds, groups, kind_p = kind_groups(items, config.kind_weights)
        # only with several kinds, so a config without weights keeps its workload
        self._kinds = (_PackedKinds(kind_sequence(kind_p, structured_count, self.streams["kinds"]), len(kinds))
                       if len(kinds) > 1 else None)
        self._walk = None
        if config.token_source == "random_walk":
            self._walk = WalkParams(seed=int(self.streams["walk"].integers(2**63)),
                                    eos_bias=config.random_walk.eos_bias, max_tokens=config.random_walk.max_tokens)
        task = progress.add_task("instance pools", total=None) if progress is not None else None
        pool_cache = cache or PoolCache()
        self._pickers = [_SpecPicker(config, group, hashes, vocab, self.streams["specs"], pool_cache, progress, task,
                                     f"{kind} " if kind else "")
                         for kind, group in zip(kinds, groups)]
        self.pools: dict[str, InstancePool] = {}

    @property
    def counts(self) -> tuple[int, int, int]:
        """(requests, structured requests, distinct spec ids) of the requests built so far: a copy
        (``id#copyN``, unique reuse) is made once, so only items drawn as themselves are remembered."""
        return self.n, self._structured, self._copies + len(self._items_used)

    @property
    def failures(self) -> list[InstanceFailure]:
        return [failure for picker in self._pickers for failure in picker.failed.values()]

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Request]:
        config, streams, n = self.config, self.streams, self.n
        # the reasoning stream draws who thinks for all requests, then the thinking lengths: the lengths'
        # stream is a copy of it n doubles on
        lengths_rng = _copy(streams["reasoning"])
        lengths_rng.bit_generator.advance(n)
        arrivals = config.arrival.chunks(n, streams["arrivals"], self.chunk)
        report_every = max(n // 100, 1)
        kinds_at = 0
        start = 0
        for size in _sizes(n, self.chunk):
            structured = streams["structured"].random(size) < config.structured_ratio
            kind_of = np.zeros(size, dtype=np.intp)
            if self._kinds is not None:
                count = int(np.count_nonzero(structured))
                kind_of[structured] = self._kinds.slice(kinds_at, count)
                kinds_at += count
            times = next(arrivals)
            prompt = np.maximum(config.prompt_len.sample(size, streams["prompt"]), 1)
            output = np.maximum(config.output_len.sample(size, streams["output"]), 1)
            thinks = streams["reasoning"].random(size) < config.reasoning.fraction
            think_len = config.reasoning.think_len.sample(size, lengths_rng)
            for j in range(size):
                i = start + j
                if self.on_progress is not None and i % report_every == 0:
                    self.on_progress(i / n)
                yield self._request(i, bool(structured[j]), int(kind_of[j]), float(times[j]), int(prompt[j]),
                                    int(output[j]), int(think_len[j]) if thinks[j] else 0, bool(thinks[j]))
            start += size

    def _request(self, i: int, structured: bool, kind: int, arrival: float, prompt: int, output: int,
                 think_len: int, thinks: bool) -> Request:
        spec = spec_id = tokens = index = None
        if structured:
            picker = self._pickers[kind]
            item, copy = picker.draw()
            spec_id, spec = unique_copy(item, copy)
            self._structured += 1
            if copy:
                self._copies += 1
            else:
                self._items_used.add(item.id)
            pool = picker.pool(item)
            if pool is not None:
                index = picker.instance(item, pool, self.streams["instances"])
                tokens = pool.tokens[index]
                output = len(tokens)
                if self.keep_pools:
                    self.pools[spec_id] = pool
        return Request(
            request_id=i,
            arrival_s=arrival,
            prompt_len=prompt,
            output_len=output,
            spec=spec,
            spec_id=spec_id,
            output_tokens=tokens,
            think_len=think_len,
            thinking_budget=self.config.reasoning.thinking_budget if thinks else None,
            closed_loop=self.config.arrival.closed_loop,
            instance_index=index,
            random_walk=self._walk if structured else None,
        )


def _copy(rng: np.random.Generator) -> np.random.Generator:
    """An independent generator in ``rng``'s present state."""
    bits = type(rng.bit_generator)()
    bits.state = rng.bit_generator.state
    return np.random.Generator(bits)


def _sizes(n: int, chunk: int) -> Iterator[int]:
    for start in range(0, n, chunk):
        yield min(chunk, n - start)


def generate(config: WorkloadConfig, vocab: Vocabulary, *, cache: PoolCache | None = None,
             progress: bool = True, on_progress: Callable[[float], None] | None = None,
             held: bool = True) -> Workload:
    """Expand ``config`` into a :class:`Workload` of ``config.num_requests`` requests
    (or replay ``config.trace``): every request of its :class:`RequestStream`.

    ``progress`` shows this function's own progress bar; ``on_progress``, for a
    caller that owns the display, is called with the fraction of requests built
    (at most about a hundred times). ``held=False`` (a generated workload): no request is
    built now; :meth:`Workload.stream` builds them as they are read, as often as asked
    (:meth:`Workload.iter_requests` the same), without instance pools (``pools`` stays empty).
    """
    if config.trace is not None:
        return replay(config, vocab)
    if not held:
        stream = RequestStream(config, vocab, cache=cache, keep_pools=False)  # (the corpus' account only)
        return Workload(config, vocab.name, [], {}, [], stream.skipped_lines, stream.library_ids,
                        stream.duplicates, rebuild=lambda: RequestStream(config, vocab, cache=cache, keep_pools=False),
                        streamed=True)
    bar = Progress(transient=True, disable=not progress)
    with bar:
        stream = RequestStream(config, vocab, cache=cache, progress=bar if progress else None,
                               on_progress=on_progress)
        requests = list(stream)
    # Arrival times are already sorted (cumulative gaps); keep ids in arrival order.
    return Workload(config, vocab.name, requests, stream.pools, stream.failures, stream.skipped_lines,
                    stream.library_ids, stream.duplicates,
                    rebuild=lambda: RequestStream(config, vocab, cache=cache))  # the same seeded streams
