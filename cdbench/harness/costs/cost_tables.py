"""``model`` mode's grammar costs as per-request tables, so a step looks costs up instead of drawing them.

Structure follows real grammars: every request takes the costs of one
profiled spec (:class:`SpecIndex`: its own spec where the profile measured
it, else a whole profiled spec of the same kind, and corpus where one
matches), so a slow spec is slow at every token of its requests, and its
fills follow the spec's position curve (first fills cost more). Around that,
token-to-token noise comes from the kind's residual distribution. A request
whose text the profile walked (the same spec item, the same tokens) replays
that text's own fills by position instead: what a grammar costs at a position
depends on the text it walks, not only on the spec.

Per-request streams keep the draws independent of scheduling order: each
cost spec (a profiled spec, or a kind's pooled costs) has a pool of
pre-drawn values per metric (its own fill residuals, accept, rollback and
forced tokens), and a request reads its spec's pools at a fixed random offset
plus its answer position. A step's fill of row ``r`` is then two gathers and a
product::

    fill = tables.fill[at] * tables.curve[ci]   # at: pool index, ci: curve index (see CostTables)

plus, where the run's specs have measured outlier fills, ``tables.spike[at]``: a
pool of absolute seconds, zero but at as many positions as the spec's outliers
were frequent, each holding one of them.

The same request at the same position always costs the same, whatever else
runs beside it. A profile without per-spec sections (format 1) has no
residuals: its pools hold the kind's fill distribution itself and every curve
is 1, which is the per-kind behaviour of such profiles.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from cdbench.harness.costs.grammar_profile import (
    KIND_CODES,
    GrammarProfile,
    KindProfile,
    ProfileError,
)
from cdbench.harness.costs.spec_profile import (
    COPY_MARK,
    N_POSITION_BINS,
    SpecProfile,
    base_spec_id,
    corpus_of,
    position_bins,
    spec_key_hash,
    spec_key_text,
)

if TYPE_CHECKING:
    from cdbench.workloads.request import Request

SPAN = 1 << 11
"""Pre-drawn values per spec and metric; a request reads its spec's pool at a random offset plus its
position, modulo the span."""
DRAFT_WINDOW = 256
"""Positions past the span each pool row repeats, so a row's next 1 + k fills are contiguous (k < this)."""
ROW = SPAN + DRAFT_WINDOW
_POSITIONS = np.arange(SPAN)


@dataclass
class CostTables:
    """Per-request grammar costs of a run (per-request arrays indexed as the scheduler numbers requests).

    ``fill``/``accept``/``rollback``/``forced``: the pools, one row of
    :data:`ROW` values per cost spec (fill residuals, accept and rollback
    seconds, forced tokens); request ``r`` at answer position ``p`` reads index
    ``base[r] + ((off_end[r] - gen_left) & (SPAN - 1))`` with ``gen_left =
    output_len - p``. ``fill_csum``: prefix sums of ``fill`` (a row's draft
    fills as one difference). ``curve``: the fill multiplier of each cost
    spec at each answer position (seconds; 1 where the pool holds seconds),
    request ``r``'s at ``curve_end[r] - gen_left``. ``spike``: outlier seconds
    added to a row's fill at the same index, once per row (``None`` when no
    cost spec has outliers). ``draft_survival[c, j]``: the
    chance that the draft ``j`` past the accepted ones and all before it are
    grammar-valid, for draft chain ``c``, request ``r``'s chain
    ``draft_chain[r]`` (``None``: not measured, every draft valid).
    ``end_left[r]``: the ``gen_left`` at which random walk ``r`` ends, its
    grammar terminated (0: at its cap), ``None`` when none ends early.
    ``think_accept[r]``: seconds per thinking token request ``r``'s matcher
    accepts (``None``: none measured). ``rollback`` is ``None``
    when the cost source has no rollback measurements. ``reject_left[r]``:
    the ``gen_left`` at which request ``r``'s sampled token is refused (its
    spec's measured refusal; -1: never), ``None`` when no request is.
    ``fill_base[r]``: request ``r``'s row in ``fill``/``fill_csum``/``spike``
    where it is not ``base[r]`` (a request replaying its text's own fills reads
    a row of ones), ``None`` when every request reads its ``base``. ``accept_curve``: the
    accept seconds of replayed texts whose accepts were timed as a run walks them, in ``curve``'s
    layout (NaN elsewhere: the ``accept`` pool prices it), ``None`` when no text has them.
    A run without drafts reads neither ``fill_csum``, ``rollback`` nor the draft
    chains, and one without jump-forward not ``forced``: tables built for such a
    run may leave them ``None``.
    """

    fill: np.ndarray
    fill_csum: np.ndarray | None
    accept: np.ndarray
    rollback: np.ndarray | None
    forced: np.ndarray | None
    base: np.ndarray
    off_end: np.ndarray
    curve: np.ndarray
    curve_end: np.ndarray
    reject_left: np.ndarray | None = None
    spike: np.ndarray | None = None
    draft_survival: np.ndarray | None = None
    draft_chain: np.ndarray | None = None
    end_left: np.ndarray | None = None
    think_accept: np.ndarray | None = None
    fill_base: np.ndarray | None = None
    accept_curve: np.ndarray | None = None

    def enter(self, rids: np.ndarray, requests: Sequence[Request], keys: np.ndarray,
              instances: Sequence[str | None]) -> None:
        """``requests`` entered the scheduler in slots ``rids`` (their spec ``keys``, -1: none; ``instances``: the
        instance keys of the texts they walk): their per-request columns are written (over the requests that
        held the slots before). Requests enter in scheduler order, a chunk at a time."""

    def acquire(self, rid: int) -> None:
        """Request ``rid`` arrived: its pools are needed from now on (the tables of a profile build them then)."""

    def release(self, rid: int) -> None:
        """Request ``rid`` ended: its pools may go."""

    def grow(self, capacity: int) -> None:
        """Make room for ``capacity`` request slots."""


def _csum(pool: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(pool)))


