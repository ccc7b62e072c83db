"""How much text a prompt may be before it is tokenized whole (issue 10, defect 2)."""

from __future__ import annotations

import functools
import math
import unicodedata

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

import dpu_frontend.text.tokenizer as tokenizer_module
from dpu_frontend.text.tokenizer import (
    COUNT_CHUNK_CHARS,
    CUT_MARGIN,
    MAX_DECOMPOSITION,
    MAX_DECOMPOSITION_PER_BYTE,
    Vocabulary,
    count_beyond,
    encode,
    max_token_chars,
)
from tests.assets import tokenizer_dir


@functools.cache
def vocab(name: str) -> Vocabulary:
    return Vocabulary.load(tokenizer_dir(name))


def test_the_decomposition_constants_hold_over_all_of_unicode() -> None:
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    longest = max(len(unicodedata.normalize("NFD", c)) for c in chars)
    per_byte = max(len(unicodedata.normalize("NFD", c)) / len(c.encode()) for c in chars)
    assert (longest, per_byte) == (MAX_DECOMPOSITION, MAX_DECOMPOSITION_PER_BYTE)


@pytest.mark.parametrize(("name", "bound"), [
    ("qwen3", 192),  # 128-byte entries, NFC: 1.5 characters a byte at most
    ("llama3_1", 128), ("gpt2", 128),  # byte-level, no normalizer
    ("mistral", 16),  # Metaspace-like normalizers that never shorten, byte fallback
])
def test_the_bound_of_each_test_tokenizer(name: str, bound: int) -> None:
    assert vocab(name).max_token_chars == bound


def byte_level(normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    """A byte-level BPE of the 256 byte characters and one 8-byte entry."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    words = {c: i for i, c in enumerate(sorted(alphabet))} | {"abcdefgh": 256}
    tokenizer = Tokenizer(models.BPE(words, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    return tokenizer


def test_the_bound_follows_the_normalizer() -> None:
    assert max_token_chars(byte_level()) == 8
    assert max_token_chars(byte_level(normalizers.NFD())) == 8  # decomposing only adds
    assert max_token_chars(byte_level(normalizers.NFC())) == 12  # 8 bytes, 1.5 a byte
    assert max_token_chars(byte_level(normalizers.Replace("  ", " "))) == 16  # halves spaces
    assert max_token_chars(byte_level(normalizers.Strip())) is None  # deletes, unbounded
    assert max_token_chars(byte_level(normalizers.Sequence(
        [normalizers.NFC(), normalizers.StripAccents()]))) is None


def test_no_bound_where_characters_can_vanish() -> None:
    words = {"[UNK]": 0, "a": 1, "b": 2}
    unknown = Tokenizer(models.BPE(words, [], unk_token="[UNK]"))
    assert max_token_chars(unknown) is None  # a character not in the vocabulary: [UNK]
    dropping = byte_level()
    dropping.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert max_token_chars(dropping) is None  # whitespace is thrown away
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert max_token_chars(wordpiece) is None  # a long unknown word is one [UNK]
    swallowing = byte_level()
    swallowing.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert max_token_chars(swallowing) is None  # it takes the spaces before it along


@pytest.mark.parametrize("text", [
    " " * 20_000,  # Qwen3's longest entries are runs of spaces and dashes
    "-" * 20_000,
    "U\u0308\u0304" * 5_000,  # U+01D5 decomposed: NFC makes 3 characters 2 bytes
    "\u03b1\u0313\u0300\u0345" * 5_000,  # U+1F82 decomposed: 4 characters, 3 bytes
])
def test_no_text_has_fewer_tokens_than_the_bound_says(text: str) -> None:
    v = vocab("qwen3")
    assert v.max_token_chars is not None
    assert len(v.encode(text, add_special_tokens=False)) >= math.ceil(
        len(text) / v.max_token_chars)


LONG = ("The quick brown fox jumps over the lazy dog, again and again; " * 1_200 + "\n") * 2


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "gpt2", "mistral"])
def test_counting_by_chunks_never_counts_more_than_the_whole(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "COUNT_CHUNK_CHARS", 4096)  # more cuts, less time
    tokenizer = vocab(name).tokenizer
    chunks = 8 * 4096 + 1000  # nine chunks, eight cuts
    for text in [LONG, "1" * chunks, "\u4e2d\u6587" * (chunks // 2), "word" * (chunks // 4)]:
        whole = len(encode(tokenizer, text, add_special_tokens=False))
        counted = count_beyond(tokenizer, text, whole // 4)
        assert counted is not None and whole // 4 < counted <= whole


def test_counting_gives_up_on_a_text_likely_to_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a first chunk that projects to at most twice the limit, it is tokenized
    whole; a dense first chunk is counted on, to the end if the rest is sparse."""
    monkeypatch.setattr(tokenizer_module, "COUNT_CHUNK_CHARS", 4096)
    tokenizer = vocab("qwen3").tokenizer
    spaces = " " * (8 * 4096)  # 256 tokens of 128 spaces
    assert count_beyond(tokenizer, spaces, 128) is None  # projects to 256: give up
    assert count_beyond(tokenizer, spaces, 127) == 5 * 32 - 4 * CUT_MARGIN  # 5 chunks of 32
    dense_then_sparse = "1" * 4096 + spaces  # the first chunk projects to 36864
    whole = len(encode(tokenizer, dense_then_sparse, add_special_tokens=False))
    assert count_beyond(tokenizer, dense_then_sparse, whole) is None  # counted to the end
    # Each further chunk adds 32 tokens less a cut's margin: past the limit after five.
    assert count_beyond(tokenizer, dense_then_sparse, 4096 + 100) == 4096 + 5 * (32 - CUT_MARGIN)


def test_a_clean_cut_costs_nothing_for_byte_level_pre_tokenizers() -> None:
    """Cut before a space after a non-space, Qwen3's chunks add up to the whole exactly."""
    tokenizer = vocab("qwen3").tokenizer
    start, pieces = 0, []
    while start < len(LONG):
        end = tokenizer_module._cut(LONG, start + COUNT_CHUNK_CHARS)
        assert end == len(LONG) or (LONG[end] == " " and LONG[end - 1] != " ")
        pieces.append(LONG[start:end])
        start = end
    assert len(pieces) == 3
    ids = [i for piece in pieces for i in encode(tokenizer, piece, add_special_tokens=False)]
    assert ids == encode(tokenizer, LONG, add_special_tokens=False)
