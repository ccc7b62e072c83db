"""Streamed text equals the full decode, for four real tokenizers (BRIEF section 5).

Qwen3 (bundled), Llama-3.1 and GPT-2 are byte-level BPE; Mistral-7B v0.1 is
sentencepiece with byte fallback, whose decoder drops a sequence's leading
space and whose DecodeStream raises "Invalid prefix" on garbage.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpu_frontend.text.detokenizer import IncrementalDetokenizer
from dpu_frontend.text.tokenizer import Vocabulary
from tests.assets import TOKENIZERS, tokenizer_dir

TEXTS = [
    "Hello, world! The quick brown fox.",
    "日本語の文章と中文字符、한국어도",
    "emoji 🚀🌍🫠🦩 and a family 👩‍👩‍👧‍👦 joined by ZWJ, 🧑🏽‍🚀 too",
    "rare CJK 𠀀 and music 𝄞, accents ünïcödé ñ",
    "  leading spaces\nnew lines\n\n\ttabs  ",
]
PROMPT = "Complete this:"


@functools.cache
def vocab(name: str) -> Vocabulary:
    return Vocabulary.load(tokenizer_dir(name))


def stream(v: Vocabulary, ids: list[int], context: list[int], chunk: int) -> list[str]:
    detok = IncrementalDetokenizer(v, context=context)
    pieces = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.finish())
    return pieces


def check(v: Vocabulary, ids: list[int], chunk: int = 1) -> str:
    context = v.context(v.encode(PROMPT))
    pieces = stream(v, ids, context, chunk)
    full = v.decode_continuation(context, ids)
    assert "".join(pieces) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in p for p in pieces)
    return full


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3, 10])
def test_stream_equals_decode(name: str, text: str, chunk: int) -> None:
    v = vocab(name)
    ids = v.encode(text, add_special_tokens=False)
    full = check(v, ids, chunk)
    # Byte-level BPE is lossless; sentencepiece gives the word its leading space back.
    assert full.strip() == text.strip()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_generation_ending_inside_a_utf8_sequence(name: str) -> None:
    v = vocab(name)
    ids = v.encode("ok 🫠", add_special_tokens=False)
    truncated = ids[:-1]
    full = check(v, truncated)
    assert full.endswith("\ufffd")  # the full decode's own verdict on the broken tail


@pytest.mark.parametrize("name", TOKENIZERS)
def test_special_tokens_are_skipped_like_the_full_decode(name: str) -> None:
    v = vocab(name)
    ids = [*v.encode("hi", add_special_tokens=False), *v.eos_token_ids,
           *v.encode(" there", add_special_tokens=False)]
    assert check(v, ids).replace(" ", "") == "hithere"


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), chunk=st.integers(1, 6))
def test_any_text_streams_exactly(name: str, text: str, chunk: int) -> None:
    v = vocab(name)
    check(v, v.encode(text, add_special_tokens=False), chunk)


def test_mistral_garbage_resets_the_stream_and_keeps_going() -> None:
    """Byte-fallback garbage makes DecodeStream raise "Invalid prefix": text continues."""
    v = vocab("mistral")
    ids = [108, 1, 0, 1, 215, 0, 26623, 0, 95, 133, 45, 1]  # a sequence seen to raise
    detok = IncrementalDetokenizer(v)
    pieces = [detok.push([i]) for i in ids]
    assert detok.resets >= 1
    assert "".join(pieces).strip()  # text kept flowing after the reset
