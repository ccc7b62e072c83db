"""Nothing a client sends produces a 5xx or takes the worker down (shm stack)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.stack import MODEL, Stack

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                      children, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n", "stream",
          "stream_options", "ignore_eos", "logprobs", "user", "chat_template_kwargs",
          "continue_final_message", "add_generation_prompt", "include_stop_str_in_output"]
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(
    lambda d: {"model": MODEL, **d} if "model" not in d else d)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
     "content": st.text(max_size=30) | st.none()}), max_size=4)



async def send(stack: Stack, path: str, body: Any) -> int:
    async with aiohttp.ClientSession() as http, http.post(
            f"{stack.base_url}{path}", data=json.dumps(body),
            headers={"Content-Type": "application/json"}) as resp:
        await resp.read()
        return resp.status


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize",
                                          "/detokenize"]))
def test_random_bodies_never_5xx(stack: Stack, body: dict[str, Any], path: str) -> None:
    assert asyncio.run(send(stack, path, body)) < 500


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=messages, extra=st.dictionaries(st.sampled_from(["max_tokens", "stop", "n"]),
                                            st.integers(0, 3) | st.text(max_size=3), max_size=2))
def test_random_conversations_never_5xx(stack: Stack, msgs: list[dict[str, Any]],
                                        extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "messages": msgs, "max_tokens": 4} | extra
    assert asyncio.run(send(stack, "/v1/chat/completions", body)) < 500


def test_still_serving_after_the_fuzzing(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "still there?", "max_tokens": 3}
    assert asyncio.run(send(stack, "/v1/completions", body)) == 200
