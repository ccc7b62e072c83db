"""The reference peer in GPU-like steps (``--step-ms``, ``--batch``) behind the daemon:
each step one token for each running sequence, a burst of one-token records, and the
batch cap making the rest wait, over a real socket with the openai SDK."""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI

from dpu_frontend.control.stats import peer_stats
from tests.stack import MODEL, Stack

STACK = {"peer_args": ("--step-ms", "5", "--batch", "2")}


async def test_streams_get_one_token_a_record_and_wait_for_the_batch(own_stack: Stack) -> None:
    stack = own_stack
    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[str | None, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"count {i}", max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finish, tokens = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    try:
        before = (await peer_stats(stack.peer_address()))[0]
        results = await asyncio.gather(*(one(i) for i in range(5)))
    finally:
        await client.close()
    assert results == [("length", 6)] * 5
    after = (await peer_stats(stack.peer_address()))[0]
    tokens = after["tokens"] - before["tokens"]
    assert tokens == 30
    # One token a record: the last token's record carries the finish.
    assert after["published"] - before["published"] == 30
    assert after["completed"] - before["completed"] == 5
