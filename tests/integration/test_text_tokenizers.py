"""Text correctness end to end for four real tokenizers (shm).

The peer runs in echo mode with the same tokenizer as the daemon, so the
generated ids are exactly the prompt ids the test sends: the test chooses
what comes out of the GPU, including a generation that ends inside an
incomplete UTF-8 sequence. Streamed text == non-streamed text == the full
decode of the generated ids (after the prompt's context).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from dpu_frontend.text.tokenizer import Vocabulary
from tests.assets import TOKENIZERS, tokenizer_dir
from tests.stack import MODEL, running_stack

CASES = {
    "ascii": "The ring protocol, byte by byte.",
    "cjk": "日本語の文章と中文字符、한국어도 섞어서",
    "emoji": "launch 🚀 globe 🌍 melting 🫠 flamingo 🦩",
    "zwj": "family 👩‍👩‍👧‍👦 and astronaut 🧑🏽‍🚀",
}


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request: pytest.FixtureRequest) -> Iterator[tuple[str, Vocabulary, OpenAI]]:
    folder = tokenizer_dir(request.param)
    vocab = Vocabulary.load(folder)
    # One token per record, so that text arrives in as many pieces as it can.
    peer_args = ("--tokenizer", str(folder), "--resp-slot-size", "64", "--no-logprobs",
                 "--tokens-per-step", "1")
    with running_stack("shm", mode="echo", timeout=60, peer_args=peer_args,
                       serve_args=("--tokenizer", str(folder))) as stack:
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
        yield request.param, vocab, client
        client.close()


def generate(client: OpenAI, ids: list[int]) -> tuple[str, list[str]]:
    full = client.completions.create(model=MODEL, prompt=ids, max_tokens=len(ids))
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=len(ids), stream=True)]
    return full.choices[0].text, pieces


@pytest.mark.parametrize("case", CASES)
def test_stream_equals_full_equals_decode(tokenizer: tuple[str, Vocabulary, OpenAI],
                                          case: str) -> None:
    _, vocab, client = tokenizer
    ids = vocab.encode(CASES[case], add_special_tokens=False)
    full, pieces = generate(client, ids)
    expected = vocab.decode_continuation(vocab.context(ids), ids)
    assert full == "".join(pieces) == expected
    assert expected.strip() == CASES[case].strip()
    assert not any("\ufffd" in p for p in pieces)
    assert len([p for p in pieces if p]) > 1


def test_generation_ending_inside_a_utf8_sequence(
        tokenizer: tuple[str, Vocabulary, OpenAI]) -> None:
    _, vocab, client = tokenizer
    ids = vocab.encode("almost done 🫠", add_special_tokens=False)[:-1]
    full, pieces = generate(client, ids)
    expected = vocab.decode_continuation(vocab.context(ids), ids)
    assert full == "".join(pieces) == expected
    assert expected.endswith("\ufffd") and expected.count("\ufffd") == "".join(pieces).count("\ufffd")
