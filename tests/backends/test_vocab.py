"""The offline vocabularies: sizes, special tokens, encode/decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdbench.backends import available_vocabs, load_vocab
from cdbench.backends.vocab import UnknownVocabularyError

# name: (size, eos ids, special/added ids, unused ids)
FACTS = {
    "deepseek-v4": (129280, (1,), 1283, 0),
    "qwen3.6": (248077, (248044,), 33, 0),
    "cl100k": (100277, (100257,), 5, 16),
}


def test_available_vocabs():
    assert available_vocabs() == sorted(FACTS)


@pytest.mark.parametrize("name", sorted(FACTS))
def test_sizes_eos_and_special_tokens(name):
    size, eos, n_special, n_unused = FACTS[name]
    vocab = load_vocab(name)
    assert (vocab.size, vocab.eos_token_ids) == (size, eos)
    assert (len(vocab.special_token_ids), len(vocab.unused_token_ids)) == (n_special, n_unused)
    assert len(vocab.token_bytes) == size
    assert set(eos) <= vocab.special_token_ids
    assert vocab.forbidden_token_ids == vocab.special_token_ids | vocab.unused_token_ids
    assert all(vocab.token_bytes[i] == b"" for i in vocab.unused_token_ids)
    assert all(vocab.token_bytes[i] for i in range(size) if i not in vocab.unused_token_ids)


def test_cl100k_gaps_are_unused():
    assert set(range(100261, 100276)) <= load_vocab("cl100k").unused_token_ids


@pytest.mark.parametrize(("name", "text"), [("deepseek-v4", "<｜end▁of▁sentence｜>"), ("qwen3.6", "<|im_start|>"),
                                            ("cl100k", "<|endoftext|>")])
def test_special_token_text_encodes_as_plain_text(name, text):
    vocab = load_vocab(name)
    special = vocab.token_id(text)
    assert special in vocab.special_token_ids
    ids = vocab.encode(text)
    assert special not in ids and not set(ids) & vocab.special_token_ids
    assert vocab.decode(ids) == text


def test_token_id_of_a_multi_token_text_names_it():
    with pytest.raises(ValueError, match="'hello world' is not a single token"):
        load_vocab("cl100k").token_id("hello world")


@pytest.mark.parametrize("name", sorted(FACTS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_encode_decode_round_trip(name, text):
    vocab = load_vocab(name)
    ids = vocab.encode(text)
    assert vocab.decode(ids) == text
    assert vocab.decode_bytes(ids) == text.encode()
    assert all(0 <= i < vocab.size for i in ids)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownVocabularyError) as info:
        load_vocab("gpt2")
    message = str(info.value)
    assert "'gpt2'" in message and all(name in message for name in FACTS)


def test_load_is_cached():
    assert load_vocab("cl100k") is load_vocab("cl100k")
