"""Log probabilities through the daemon and the reference peer (shm), with the official SDK.

The reference peer's tokens are deterministic: each has log probability 0
and is its own only alternative (docs/protocol.md, section 9). What these
tests check is the path: the request flag, the records that carry entries,
and OpenAI's two shapes, streamed and not. Values against a real model's
log-softmax are checked on the GPU (tests/gpu/test_model_serving.py).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from openai import OpenAI

from dpu_frontend.text.tokenizer import Vocabulary
from tests.integration.scenarios import CHAT, chat_prompt_ids, replay_generation
from tests.stack import MODEL, Stack, running_stack

PROMPT = "Tell me about streaming text."


def test_chat_logprobs_streamed_and_not(client: OpenAI, vocab: Vocabulary) -> None:
    ids, _ = replay_generation(vocab, chat_prompt_ids(vocab), 24)
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=24,
                                          logprobs=True, top_logprobs=3)
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == len(ids)
    # Every token's bytes, joined, are the text (a character split over tokens included).
    assert bytes(b for t in content for b in t.bytes or ()).decode() == vocab.decode(ids)
    assert full.choices[0].message.content == vocab.decode(ids)
    for token in content:
        assert token.logprob == 0.0
        assert [(a.token, a.logprob, a.bytes) for a in token.top_logprobs] == [
            (token.token, 0.0, token.bytes)]
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=24, logprobs=True, top_logprobs=3,
        stream=True) if c.choices and c.choices[0].logprobs]
    assert [t for chunk in streamed for t in chunk.content or ()] == content


def test_chat_logprobs_without_alternatives(client: OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5,
                                          logprobs=True)
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(t.top_logprobs == [] for t in content)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_streamed_and_not(client: OpenAI, vocab: Vocabulary) -> None:
    ids, _ = replay_generation(vocab, vocab.encode(PROMPT), 20)
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, logprobs=2)
    lp = full.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    text = full.choices[0].text
    assert text == vocab.decode(ids) and len(lp.tokens) == len(ids)
    assert lp.token_logprobs == [0.0] * len(ids)
    assert lp.top_logprobs == [{t: 0.0} for t in lp.tokens]
    # Offsets: where each token's text starts in the completion's text.
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(text.startswith(vocab.decode(ids[:i]).rstrip("\ufffd"))
               and lp.text_offset[i] <= len(vocab.decode(ids[:i])) for i in range(len(ids)))
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                            logprobs=2, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens or ()] == lp.tokens
    assert [o for s in streamed for o in s.text_offset or ()] == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text


async def test_every_choice_has_its_own_logprobs(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": [PROMPT, "Another one"], "max_tokens": 6, "n": 2,
            "seed": 3, "logprobs": 1}
    async with aiohttp.ClientSession() as http, http.post(
            f"{stack.base_url}/v1/completions", json=body) as r:
        payload = await r.json()
    assert r.status == 200, payload
    columns = [c["logprobs"] for c in payload["choices"]]
    assert len(columns) == 4
    assert all(len(c["tokens"]) == len(c["token_logprobs"]) == len(c["text_offset"]) >= 1
               for c in columns)
    assert sum(len(c["tokens"]) for c in columns) == payload["usage"]["completion_tokens"]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": 1}, "logprobs"),
    ({"prompt": PROMPT, "logprobs": 6}, "logprobs"),
    ({"prompt": PROMPT, "logprobs": True}, "logprobs"),
    ({"prompt": PROMPT, "logprobs": 1, "echo": True}, "echo"),
])
async def test_bad_logprobs_parameters_are_400s(stack: Stack, body: dict[str, Any],
                                                param: str) -> None:
    path = "chat/completions" if "messages" in body else "completions"
    async with aiohttp.ClientSession() as http, http.post(
            f"{stack.base_url}/v1/{path}", json={"model": MODEL} | body) as r:
        payload = await r.json()
    assert r.status == 400, payload
    assert payload["error"]["param"] == param


def test_a_peer_without_logprobs_refuses_them_with_a_400() -> None:
    with running_stack("shm", timeout=60,
                       peer_args=("--no-logprobs", "--resp-slot-size", "64")) as stack:
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not compute log probabilities"):
            client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True)
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage
        client.close()


def test_a_stop_string_keeps_the_logprobs_of_the_tokens_it_read(client: OpenAI,
                                                                   vocab: Vocabulary) -> None:
    ids, _ = replay_generation(vocab, vocab.encode(PROMPT), 40)
    text = vocab.decode(ids)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, logprobs=0,
                                     stop=stop)
    choice = full.choices[0]
    assert choice.finish_reason == "stop" and choice.text == text[:text.index(stop)]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    # The tokens up to the one that completed the stop string, not beyond.
    assert len(text[:text.index(stop)]) < len("".join(choice.logprobs.tokens)) <= len(text)
