"""Streamed text equals the full decode, character for character (bundled Qwen3 tokenizer)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.detokenizer import IncrementalDetokenizer
from dpu_frontend.text.tokenizer import Vocabulary

VOCAB = Vocabulary.load(default_tokenizer_dir())
TOK = VOCAB.tokenizer


def stream(ids: list[int], chunk: int = 1) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(TOK)
    pieces = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.finish())
    return pieces, "".join(pieces)


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "日本語の文章と中文字符",
    "emoji 🚀🌍🫠🦩 and a family 👩‍👩‍👧‍👦 joined by ZWJ, 🧑🏽‍🚀",
    "rare CJK 𠀀 and music 𝄞",
    "mixed 😀 ascii ünïcödé ñ 한국어",
])
@pytest.mark.parametrize("chunk", [1, 3, 10])
def test_stream_equals_decode(text: str, chunk: int) -> None:
    ids = VOCAB.encode(text)
    pieces, joined = stream(ids, chunk)
    assert joined == TOK.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_generation_ending_inside_a_utf8_sequence_emits_the_decoder_tail() -> None:
    ids = VOCAB.encode("🫠")
    assert len(ids) > 1, "the emoji must span several byte tokens for this test"
    truncated = ids[:-1]
    pieces, joined = stream(truncated)
    assert joined == TOK.decode(truncated) == "\ufffd"  # the full decode's verdict, once
    assert pieces[-1] == "\ufffd" and not any(pieces[:-1])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 151642), min_size=1, max_size=40), st.integers(1, 5))
def test_random_ids_stream_equals_decode(ids: list[int], chunk: int) -> None:
    _, joined = stream(ids, chunk)
    assert joined == TOK.decode(ids)


def test_special_tokens_are_skipped_like_the_full_decode() -> None:
    ids = [*VOCAB.encode("hi"), *VOCAB.eos_token_ids, *VOCAB.encode(" there")]
    _, joined = stream(ids)
    assert joined == TOK.decode(ids, skip_special_tokens=True) == "hi there"
