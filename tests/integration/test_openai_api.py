"""The OpenAI-compatible API through a real daemon and peer (shm), with the official SDK."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from dpu_frontend.text.tokenizer import Vocabulary
from tests.integration.scenarios import (
    CHAT,
    chat_prompt_ids,
    check_chat_stream_sdk,
    peer_generation,
    replay_generation,
)
from tests.stack import MODEL, Stack

PROMPT = "Tell me about streaming text."



async def test_chat_stream_async_sdk(stack: Stack) -> None:
    await check_chat_stream_sdk(stack)


def test_chat_sync_sdk_stream_and_not(client: OpenAI, vocab: Vocabulary) -> None:
    ids, finish = replay_generation(vocab, chat_prompt_ids(vocab), 30)
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=30)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == vocab.decode(ids)
    assert full.choices[0].finish_reason == finish
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=30, stream=True))
    assert text == vocab.decode(ids)


async def test_completions_async_sdk(stack: Stack, vocab: Vocabulary) -> None:
    ids, finish = peer_generation(vocab, PROMPT, 25)
    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    try:
        full = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=25)
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=25,
                                                 stream=True)
        text = "".join([c.choices[0].text async for c in stream])
    finally:
        await client.close()
    assert full.choices[0].text == text == vocab.decode(ids)
    assert full.choices[0].finish_reason == finish


def test_prompt_forms_and_n(client: OpenAI, vocab: Vocabulary) -> None:
    prompts = ["First prompt.", "Second prompt, different."]
    expected = [vocab.decode(peer_generation(vocab, p, 12)[0]) for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == expected
    ids = [vocab.encode(p) for p in prompts]
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12)
    assert [c.text for c in as_ids.choices] == expected
    assert as_ids.usage is not None and as_ids.usage.prompt_tokens == sum(len(i) for i in ids)

    seeded = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, n=2, seed=5)
    assert [c.index for c in seeded.choices] == [0, 1, 2, 3]
    generated = 0
    for i, prompt in enumerate(prompts):
        for j in range(2):
            want, _ = replay_generation(vocab, vocab.encode(prompt), 12, seed=5 + j)
            assert seeded.choices[i * 2 + j].text == vocab.decode(want)
            generated += len(want)
    assert seeded.usage is not None
    assert seeded.usage.completion_tokens == generated
    assert seeded.usage.prompt_tokens == sum(len(i) for i in ids)  # each prompt once, not n times


def test_streamed_n_choices_interleave_and_all_finish(client: OpenAI, vocab: Vocabulary) -> None:
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, n=3,
                                           seed=1, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == {0, 1, 2}
    for j in range(3):
        want = vocab.decode(replay_generation(vocab, vocab.encode(PROMPT), 20, seed=1 + j)[0])
        assert texts[j] == want


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_tokens(client: OpenAI, vocab: Vocabulary, include: bool,
                                     stream: bool) -> None:
    ids, _ = peer_generation(vocab, PROMPT, 60)
    full = vocab.decode(ids)
    # A stop string that starts inside one token and ends inside a later one.
    cut = len(vocab.decode(ids[:20])) - 2
    stop = full[cut:cut + 7]
    assert len(vocab.encode(stop, add_special_tokens=False)) > 1
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "stop": [stop],
                              "extra_body": {"include_stop_str_in_output": include}}
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        answer = client.completions.create(**kwargs)
        text, finish = answer.choices[0].text, answer.choices[0].finish_reason
    at = full.find(stop)
    assert text == full[:at] + (stop if include else "")
    assert finish == "stop"


def test_stop_token_ids_and_ignore_eos(client: OpenAI, vocab: Vocabulary) -> None:
    ids, finish = peer_generation(vocab, PROMPT, 300)
    assert finish == "stop"  # the replayed document ends with EOS
    longer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=len(ids) + 5,
                                       extra_body={"ignore_eos": True})
    assert longer.choices[0].finish_reason == "length"
    assert longer.usage is not None and longer.usage.completion_tokens == len(ids) + 5
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=50,
                                        extra_body={"stop_token_ids": [ids[3]]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == vocab.decode(ids[:ids.index(ids[3])])


async def test_tokenize_detokenize_version_models_openapi(stack: Stack, vocab: Vocabulary) -> None:
    async with aiohttp.ClientSession(base_url=stack.base_url) as http:
        async with http.post("/tokenize", json={"model": MODEL, "prompt": "Hello 世界"}) as r:
            body = await r.json()
            assert body["tokens"] == vocab.encode("Hello 世界")
            assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
        async with http.post("/tokenize", json={"messages": CHAT}) as r:
            assert (await r.json())["tokens"] == chat_prompt_ids(vocab)
        async with http.post("/detokenize", json={"tokens": vocab.encode("Hello 世界")}) as r:
            assert await r.json() == {"prompt": "Hello 世界"}
        async with http.post("/detokenize", json={"tokens": [10**9]}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "tokens"
        async with http.get("/version") as r:
            assert (await r.json())["version"]
        async with http.get("/openapi.json") as r:
            spec = await r.json()
    assert spec["openapi"].startswith("3.")
    schemas = spec["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    assert completion["additionalProperties"] is False
    assert {"model", "prompt", "max_tokens", "stop", "n"} <= set(completion["properties"])
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    ref = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert ref["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert json.dumps(spec)  # serialisable


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages"),
    ({"model": MODEL, "messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"model": MODEL, "messages": CHAT, "top_logprobs": 1}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": MODEL, "messages": CHAT, "response_format": {"type": "xml"}}, 400,
     "response_format"),
    ({"model": "other", "messages": CHAT}, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 10}] * 2,
      "add_generation_prompt": True, "continue_final_message": True}, 400, None),
])
async def test_chat_client_errors(stack: Stack, body: dict[str, Any], status: int,
                                  param: str | None) -> None:
    async with aiohttp.ClientSession() as http, http.post(
            f"{stack.base_url}/v1/chat/completions", json=body) as r:
        payload = await r.json()
    assert r.status == status, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert payload["error"]["param"] == param


def test_sdk_raises_typed_errors_for_chat(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(model=MODEL, messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"minimum": 1}}})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
