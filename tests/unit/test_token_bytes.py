"""Token bytes and text for log probabilities, on the four test vocabularies."""

from __future__ import annotations

import pytest

from dpu_frontend.text.token_bytes import TokenBytes, byte_level_alphabet
from dpu_frontend.text.tokenizer import Vocabulary
from tests.assets import TOKENIZERS, tokenizer_dir

TEXT = "héllo wörld ✓ 🙂 the end\n\tdone"


def test_the_byte_level_alphabet_covers_every_byte_once() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["!"] == 0x21 and alphabet["\u0120"] == 0x20  # "Ġ" is a space


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_bytes_of_the_tokens_are_the_text(name: str) -> None:
    vocab = Vocabulary.load(tokenizer_dir(name))
    tokens = TokenBytes(vocab.tokenizer)
    ids = vocab.encode(TEXT, add_special_tokens=False)
    raw = b"".join(got[1] for got in map(tokens.get, ids) if got is not None)
    # A sentencepiece vocabulary writes the space it prepends to the first word.
    assert raw.decode() in (TEXT, " " + TEXT)
    assert tokens.get(vocab.tokenizer.get_vocab_size() + 10) is None


def test_a_partial_character_shows_as_a_replacement_but_keeps_its_bytes() -> None:
    vocab = Vocabulary.load(tokenizer_dir("qwen3"))
    tokens = TokenBytes(vocab.tokenizer)
    ids = vocab.encode("\U0001FAE8", add_special_tokens=False)  # a rare emoji: 3 tokens
    parts = [tokens.get(i) for i in ids]
    assert len(ids) > 1 and all(p is not None for p in parts)
    assert b"".join(p[1] for p in parts if p) == "\U0001FAE8".encode()
    assert any("\ufffd" in p[0] for p in parts if p)


def test_added_tokens_are_their_content() -> None:
    vocab = Vocabulary.load(tokenizer_dir("qwen3"))
    eos = vocab.eos_token_ids[0]
    assert TokenBytes(vocab.tokenizer).get(eos) == ("<|im_end|>", b"<|im_end|>")
