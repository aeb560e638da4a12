"""Valid instances of a spec, tokenized, pooled per spec and cached on disk.

An instance is text the spec accepts, checked by :func:`check_instance` before
use. JSON instances are serialized with the grammar backends' default
whitespace: ``json.dumps(value, separators=(", ", ": "), ensure_ascii=False)``.
Its tokens are ``vocab.encode(text)`` plus the first EOS id.

>>> from cdbench.backends.base import ConstraintSpec
>>> from cdbench.backends.vocab import load_vocab
>>> pool = build_pool("r1", ConstraintSpec("regex", r"[ab]{2}"), load_vocab("cl100k"), size=2, seed=0)
>>> len(pool.texts), pool.texts[0] in {"aa", "ab", "ba", "bb"}
(2, True)

A pool that cannot be filled raises :class:`InstanceFailure` with the reason
of the last attempt. Pools (and failures) persist under
``cache_dir()/workloads/instances``, keyed by the spec's hash, the vocabulary,
the pool size, the seed and :data:`GENERATOR_VERSION`.
"""

from __future__ import annotations

import hashlib
import json
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cdbench._env import cache_dir
from cdbench.backends.base import ConstraintSpec
from cdbench.backends.vocab import Vocabulary
from cdbench.workloads.grammar_instances import GrammarError, grammar_for
from cdbench.workloads.json_instances import SchemaInstanceError, json_instance
from cdbench.workloads.regex_instances import RegexInstanceError, regex_instance
from cdbench.workloads.validate import InvalidInstance, check_instance, schema_error

# Bump when generation, validation or serialization changes: old cache entries are ignored.
GENERATOR_VERSION = 5
# Draws per wanted instance before the spec is reported as failed.
ATTEMPTS_PER_INSTANCE = 8
JSON_SEPARATORS = (", ", ": ")
# Values the hypothesis-jsonschema fallback tries per schema. A count, not a time: a wall-clock cap made
# the outcome depend on the machine's load, so two runs of one seed could draw different workloads.
HYPOTHESIS_EXAMPLES = 25


@dataclass
class InstanceFailure(Exception):
    """No valid instance could be produced for ``spec_id``; ``reason`` says why."""

    spec_id: str
    reason: str

    def __str__(self) -> str:
        return f"{self.spec_id}: {self.reason}"


@dataclass(frozen=True)
class InstancePool:
    """Distinct valid instances of one spec and their tokens (EOS last)."""

    spec_id: str
    texts: tuple[str, ...]
    tokens: tuple[tuple[int, ...], ...]

    def token_set(self) -> frozenset[int]:
        """Every token seen in the pool (draft replacements draw from it)."""
        return frozenset(t for seq in self.tokens for t in seq)


def serialize_json(value: object) -> str:
    """The whitespace convention of every JSON instance."""
    return json.dumps(value, separators=JSON_SEPARATORS, ensure_ascii=False)


def draw_instance(spec: ConstraintSpec, rng: np.random.Generator) -> str:
    """One candidate text for ``spec`` (not yet validated)."""
    if spec.kind == "json_schema":
        schema = json.loads(spec.spec) if isinstance(spec.spec, str) else spec.spec
        return serialize_json(json_instance(schema, rng))
    if spec.kind == "regex":
        return regex_instance(spec.spec, rng)
    if spec.kind == "choice":
        if not spec.spec:
            raise InvalidInstance("empty choice list")
        return spec.spec[int(rng.integers(len(spec.spec)))]
    if spec.kind == "ebnf":
        return grammar_for(spec).instance(rng)
    raise InvalidInstance(f"no instance generator for kind {spec.kind!r}")


def spec_hash(spec: ConstraintSpec) -> str:
    return hashlib.sha256(spec.canonical().encode()).hexdigest()[:32]


class _Found(Exception):
    pass


