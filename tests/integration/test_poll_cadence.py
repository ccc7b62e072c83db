"""The poll loop's cadence (``engine/cadence.py``) against the reference peer in
GPU-like steps of 20 ms, over a real socket with the openai SDK: the loop learns the
steps and skips the polls between them, and every token still arrives."""

from __future__ import annotations

import asyncio

import aiohttp
from openai import AsyncOpenAI

from benchmarks.light_load import cadence_counts
from tests.stack import MODEL, Stack

STACK = {"peer_args": ("--step-ms", "20", "--batch", "8")}


async def test_the_poll_loop_learns_the_steps_and_loses_no_token(own_stack: Stack) -> None:
    """Two streams of 60 tokens, a token a 20 ms step, each beside its unstreamed twin:
    the streamed text equals the full answer, the loop skipped polls between the steps
    (``poll_cadence``, on by default), and /metrics counts the skips and late bursts."""
    stack = own_stack
    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> str | None:
        kwargs = {"model": MODEL, "prompt": f"steady {i}", "max_tokens": 60,
                  "extra_body": {"ignore_eos": True}}
        full = await client.completions.create(**kwargs)  # type: ignore[call-overload]
        stream = await client.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert text == full.choices[0].text
        return finish

    async with aiohttp.ClientSession() as http:
        before = await cadence_counts(http, stack.base_url)
    try:
        finishes = await asyncio.gather(*(one(i) for i in range(2)))
    finally:
        await client.close()
    assert finishes == ["length"] * 2
    async with aiohttp.ClientSession() as http:
        after = await cadence_counts(http, stack.base_url)
    assert set(after) == {"skip", "late"}
    skips, late = (after[k] - before[k] for k in ("skip", "late"))
    assert skips > 0 and late <= skips
    print(f"cadence: {skips:.0f} skips, {late:.0f} late bursts over 2 x 2 x 60 steps")
