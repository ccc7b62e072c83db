"""Client mistakes get a 4xx with an OpenAI error body, through a real socket (shm stack)."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from tests.stack import MODEL, Stack


async def post(stack: Stack, body: Any, *, raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        kwargs: dict[str, Any] = {"data": raw, "headers": {"Content-Type": "application/json"}} \
            if raw is not None else {"json": body}
        async with session.post(f"{stack.base_url}/v1/completions", **kwargs) as resp:
            return resp.status, await resp.json()


def assert_error(status: int, body: Any, expected: int, param: str | None = None) -> None:
    assert status == expected, body
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": "hi"}, 400, "model"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": 7}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, -2]}, 400, "prompt"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2**32}, 400, "max_tokens"),  # past u32
    ({"model": MODEL, "prompt": "hi", "temperature": 3}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "stop": ""}, 400, None),
    ({"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
    ({"model": MODEL, "prompt": [[1], "x"]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": list(range(9))}, 400, "stop_token_ids"),
    ([1, 2], 400, None),
    ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
])
async def test_bad_requests(stack: Stack, body: Any, status: int, param: str | None) -> None:
    got, payload = await post(stack, body)
    assert_error(got, payload, status, param)


async def test_malformed_json(stack: Stack) -> None:
    status, body = await post(stack, None, raw=b'{"model": ')
    assert_error(status, body, 400)


async def test_unknown_route_and_method_are_openai_errors(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{stack.base_url}/v1/nothing") as resp:
            assert_error(resp.status, await resp.json(), 404)
        async with session.get(f"{stack.base_url}/v1/completions") as resp:
            assert_error(resp.status, await resp.json(), 405)


async def test_prompt_as_token_ids(stack: Stack) -> None:
    status, body = await post(stack, {"model": MODEL, "prompt": [9707, 11, 1879], "max_tokens": 3})
    assert status == 200 and body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3,
                                               "total_tokens": 6}


def test_sdk_sees_typed_errors(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-9", prompt="hi")
        with pytest.raises(openai.BadRequestError, match="context length"):
            client.completions.create(model=MODEL, prompt=[5] * 131_072)  # fills it
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    finally:
        client.close()


async def test_health(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session, session.get(f"{stack.base_url}/health") as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "ok"