def hypothesis_json_instance(spec: ConstraintSpec, examples: int = HYPOTHESIS_EXAMPLES) -> str | None:
    """The first valid instance among ``examples`` values of hypothesis-jsonschema, or ``None``.

    The fallback for schemas the direct generator misses: slower, fails on many
    real schemas, but knows JSON Schema semantics the direct generator does not
    steer. Derandomized and bounded by a count of values, so the outcome is the
    same on any machine under any load.
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import HypothesisException
    from hypothesis_jsonschema import from_schema

    # A fresh copy: hypothesis-jsonschema rewrites the schema it is given in place.
    schema = json.loads(spec.spec if isinstance(spec.spec, str) else json.dumps(spec.spec))
    found: list[str] = []

    @settings(database=None, derandomize=True, max_examples=examples, deadline=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(from_schema(schema))
    def probe(value: object) -> None:
        text = serialize_json(value)
        try:
            check_instance(spec, text)
        except InvalidInstance:
            return
        found.append(text)
        raise _Found  # stop at the first valid value

    try:
        probe()
    except _Found:
        pass
    except (HypothesisException, Exception):  # noqa: BLE001 - unsupported schema features raise many types
        return None
    return found[0] if found else None


def valid_instances(spec_id: str, spec: ConstraintSpec, size: int, seed: int) -> list[str]:
    """Up to ``size`` distinct validated texts; raises :class:`InstanceFailure` if none.

    JSON Schemas the direct generator misses fall back to hypothesis-jsonschema
    (one instance, from a bounded number of values).
    """
    if spec.kind == "json_schema":
        problem = schema_error(json.loads(spec.spec) if isinstance(spec.spec, str) else spec.spec)
        if problem is not None:
            raise InstanceFailure(spec_id, problem)  # no draw can help, nor the fallback
    rng = np.random.default_rng([seed, int(spec_hash(spec)[:8], 16)])
    texts: list[str] = []
    reason = "no attempt made"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # re's nested-set warnings from corpus patterns
        for _ in range(size * ATTEMPTS_PER_INSTANCE):
            try:
                text = draw_instance(spec, rng)
                if not text:
                    raise InvalidInstance("empty instance")
                check_instance(spec, text)
            except InvalidInstance as exc:
                reason = f"drawn instance is invalid: {exc}"
                continue
            except (SchemaInstanceError, RegexInstanceError, GrammarError) as exc:
                reason = str(exc)
                if isinstance(exc, GrammarError) and not texts:
                    break  # the grammar itself does not load: no draw will help
                continue
            except Exception as exc:  # noqa: BLE001 - odd specs break generators in odd ways; report, go on
                reason = f"instance generator failed: {str(exc)[:200]}"
                continue
            if text not in texts:
                texts.append(text)
            if len(texts) >= size:
                break
    if not texts and spec.kind == "json_schema":
        fallback = hypothesis_json_instance(spec)
        if fallback is not None:
            texts.append(fallback)
        else:
            reason += " (hypothesis-jsonschema fallback found none)"
    if not texts:
        raise InstanceFailure(spec_id, reason)
    return texts


def build_pool(spec_id: str, spec: ConstraintSpec, vocab: Vocabulary, *, size: int = 4, seed: int = 0) -> InstancePool:
    """Validated instances of ``spec``, tokenized with ``vocab``, EOS appended."""
    texts = valid_instances(spec_id, spec, size, seed)
    eos = vocab.eos_token_ids[0]
    return InstancePool(spec_id, tuple(texts), tuple(tuple(vocab.encode(t)) + (eos,) for t in texts))


class PoolCache:
    """Instance pools on disk, one JSON file per (spec, vocabulary, size, seed, version).

    >>> cache = PoolCache()  # doctest: +SKIP
    >>> pool = cache.get("id", spec, vocab, size=4, seed=0)  # doctest: +SKIP
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else cache_dir() / "workloads" / "instances"

    def _path(self, spec: ConstraintSpec, vocab: Vocabulary, size: int, seed: int) -> Path:
        key = f"v{GENERATOR_VERSION}-{vocab.name}-n{size}-s{seed}"
        h = spec_hash(spec)
        return self.root / key / h[:2] / f"{h}.json"

    def get(self, spec_id: str, spec: ConstraintSpec, vocab: Vocabulary, *, size: int, seed: int) -> InstancePool:
        """The pool for ``spec`` (built and stored on a miss); raises :class:`InstanceFailure`."""
        path = self._path(spec, vocab, size, seed)
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            stored = None
        if stored is not None:
            if "failure" in stored:
                raise InstanceFailure(spec_id, stored["failure"])
            return InstancePool(spec_id, tuple(stored["texts"]), tuple(tuple(t) for t in stored["tokens"]))
        try:
            pool = build_pool(spec_id, spec, vocab, size=size, seed=seed)
            record: dict = {"texts": list(pool.texts), "tokens": [list(t) for t in pool.tokens]}
        except InstanceFailure as failure:
            record = {"failure": failure.reason}
            pool = None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
        tmp.replace(path)  # atomic: concurrent runs never read half a file
        if pool is None:
            raise InstanceFailure(spec_id, record["failure"])
        return pool