class ConstantTables(CostTables):
    """Tables of constant costs (every request, every position): one pool row, a curve of ones."""

    def __init__(self, capacity: int, fill_s: float, accept_s: float, rollback_s: float, forced_tokens: int) -> None:
        fill = np.full(ROW, fill_s)
        super().__init__(fill, _csum(fill), np.full(ROW, accept_s), np.full(ROW, rollback_s),
                         np.full(ROW, forced_tokens, np.int64), np.zeros(capacity, np.int64),
                         np.zeros(capacity, np.int64), np.ones(1), np.zeros(capacity, np.int64))

    def enter(self, rids: np.ndarray, requests: Sequence[Request], keys: np.ndarray,
              instances: Sequence[str | None]) -> None:
        out_len = _answer_lengths(requests)
        self.off_end[rids] = self.curve_end[rids] = out_len
        longest = int(out_len.max(initial=0))
        if longest >= len(self.curve):
            self.curve = np.ones(max(longest + 1, 2 * len(self.curve)))

    def grow(self, capacity: int) -> None:
        for name in ("base", "off_end", "curve_end"):
            setattr(self, name, _grown(getattr(self, name), capacity))


def _uniform(seed: int, purpose: str, text: str) -> float:
    digest = hashlib.blake2b(f"{seed}\0{purpose}\0{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


class SpecIndex:
    """Which profiled spec a run's spec takes its costs from.

    A spec the profile measured (same compile-cache key) takes its own; a
    generator copy (``id#copyN``) of an item in the profile's ``copies`` (item key text → the profiled spec
    pricing its copies: :func:`~cdbench.harness.costs.spec_costs.price_specs` prices a streamed run's copies
    by their item's content, once for them all, as it prices each copy of a held run by content over any
    profiled spec of the copy's own key) takes that spec's costs, under its own name; another copy
    takes its corpus item's; any other takes a profiled spec of its kind drawn as a whole (among those of
    its corpus, when the profile has some), stable per seed and spec. ``None``: the profile has
    no spec of that kind (the kind's pooled costs serve).
    """

    def __init__(self, profile: GrammarProfile, seed: int) -> None:
        self.profile, self.seed, self.copies = profile, seed, profile.copies
        self._by_kind: dict[str, list[str]] = {}
        self._by_corpus: dict[tuple[str, str], list[str]] = {}
        for key, kind, corpus in sorted(profile.spec_labels()):  # labels alone: a spec is decoded when used
            self._by_kind.setdefault(kind, []).append(key)
            if corpus is not None:
                self._by_corpus.setdefault((kind, corpus), []).append(key)
        self._cache: dict[str, tuple[str | None, str | None]] = {}

    def resolve(self, key_text: str, spec_id: str | None, kind: str) -> str | None:
        """The name ``key_text``'s costs are known by (``None``: the kind's pooled costs): the profile's spec key
        whose costs it takes, or a copy's own (:meth:`names`)."""
        return self.names(key_text, spec_id, kind)[0]

    def names(self, key_text: str, spec_id: str | None, kind: str) -> tuple[str | None, str | None]:
        """(the name ``key_text``'s costs are known and seeded by, the profile's spec key that prices them): one
        key twice, but for a copy priced by its item's content (``copies``)."""
        found = self._cache.get(key_text)
        if found is not None:
            return found
        if len(self._cache) >= _KEYS_REMEMBERED:  # (a run of copies has a key a request: resolved again)
            self._cache.clear()
        specs = self.profile.specs
        name = priced = spec_key_hash(key_text)
        if spec_id is not None and COPY_MARK in spec_id and self.copies:  # (over a profiled spec of its own key)
            priced = self.copies.get(spec_key_text(kind, base_spec_id(spec_id)), name)
        if priced not in specs and spec_id is not None:
            name = priced = spec_key_hash(spec_key_text(kind, base_spec_id(spec_id)))
        if priced not in specs:
            corpus = corpus_of(spec_id)
            pool = self._by_corpus.get((kind, corpus)) if corpus is not None else None
            pool = pool or self._by_kind.get(kind)
            name = priced = pool[int(_uniform(self.seed, "spec", key_text) * len(pool))] if pool else None
        found = self._cache[key_text] = (name, priced)
        return found

    def spec(self, key: str | None) -> SpecProfile | None:
        """The profile's spec ``key`` (a priced name of :meth:`names`)."""
        return None if key is None else self.profile.specs[key]


def _row(pool: np.ndarray, mean: float | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """A pool of SPAN draws, scaled to ``mean`` if given (so that a few draws from a heavy tail do not set
    a spec's cost), extended by its first DRAFT_WINDOW (reads wrap around the span); written into ``out``
    (a row of :data:`ROW`) where given."""
    if out is None:
        out = np.empty(ROW, pool.dtype)
    if mean is not None:
        drawn = float(np.add.reduce(pool)) / SPAN  # (ndarray.mean's own sum and division)
        if drawn > 0:
            np.multiply(pool, mean / drawn, out=out[:SPAN])
            pool = out
    if pool is not out:
        out[:SPAN] = pool
    out[SPAN:] = out[:DRAFT_WINDOW]
    return out


def _rows(pools: np.ndarray, means: np.ndarray) -> np.ndarray:
    """:func:`_row` of each row of ``pools`` (SPAN draws each) scaled to its ``means``, at once: each value as
    :func:`_row` gives it (a row-wise sum of a C-ordered array sums each row as the sum of that row alone)."""
    drawn = np.add.reduce(pools, axis=1) / SPAN
    scale = np.ones(len(pools))
    np.divide(means, drawn, out=scale, where=drawn > 0)
    out = np.empty((len(pools), ROW))
    np.multiply(pools, scale[:, None], out=out[:, :SPAN])
    out[:, SPAN:] = out[:, :DRAFT_WINDOW]
    return out


def _scatter(out: np.ndarray, rows: Sequence[int], values: list[list], scale: np.ndarray | None = None) -> None:
    """Each of ``values`` (floats, ``None`` as NaN), times its ``scale`` if given, into the start of its row
    ``rows[i]`` of ``out``: one conversion and one write for all of them."""
    lengths = np.array([len(v) for v in values], np.int64)
    flat = np.array(list(chain.from_iterable(values)), np.float64)
    if scale is not None:
        flat = np.repeat(scale, lengths) * flat
    out[np.repeat(np.asarray(rows, np.int64), lengths), np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths,
                                                                                      lengths)] = flat


def _cycle(values: np.ndarray, u: np.ndarray) -> np.ndarray:
    """SPAN draws of equally likely ``values``: one random order of them (by ``u``) repeated, so that a
    request's consecutive positions hold each value as often as their count allows (any ``len(values)`` of
    them: each once). Drawn independently per position instead, the few positions of a short answer
    leave its total to chance: one heavy spec of a short-answer workload then sets the run's mask time."""
    order = values[np.argsort(u[:len(values)])]
    return order[_POSITIONS % len(order)]  # (numpy.resize's values, without its Python-level copies)


def _spikes(spec: SpecProfile, rng: np.random.Generator) -> np.ndarray:
    """A pool row of ``spec``'s outlier fills (seconds, else 0): ``rate * SPAN`` of its positions, rounded
    at random so that the expected count is exact, evenly spaced from a random start so that any
    consecutive positions hold as many as their count times the rate (rounded either way), each one of
    its outliers in turn (:func:`_cycle`)."""
    pool = np.zeros(SPAN)
    count = min(int(spec.fill_outlier_rate * SPAN + rng.random()), SPAN)
    if count:
        at = (rng.random() + np.arange(count) * (SPAN / count)).astype(np.int64) % SPAN
        values = np.asarray(spec.fill_outliers_s)
        pool[at] = _cycle(values, rng.random(len(values)))[:count]
    return _row(pool)


def _survival(tried: list[int], valid: list[int]) -> np.ndarray:
    """Chance that drafts ``0..j`` past the accepted ones are all valid, for ``j < DRAFT_WINDOW - 1`` (an
    index past the measured ones continues at the last measured rate)."""
    tried_a, valid_a = np.asarray(tried, np.float64), np.asarray(valid, np.float64)
    measured = np.flatnonzero(tried_a > 0)
    rate = np.ones(DRAFT_WINDOW - 1)
    if len(measured):
        last = int(measured[-1])
        rate[:last + 1] = np.where(tried_a[:last + 1] > 0, valid_a[:last + 1] / np.maximum(tried_a[:last + 1], 1), 1.0)
        rate[last + 1:] = rate[last]
    return np.cumprod(rate)


def _answer_lengths(requests: Sequence[Request]) -> np.ndarray:
    """Each request's answer tokens (at least one)."""
    return np.maximum(np.fromiter((r.output_len for r in requests), np.int64, len(requests)), 1)


def _walk_end_left(spec: SpecProfile | None, out_len: int, u: float) -> int:
    """The ``gen_left`` at which a random walk of ``spec`` with cap ``out_len`` ends (0: at its cap): it ends
    early as often as the spec's walks did, at one of their end lengths (``u``: its uniform draw)."""
    if spec is None or not spec.random_walks or not spec.walk_ends:
        return 0
    rate = len(spec.walk_ends) / spec.random_walks
    if u >= rate:
        return 0
    length = spec.walk_ends[min(int(u / rate * len(spec.walk_ends)), len(spec.walk_ends) - 1)]
    return out_len - length if 0 < length < out_len else 0


def _kind_dists(profile: GrammarProfile, kp: KindProfile) -> tuple:
    """(fill distribution, whether it is relative to spec curves, accept, rollback) of a kind."""
    overall = profile.overall
    relative = kp.fill_residual.count > 0
    fill = kp.fill_residual if relative else (kp.fill_s if kp.fill_s.count else overall.fill_s)
    accept = kp.accept_s if kp.accept_s.count else overall.accept_s
    rollback = kp.rollback_s if kp.rollback_s.count else overall.rollback_s
    if not fill.count or not accept.count:
        raise ProfileError(f"profile {profile.backend}/{profile.vocab} has no fill or accept measurements")
    return fill, relative, accept, rollback if rollback.count else None


def profile_tables(profile: GrammarProfile, index: SpecIndex, seed: int, keys, capacity: int,
                   drafts: bool = True, jump_forward: bool = True, chains: bool = False) -> CostTables:
    """Tables of ``capacity`` request slots (grown as asked) for requests whose spec keys ``keys``
    (:class:`~cdbench.harness.executors.base.SpecKeys`) numbers as they enter; ``drafts``/``jump_forward``:
    whether the run reads the draft pools (prefix sums, rollback, draft chains) and the forced tokens (not
    built when not); ``chains``: some request of the run has a measured draft chain
    (:func:`has_draft_chains`).

    One cost spec per profiled spec that the run's specs resolve to, plus one
    per kind for specs the kind's pooled costs serve; each cost spec's pools
    are drawn from a generator seeded by the seed and the cost spec alone, so
    they do not depend on which other specs the run holds. A request walking a
    text the profile walked (:attr:`GrammarProfile.instances`) replays that
    text's fills: its curve is the instance's mean fill at each measured
    position (its spec's curve elsewhere), over a pool of ones and without
    drawn outliers, as the measured fills already hold the text's own spread.

    The pools are built when a request that reads them arrives and dropped when
    the last such request ends (:class:`ProfileTables`), so the tables hold
    the pools of the requests in flight, not of the run. A kind without rollback
    measurements prices no rollback: a rejected draft of its rows is an error.
    """
    return ProfileTables(profile, index, seed, keys, capacity, drafts, jump_forward, chains)


def has_draft_chains(profile: GrammarProfile, index: SpecIndex, requests: Iterable[Request]) -> bool:
    """Whether some request of ``requests`` takes a measured draft chain (its spec's, or its kind's): a run
    with one draws which drafts the grammar takes at every drafted step, so whether it draws is decided for
    the whole run (read until the first such request)."""
    for r in requests:
        if r.spec is None:
            continue
        kind = r.spec.kind
        if profile.kind(kind).draft_tried:
            return True
        text = f"{kind}:{r.spec_id}" if r.spec_id is not None else r.spec.canonical()
        spec = index.spec(index.names(text, r.spec_id, kind)[1])
        if spec is not None and spec.draft_tried:
            return True
    return False


_KEYS_REMEMBERED = 1 << 12
"""Spec keys whose cost spec, chain and refusals the tables remember (past it they are computed again)."""
_DRAWN_AHEAD = 1 << 10  # requests entering at once whose new accept rows and curves are drawn together
_DRAWN_TOGETHER = 16  # accept rows drawn as one array (in cache)
# curve values of replayed texts kept once drawn (about 30k for the default workload's thousand texts): a text's
# curve is the same whenever it is taken again at the same width, so it is drawn once, not again for each request
_CURVE_VALUES_KEPT = 1 << 22


class _Draws:
    """The values of a seeded stream of draws by index (``draw(rng, n)``: the next ``n``), drawn a chunk at
    a time in order, the last two chunks kept: the same values as drawing up to the highest index at once
    (a generator's draws in turn are its draws at once). Indexes read in increasing order (request ids as
    a workload is generated) draw each chunk once; an index below the chunks kept draws from the start."""

    CHUNK = 1 << 16

    def __init__(self, seed: list[int], draw: Callable[[np.random.Generator, int], np.ndarray]) -> None:
        self.seed, self.draw = seed, draw
        self._restart()

    def _restart(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        self._chunks: dict[int, np.ndarray] = {}
        self._next = 0  # the next chunk to draw

    def _chunk(self, c: int) -> np.ndarray:
        chunk = self._chunks.get(c)
        if chunk is None:
            if c < self._next:
                self._restart()
            while self._next <= c:
                self._chunks[self._next] = self.draw(self._rng, self.CHUNK)
                self._chunks.pop(self._next - 2, None)
                self._next += 1
            chunk = self._chunks[c]
        return chunk

    def at(self, ids: np.ndarray) -> np.ndarray:
        """The values at indexes ``ids`` (read in increasing order of chunk where they can be)."""
        chunks = ids // self.CHUNK
        first, last = int(chunks.min(initial=0)), int(chunks.max(initial=0))
        if first == last:
            return self._chunk(first)[ids - first * self.CHUNK]
        out = np.empty(len(ids), self._chunk(first).dtype)
        for c in np.unique(chunks).tolist():
            mine = chunks == c
            out[mine] = self._chunk(c)[ids[mine] - c * self.CHUNK]
        return out


class _Slots:
    """Slot numbers of pooled values shared by the requests in flight that read them: a slot is taken
    when the first of them arrives and freed when the last ends (reference counts). A freed slot keeps
    its values until a new item needs a slot, the longest-freed first, so an item whose requests come
    and go (a popular spec) is not drawn again each time; the slots are bounded by what runs at once."""

    def __init__(self, reserved: int = 0) -> None:
        self.slot: dict[Hashable, int] = {}  # item -> its slot (in use, or freed and still holding its values)
        self.refs: dict[Hashable, int] = {}  # items in use -> requests reading them
        self.free: OrderedDict[int, Hashable] = OrderedDict()  # freed slot -> the item it still holds, oldest first
        self.size = reserved  # slots handed out so far (the first ``reserved`` are fixed)

    def take(self, item: Hashable) -> tuple[int, bool]:
        """``item``'s slot, and whether it is new (its values must be written)."""
        slot = self.slot.get(item)
        if slot is not None:
            if item in self.refs:
                self.refs[item] += 1
            else:
                del self.free[slot]
                self.refs[item] = 1
            return slot, False
        if self.free:
            slot, held = self.free.popitem(last=False)
            del self.slot[held]
        else:
            slot, self.size = self.size, self.size + 1
        self.slot[item], self.refs[item] = slot, 1
        return slot, True

    def drop(self, item: Hashable) -> None:
        self.refs[item] -= 1
        if not self.refs[item]:
            del self.refs[item]
            self.free[self.slot[item]] = item


def _words(entropy: list[int]) -> list[int] | None:
    """The 32-bit words numpy splits the integers ``entropy`` into, lowest first (``None``: one is negative)."""
    words = []
    for n in entropy:
        if n < 0:
            return None
        words.append(n & 0xFFFFFFFF)
        n >>= 32
        while n:
            words.append(n & 0xFFFFFFFF)
            n >>= 32
    return words


def _seeded(entropy: list[int]) -> np.random.Generator:
    """``numpy.random.default_rng(entropy)``, the same stream: the integers (not negative) given as the
    32-bit words numpy splits them into, which spares its per-integer conversion."""
    words = _words(entropy)
    return np.random.default_rng(entropy if words is None else np.array(words, np.uint32))


# numpy's SeedSequence (pool, hash and mix constants) and PCG64's LCG
_POOL = 4
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_M32, _M128 = 0xFFFFFFFF, (1 << 128) - 1
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645


def _lcg_jump(steps: int) -> tuple[int, int]:
    """``(a, c)``: ``steps`` steps of PCG64's LCG take ``state`` to ``a * state + c * inc`` (mod 2**128)."""
    acc_mult, acc_plus, mult, plus = 1, 0, _PCG_MULT, 1
    while steps:
        if steps & 1:
            acc_mult, acc_plus = acc_mult * mult & _M128, (acc_plus * mult + plus) & _M128
        plus, mult = (mult + 1) * plus & _M128, mult * mult & _M128
        steps >>= 1
    return acc_mult, acc_plus


_SKIP_FILLS = _lcg_jump(SPAN)  # past a stream's first SPAN draws (the fills' uniforms)


def _stream_states(words: np.ndarray, jump: tuple[int, int] = (1, 0)) -> list[tuple[int, int]]:
    """PCG64's ``(state, inc)`` of ``numpy.random.default_rng(words[i])`` for each row of 32-bit ``words``,
    advanced by ``jump`` (:func:`_lcg_jump`): numpy's seeding as arrays over the rows (one at a time, it is
    most of a stream's cost)."""
    w = words.astype(np.uint64)
    n, length = w.shape
    hash_const = _INIT_A  # (the same for every row)

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ hash_const
        hash_const = hash_const * _MULT_A & _M32
        value = value * hash_const & _M32
        return value ^ (value >> 16)

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        out = (_MIX_L * x - _MIX_R * y) & _M32  # (modulo 2**64, then 2**32)
        return out ^ (out >> 16)

    pool = [hashmix(w[:, i] if i < length else np.zeros(n, np.uint64)) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(_POOL, length):
        for dst in range(_POOL):
            pool[dst] = mix(pool[dst], hashmix(w[:, src]))
    hash_b, state = _INIT_B, []  # generate_state(4, uint64): 8 words, low first
    for i in range(2 * _POOL):
        value = pool[i % _POOL] ^ hash_b
        hash_b = hash_b * _MULT_B & _M32
        value = value * hash_b & _M32
        state.append(value ^ (value >> 16))
    seeds = [(state[2 * i] | (state[2 * i + 1] << np.uint64(32))).tolist() for i in range(_POOL)]
    a, c = jump
    out = []
    for hi_s, lo_s, hi_q, lo_q in zip(*seeds):
        inc = ((hi_q << 64 | lo_q) << 1 | 1) & _M128
        s = ((inc + (hi_s << 64 | lo_s)) * _PCG_MULT + inc) & _M128  # (srandom: two steps, the seed added)
        out.append(((a * s + c * inc) & _M128, inc))
    return out


def _grown(array: np.ndarray | None, length: int) -> np.ndarray | None:
    """``array`` with room for ``length`` values along its first axis (doubled when short)."""
    if array is None or len(array) >= length:
        return array
    out = np.zeros((max(length, 2 * len(array)), *array.shape[1:]), array.dtype)
    out[:len(array)] = array
    return out


class ProfileTables(CostTables):
    """:func:`profile_tables`' tables: a few numbers a request slot, written as a request enters
    (:meth:`enter`); the pools (a :data:`ROW` of each metric a cost spec, a curve a cost spec or replayed
    text, a chain of draft-survival rates) built into reused slots as requests arrive (:meth:`acquire`) and
    freed as they end (:meth:`release`). A cost spec's pools and curve are the same values whenever they are
    built; only the slot they sit in changes, and so does the curves' width (the longest answer entered so
    far, grown as longer ones enter). ``fill_csum`` holds each row's own prefix sums (a row's draft fills
    are one difference within the row). A pool the run does not read (``drafts``, ``jump_forward``: see
    :func:`profile_tables`) is not drawn: each arrival of a new cost spec draws its pools (a few thousand
    values each), so the unread ones would cost as much as the read ones; the read ones are the same either
    way (the unread pools' uniforms come after theirs in the cost spec's stream). What is kept per spec key
    (its cost spec, chain, refusals) is remembered for a bounded number of keys, and computed again past it.

    A request's random offset, refusal draw and walk-end draw are the values at its request id of three
    seeded streams, drawn a chunk at a time as ids grow (:class:`_Draws`), so they do not depend on which
    other requests share the run."""

    def __init__(self, profile: GrammarProfile, index: SpecIndex, seed: int, keys, capacity: int,
                 drafts: bool = True, jump_forward: bool = True, chains: bool = False) -> None:
        self.profile, self.index, self.seed, self.keys = profile, index, seed, keys
        self._uniforms = 4 if jump_forward else 3 if drafts else 2  # rows of uniforms a cost spec draws
        self._drafts = drafts
        self.width = 1  # curve slots' width: the longest answer entered + 1 (grown)
        self._bins = position_bins(np.arange(1))
        self._kinds: dict[str, tuple] = {}  # kind -> _kind_dists, as the run's kinds enter
        self._by_key: dict[str, tuple] = {}  # key text -> what its requests take (bounded: see _key_info)
        self._shared_name: dict[str, str | None] = {}  # kind -> the spec its shared cost spec is priced by (the first)
        self._text_gaps: dict[str, tuple] = {}  # replayed text -> the cost spec whose curve fills its gaps
        self._replays = bool(profile.instances)  # (a profile file's sections count their keys: once, here)
        self._offsets = _Draws([seed, 0x6f66], lambda rng, n: rng.integers(0, SPAN, n))
        self._refusals = _Draws([seed, 0x726a], lambda rng, n: rng.random(n))
        self._walk_ends = _Draws([seed, 0x7765], lambda rng, n: rng.random(n))
        # per slot: its request's cost spec, replayed text and draft chain (None: none), answer length
        self._spec_of: list[tuple | None] = [None] * capacity
        self._text_of: list[str | None] = [None] * capacity
        self._chain_of: list[tuple | None] = [None] * capacity
        self._out_len = np.zeros(capacity, np.int64)
        self._curve_at = np.zeros(capacity, np.int64)  # an acquired slot's curve slot
        self._rows = _Slots(reserved=1)  # slot 0: the row of ones replayed texts read
        self._unfilled: set[int] = set()  # rows whose fills are not drawn (read by replayed texts only, so far)
        self._drawn: dict[tuple, np.ndarray] = {}  # cost spec -> its accept row, drawn as its request entered
        self._bits = np.random.Generator(np.random.PCG64(0))  # (given each stream's state: _draw_ahead)
        self._drawn_curves: dict[str, tuple[int, np.ndarray]] = {}  # replayed text -> (width, its curve), the same
        self._drawn_values = 0  # the positions of the curves kept there
        # curve slot -> the positions written from its start: the whole width, or as far as the answers read that
        # took it written ahead (a request reads its curve below its answer's length: the rest may be stale)
        self._curve_len: dict[int, int] = {}
        self._curves = _Slots()
        self._chain_slots = _Slots(reserved=1)  # slot 0: chain 0
        self._curve_slots: dict[int, Hashable] = {}  # acquired request -> its curve's item
        rows = 4
        super().__init__(
            fill=np.zeros(rows * ROW), fill_csum=np.zeros(rows * ROW) if drafts else None,
            accept=np.zeros(rows * ROW), rollback=np.zeros(rows * ROW) if drafts else None,
            forced=np.zeros(rows * ROW, np.int64) if jump_forward else None,
            base=np.zeros(capacity, np.int64), off_end=np.zeros(capacity, np.int64), curve=np.ones(rows),
            curve_end=np.zeros(capacity, np.int64),
            draft_survival=np.ones((rows, DRAFT_WINDOW - 1)) if drafts and chains else None,
            draft_chain=np.zeros(capacity, np.int64) if drafts and chains else None)
        self._grow_rows(1)
        self.fill[:ROW] = 1.0
        if self.fill_csum is not None:
            self.fill_csum[:ROW] = _csum(self.fill[:ROW])[:ROW]

    def _kind(self, kind: str) -> tuple:
        dists = self._kinds.get(kind)
        if dists is None:
            dists = self._kinds[kind] = _kind_dists(self.profile, self.profile.kind(kind))
        return dists

    def _key_info(self, key: int) -> tuple:
        """(cost spec, draft chain, think-accept seconds, refusal rate, refused position) of spec ``key``."""
        keys = self.keys
        text = keys.texts[key]
        info = self._by_key.get(text)
        if info is not None:
            return info
        kind, spec_id = keys.kinds[key], keys.spec_ids[key]
        name, priced = self.index.names(text, spec_id, kind)
        spec = self.index.spec(priced)
        own = spec is not None and spec.fills > 0 and self._kind(kind)[1] and len(spec.fill_residual) > 0
        if own or spec is not None and spec.accept_s is not None:
            cost_spec = (kind, name, priced)
        else:  # the kind's shared cost spec: priced by the first spec that takes it
            cost_spec = (kind, None, self._shared_name.setdefault(kind, priced))
        kp = self.profile.kind(kind)
        own_chain = spec is not None and len(spec.draft_tried) > 0
        chain = ((priced, kind) if own_chain else (None, kind)) \
            if (spec.draft_tried if own_chain else kp.draft_tried) else None
        think = spec.think_accept_s if spec is not None and spec.think_accept_s is not None else kp.think_accept_s
        rate, at = (spec.rejected / spec.walks, spec.rejected_at) if spec is not None and spec.rejected \
            and spec.walks else (0.0, 0)
        info = (cost_spec, chain, think or 0.0, rate, at, spec)
        if len(self._by_key) >= _KEYS_REMEMBERED:  # (a run of copies has a key a request: computed again)
            self._by_key.clear()
        self._by_key[text] = info
        return info

    def enter(self, rids: np.ndarray, requests: Sequence[Request], keys: np.ndarray,
              instances: Sequence[str | None]) -> None:
        n = len(rids)
        out_len = _answer_lengths(requests)
        ids = np.fromiter((r.request_id for r in requests), np.int64, n)
        self._out_len[rids] = out_len
        self.off_end[rids] = self._offsets.at(ids) + out_len
        width = self.width  # widened as each longer answer would have widened it, entering one at a time
        for longest in out_len[out_len >= width].tolist():
            if longest >= width:
                width = max(longest + 1, 2 * width)
        if width != self.width:
            self._widen(width)
        think = np.zeros(n)
        rate = np.zeros(n)
        at = np.zeros(n, np.int64)
        end = np.zeros(n, np.int64)
        walk_ends = None
        spec_of, text_of, chain_of = self._spec_of, self._text_of, self._chain_of
        replays, instances_measured = self._replays, self.profile.instances if self._replays else None
        for i, (rid, key, instance) in enumerate(zip(rids.tolist(), keys.tolist(), instances)):
            if key < 0:
                spec_of[rid] = text_of[rid] = chain_of[rid] = None
                continue
            cost_spec, chain, think[i], rate[i], at[i], spec = self._key_info(key)
            spec_of[rid] = cost_spec
            chain_of[rid] = chain
            text = instance if instance is not None and replays and instance in instances_measured else None
            if text is not None:
                self._text_gaps.setdefault(text, cost_spec)
            text_of[rid] = text
            if spec is not None and spec.random_walks and spec.walk_ends and requests[i].output_tokens is None:
                if walk_ends is None:
                    walk_ends = self._walk_ends.at(ids)
                end[i] = _walk_end_left(spec, int(out_len[i]), float(walk_ends[i]))
        refused = rate > 0
        if refused.any():
            refused &= (self._refusals.at(ids) < rate) & (at < out_len)
        self._set(rids, think, np.where(refused, out_len - at, -1), end)
        if n <= _DRAWN_AHEAD:
            rows = rids.tolist()
            if self._uniforms == 2:
                self._draw_ahead([spec_of[rid] for rid in rows])
            if replays:
                self._curves_ahead([text_of[rid] for rid in rows], out_len)

    def _curves_ahead(self, texts: list[str | None], out_len: np.ndarray) -> None:
        """The curves of the entering requests' replayed ``texts`` (answers of ``out_len`` tokens) that no slot
        holds and that were not drawn before at the current width as far, written together at the current width as
        far as those answers read them (their length + 1): their measured fills, their spec's curve in the gaps, each
        value as :meth:`_write_curve` writes it alone; kept for the requests that take them as they arrive, if the
        width is still the same (up to :data:`_CURVE_VALUES_KEPT` positions in all). Not for texts whose accepts were
        timed (their accept curves are written as they arrive)."""
        held, drawn, instances = self._curves.slot, self._drawn_curves, self.profile.instances
        reach: dict[str, int] = {}  # each text's positions read: the longest of its answers entering, + 1
        for text, length in zip(texts, out_len.tolist()):
            if text is not None and reach.get(text, 0) <= length:
                reach[text] = length + 1
        width_now = self.width
        todo = []
        for text, read in reach.items():
            kept = drawn.get(text)
            if (kept is None or kept[0] != width_now or len(kept[1]) < read) and ("text", text) not in held \
                    and not instances[text].accept_s:
                todo.append(text)
        if not todo:
            return
        if self._drawn_values > _CURVE_VALUES_KEPT:  # (a corpus of many long texts: drawn again past it)
            drawn.clear()
            self._drawn_values = 0
        lengths = [reach[text] for text in todo]
        width = max(lengths)  # (the positions past it are not read by the requests taking these curves)
        curves = np.full((len(todo), width), np.nan)
        _scatter(curves, range(len(todo)), [instances[text].fill_s[:width] for text in todo])
        gaps = np.empty((len(todo), width))
        own: list[tuple[int, SpecProfile]] = []  # (row, spec) of the gaps priced by the spec's own curve
        for i, text in enumerate(todo):
            cost_spec = self._text_gaps[text]
            _, _, spec, is_own = self._recipe(cost_spec)
            if is_own and len(spec.fill_curve) == N_POSITION_BINS:
                own.append((i, spec))
            else:
                gaps[i] = self._spec_curve(cost_spec)[:width]
        if own:  # (SpecProfile.fill_by_position_s of each: its bins' fills, its head's where it has them)
            rows = [i for i, _ in own]
            scale = np.array([spec.fill_scale_s for _, spec in own])
            by_bin = scale[:, None] * np.array([spec.fill_curve for _, spec in own], np.float64)
            gaps[rows] = by_bin[:, self._bins[:width]]
            _scatter(gaps, rows, [spec.fill_head[:width] for _, spec in own], scale)
        np.copyto(curves, gaps, where=np.isnan(curves))
        for text, curve, length in zip(todo, curves, lengths):
            replaced = drawn.get(text)
            if replaced is not None:
                self._drawn_values -= len(replaced[1])
            drawn[text] = (width_now, curve[:length].copy())  # (not a view holding the others drawn with it)
            self._drawn_values += length

    def _draw_ahead(self, cost_specs: list[tuple | None]) -> None:
        """The accept rows of the entering requests' ``cost_specs`` that no slot holds, drawn together (their
        quantiles and their scaling as arrays over the rows: each value as drawn alone), for their first
        requests to take as they arrive (:meth:`_write_row`). Only where a cost spec's pools are its fills and
        accepts (no draft or forced-token pools)."""
        if len(self._drawn) > _DRAWN_AHEAD:  # (rows of requests that never arrived, or whose spec was held)
            self._drawn.clear()
        held, drawn = self._rows.slot, self._drawn
        new = [cost_spec for cost_spec in dict.fromkeys(cost_specs)  # (in order, once each)
               if cost_spec is not None and cost_spec not in held and cost_spec not in drawn]
        # the streams as _rng seeds them, past the fills' uniforms: a call for each length of seeding words
        states: dict[tuple, tuple[int, int]] = {}
        by_length: dict[int, list[tuple]] = {}
        entropies = {}
        for cost_spec in new:
            words = entropies[cost_spec] = self._entropy(cost_spec)
            if words is None:  # (numpy's own seeding refuses it)
                self._rng(cost_spec)
            by_length.setdefault(len(words), []).append(cost_spec)
        for specs in by_length.values():
            states.update(zip(specs, _stream_states(np.array([entropies[c] for c in specs], np.uint32), _SKIP_FILLS)))
        by_kind: dict[str, list[tuple]] = {}
        for cost_spec in new:
            by_kind.setdefault(cost_spec[0], []).append(cost_spec)
        bits = self._bits
        for kind, specs in by_kind.items():
            accept = self._kind(kind)[2]
            means = np.array([accept.mean * self._accept_scale(cost_spec, accept) for cost_spec in specs])
            for at in range(0, len(specs), _DRAWN_TOGETHER):  # (a few rows at a time: their arrays stay in cache)
                group = specs[at:at + _DRAWN_TOGETHER]
                u = np.empty((len(group), SPAN))
                for i, cost_spec in enumerate(group):
                    state, inc = states[cost_spec]
                    bits.bit_generator.state = {"bit_generator": "PCG64", "state": {"state": state, "inc": inc},
                                                "has_uint32": 0, "uinteger": 0}
                    bits.random(out=u[i])
                pools = accept.quantile_of_uniform(u.ravel()).reshape(u.shape)
                for cost_spec, row in zip(group, _rows(pools, means[at:at + len(group)])):
                    drawn[cost_spec] = row

    def _accept_scale(self, cost_spec: tuple, accept) -> float:
        """How much ``cost_spec``'s accepts are scaled from its kind's ``accept`` distribution."""
        spec = self._recipe(cost_spec)[2]
        return spec.accept_s / accept.p50 if spec is not None and spec.accept_s is not None and accept.p50 > 0 \
            else 1.0

    def _set(self, rids: np.ndarray, think: np.ndarray, reject: np.ndarray, end: np.ndarray) -> None:
        """Slots' thinking accepts, refused positions and walk ends, each column made when first not neutral."""
        if self.think_accept is None and think.any():
            self.think_accept = np.zeros(len(self.base))
        if self.think_accept is not None:
            self.think_accept[rids] = think
        if self.reject_left is None and (reject >= 0).any():
            self.reject_left = np.full(len(self.base), -1, np.int64)
        if self.reject_left is not None:
            self.reject_left[rids] = reject
        if self.end_left is None and end.any():
            self.end_left = np.zeros(len(self.base), np.int64)
        if self.end_left is not None:
            self.end_left[rids] = end

    def grow(self, capacity: int) -> None:
        old = len(self.base)
        if capacity <= old:
            return
        for name in ("base", "off_end", "curve_end", "draft_chain", "fill_base", "think_accept", "end_left",
                     "_out_len", "_curve_at"):
            setattr(self, name, _grown(getattr(self, name), capacity))
        if self.reject_left is not None:
            grown = np.full(len(self.base), -1, np.int64)
            grown[:old] = self.reject_left
            self.reject_left = grown
        more = len(self.base) - old
        for slots in (self._spec_of, self._text_of, self._chain_of):
            slots.extend([None] * more)

    def _widen(self, width: int) -> None:
        """Curve slots of ``width`` positions (at least), each held curve written again at that width."""
        self.width = width = max(width, 2 * self.width)
        self._bins = position_bins(np.arange(width))
        self.curve = np.ones(max(self._curves.size, 1) * width)
        if self.accept_curve is not None:
            self.accept_curve = np.full(len(self.curve), np.nan)
        for item, slot in self._curves.slot.items():
            self._write_curve(slot, item, width)
        if self._curve_slots:
            rids = np.fromiter(self._curve_slots, np.int64, len(self._curve_slots))
            self.curve_end[rids] = self._curve_at[rids] * width + self._out_len[rids]

    def _write_curve(self, slot: int, item: tuple, reach: int) -> None:
        """``item``'s curve into curve slot ``slot``: the whole width, or as written ahead if that reaches
        ``reach`` positions."""
        at = slice(slot * self.width, (slot + 1) * self.width)
        what, which = item
        self._curve_len[slot] = self.width
        timed = False
        if what == "spec":
            self.curve[at] = self._spec_curve(which)
        else:
            drawn = self._drawn_curves.get(which)
            if drawn is not None and drawn[0] == self.width and len(drawn[1]) >= reach:  # (written as it entered:
                self.curve[at.start:at.start + len(drawn[1])] = drawn[1]  # its accepts were not timed)
                self._curve_len[slot] = len(drawn[1])
            else:
                measured = self.profile.instances[which].fill_at(self.width)
                self.curve[at] = np.where(np.isnan(measured), self._spec_curve(self._text_gaps[which]), measured)
                timed = bool(self.profile.instances[which].accept_s)
        if timed and self.accept_curve is None:
            self.accept_curve = np.full(len(self.curve), np.nan)
        if self.accept_curve is not None:
            self.accept_curve[at] = self.profile.instances[which].accept_at(self.width) if timed else np.nan

    def acquire(self, rid: int) -> None:
        cost_spec = self._spec_of[rid]
        if cost_spec is None:
            return
        slot, new = self._rows.take(cost_spec)
        text = self._text_of[rid]
        if new:
            self._grow_rows(self._rows.size)
            self._write_row(slot, cost_spec, text is None)
        else:
            if self._drawn:  # (held since its request entered)
                self._drawn.pop(cost_spec, None)
            if text is None and slot in self._unfilled:
                self._write_fill(slot, cost_spec)
        self.base[rid] = slot * ROW
        item = ("spec", cost_spec) if text is None else ("text", text)
        curve, new = self._curves.take(item)
        reach = int(self._out_len[rid]) + 1  # (the positions its answer reads, and one)
        if new:
            self.curve = _grown(self.curve, self._curves.size * self.width)
            if self.accept_curve is not None:
                self.accept_curve = _grown(self.accept_curve, len(self.curve))
            self._write_curve(curve, item, reach)
        else:
            if self._curve_len[curve] < reach:  # written ahead for a shorter answer: written whole
                self._write_curve(curve, item, reach)
        self._curve_slots[rid] = item
        self._curve_at[rid] = curve
        self.curve_end[rid] = curve * self.width + self._out_len[rid]
        if text is not None and self.fill_base is None:  # the first replayed text: the others read their base
            self.fill_base = self.base.copy()
        if self.fill_base is not None:
            self.fill_base[rid] = 0 if text is not None else slot * ROW
        if self.draft_chain is not None:
            chain = self._chain_of[rid]
            chain_slot = 0
            if chain is not None:
                chain_slot, new = self._chain_slots.take(chain)
                if new:
                    self.draft_survival = _grown(self.draft_survival, self._chain_slots.size)
                    self.draft_survival[chain_slot] = self._survival(chain)
            self.draft_chain[rid] = chain_slot

    def release(self, rid: int) -> None:
        item = self._curve_slots.pop(rid, None)
        if item is None:  # (never acquired: unconstrained)
            return
        self._curves.drop(item)
        self._rows.drop(self._spec_of[rid])
        chain = self._chain_of[rid]
        if self.draft_chain is not None and chain is not None:
            self._chain_slots.drop(chain)

    def _grow_rows(self, rows: int) -> None:
        if len(self.fill) >= rows * ROW:  # (every pool grows with the fills)
            return
        for name in ("fill", "fill_csum", "accept", "rollback", "forced", "spike"):
            setattr(self, name, _grown(getattr(self, name), rows * ROW))

    def _recipe(self, cost_spec: tuple) -> tuple[str, str | None, SpecProfile | None, bool]:
        """(kind, name seeding its pools, the spec it is priced by, own fills) of ``cost_spec``: (kind, seeding
        name or ``None`` for the kind's shared one, the priced name)."""
        kind, seeded, priced = cost_spec
        spec = self.index.spec(priced)
        own = seeded is not None and spec.fills > 0 and self._kind(kind)[1] and len(spec.fill_residual) > 0
        return kind, seeded, spec, own

    def _spec_curve(self, cost_spec: tuple) -> np.ndarray:
        kind, _, spec, own = self._recipe(cost_spec)
        if own:
            return spec.fill_by_position_s(np.arange(self.width), self._bins)
        kp = self.profile.kind(kind)
        curve = kp.fill_curve if self._kind(kind)[1] and len(kp.fill_curve) == N_POSITION_BINS else None
        return kp.fill_s.mean * np.asarray(curve)[self._bins] if curve is not None else np.ones(self.width)

    def _survival(self, chain: tuple) -> np.ndarray:
        name, kind = chain
        source = self.index.spec(name) if name is not None else self.profile.kind(kind)
        return _survival(source.draft_tried, source.draft_valid)

    def _write_row(self, slot: int, cost_spec: tuple, fill: bool) -> None:
        """Draw ``cost_spec``'s pools into row ``slot`` (the same values whichever slot), its fills (and their
        prefix sums and outliers) only if ``fill``: a request replaying its text reads the row of ones instead,
        so a cost spec whose requests all replay texts never reads them (:meth:`_write_fill`, once one does)."""
        at = slice(slot * ROW, (slot + 1) * ROW)
        drawn = self._drawn.pop(cost_spec, None)
        if drawn is not None:  # (its accepts drawn as its request entered: the fills, if read, from the start)
            self.accept[at] = drawn
            if fill:
                self._write_fill(slot, cost_spec)
            else:
                self._unfilled.add(slot)
            return
        kind, _, spec, _ = self._recipe(cost_spec)
        _, _, accept, rollback = self._kind(kind)
        kp = self.profile.kind(kind)
        rng = self._rng(cost_spec)
        # (one stream: the first rows of uniforms are the same however many; the fills' are the first)
        if fill:
            self._unfilled.discard(slot)
            u = rng.random((self._uniforms, SPAN))
            self._fill_row(at, cost_spec, u[0])
            u = u[1:]
        else:  # the fills' uniforms skipped: each is one 64-bit draw of the stream
            self._unfilled.add(slot)
            rng.bit_generator.advance(SPAN)
            u = rng.random((self._uniforms - 1, SPAN))
        accept_scale, rollback_scale = self._accept_scale(cost_spec, accept), 1.0
        if spec is not None and spec.rollback_s is not None and rollback is not None and rollback.p50 > 0:
            rollback_scale = spec.rollback_s / rollback.p50
        _row(accept.quantile_of_uniform(u[0]), accept.mean * accept_scale, self.accept[at])
        if self.rollback is not None:
            self.rollback[at] = np.nan if rollback is None else \
                _row(rollback.quantile_of_uniform(u[1]), rollback.mean * rollback_scale)
        if self.forced is not None:
            jumps = rng.geometric(1.0 / max(kp.jump_forward_mean_tokens, 1.0), SPAN)
            self.forced[at] = _row(np.where(u[2] < kp.jump_forward_fraction, jumps, 0))

    def _rng(self, cost_spec: tuple) -> np.random.Generator:
        """The generator of ``cost_spec``'s pools, from the start of its stream."""
        kind, seeded, _ = cost_spec
        return _seeded([self.seed, 0x6772, KIND_CODES[kind], int(seeded, 16) if seeded is not None else 0])

    def _entropy(self, cost_spec: tuple) -> list[int] | None:
        """The 32-bit words seeding :meth:`_rng`'s stream (``None``: a negative seed)."""
        kind, seeded, _ = cost_spec
        return _words([self.seed, 0x6772, KIND_CODES[kind], int(seeded, 16) if seeded is not None else 0])

    def _write_fill(self, slot: int, cost_spec: tuple) -> None:
        """The fills of ``cost_spec`` into row ``slot``, left out when its row was drawn (:meth:`_write_row`)."""
        self._unfilled.discard(slot)
        self._fill_row(slice(slot * ROW, (slot + 1) * ROW), cost_spec, self._rng(cost_spec).random(SPAN))

    def _fill_row(self, at: slice, cost_spec: tuple, u: np.ndarray) -> None:
        """``cost_spec``'s fills (from its stream's first uniforms ``u``), their prefix sums and outliers at ``at``."""
        kind, seeded, spec, own = self._recipe(cost_spec)
        fill_dist = self._kind(kind)[0]
        spiky = own and spec.fill_outlier_rate > 0 and len(spec.fill_outliers_s) > 0
        if spiky and self.spike is None:  # the first spec with outliers: the others add none
            self.spike = np.zeros(len(self.fill))
        if self.spike is not None:
            spikes_rng = _seeded([self.seed, 0x7370, KIND_CODES[kind], int(seeded, 16)]) if spiky else None
            self.spike[at] = _spikes(spec, spikes_rng) if spiky else 0.0
        if own:
            _row(_cycle(np.asarray(spec.fill_residual), u), 1.0, self.fill[at])
        else:
            _row(fill_dist.quantile_of_uniform(u), fill_dist.mean, self.fill[at])
        if self.fill_csum is not None:
            self.fill_csum[at] = _csum(self.fill[at])[:ROW]
