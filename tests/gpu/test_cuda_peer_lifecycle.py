"""The CUDA peer's lifecycle, each test with a stack of its own (never two at once)."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from tests.gpu.test_cuda_peer import GPU_ARGS, TIMEOUT, channel
from tests.integration.scenarios import (
    check_peer_killed_mid_stream,
    check_stream_equals_full_and_decode,
    raw_sse,
)
from tests.stack import MODEL, Stack, running_stack

pytestmark = pytest.mark.gpu


# -- byte-identical streams -------------------------------------------------------------

SCRIPT: list[dict[str, Any]] = [
    {"prompt": "Tell me about the request ring.", "max_tokens": 60},
    {"prompt": "Hello", "max_tokens": 200},
    {"prompt": "Hello", "max_tokens": 200, "seed": 7},
    {"prompt": "Hello", "max_tokens": 300, "ignore_eos": True},
    {"prompt": "Stop early, please", "max_tokens": 100, "stop_token_ids": [13, 11]},
    {"prompt": "Two of them", "max_tokens": 40, "n": 2, "seed": 3},
    {"prompt": [9707, 1879, 0, 151643, 42], "max_tokens": 17},
    {"prompt": "The usage counts", "max_tokens": 25, "stream_options": {"include_usage": True}},
]


def normalized(events: list[str]) -> list[str]:
    """SSE payloads with the per-request id and timestamp taken out, grouped by choice
    (the events of n > 1 choices interleave as their records happen to arrive)."""
    out = [re.sub(r'"(id|created)": ("[^"]*"|\d+)', r'"\1": _', event) for event in events]
    index = [int(m.group(1)) if (m := re.search(r'"index": (\d+)', e)) else 1 << 30
             for e in out]
    return [e for _, e in sorted(zip(index, out, strict=True), key=lambda pair: pair[0])]


async def run_script(stack: Stack) -> list[list[str]]:
    return [normalized(await raw_sse(stack, {"model": MODEL, "stream": True} | body))
            for body in SCRIPT]


@pytest.mark.parametrize("mode", ["replay", "echo"])
@pytest.mark.parametrize("per_step", ["1", "8"])
async def test_python_and_cuda_peers_give_byte_identical_streams(mode: str, per_step: str) -> None:
    args = ("--tokens-per-step", per_step)
    with running_stack("shm", mode=mode, timeout=TIMEOUT, peer_args=args) as python:
        expected = await run_script(python)
    with running_stack("shm", mode=mode, timeout=TIMEOUT, peer_command="gpu-peer",
                       peer_args=(*GPU_ARGS, *args)) as cuda:
        got = await run_script(cuda)
    for body, want, have in zip(SCRIPT, expected, got, strict=True):
        assert have == want, body
    # Every request streamed to its end: a finish reason, then [DONE].
    assert all(e[-1] == "[DONE]" and any('"finish_reason": "' in x for x in e) for e in expected)


async def test_cancel_on_disconnect_reaches_the_kernel() -> None:
    """A client that goes away: the kernel's counters show the cancel and the sequence retired."""
    with running_stack("shm", timeout=TIMEOUT, peer_command="gpu-peer",
                       peer_args=(*GPU_ARGS, "--step-us", "2000")) as stack:
        before = await channel(stack)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 100000, "ignore_eos": True,
                "stream": True}
        async with aiohttp.ClientSession() as session, session.post(
                f"{stack.base_url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for raw in resp.content:
                if raw.strip():
                    break  # the first event: then the client is gone
        for _ in range(200):
            stats = await channel(stack)
            if stats["cancelled"] == before["cancelled"] + 1:
                break
            await asyncio.sleep(0.05)
        assert stats["cancelled"] == before["cancelled"] + 1
        # Completed: the kernel retired the sequence, so it generates nothing more for it
        # (no sleep-and-compare of the token counter).
        assert stats["completed"] == before["completed"] + 1


async def test_launcher_killed_and_restarted_gives_a_new_epoch(
        healthy: Callable[[Stack], Awaitable[None]]) -> None:
    with running_stack("shm", timeout=TIMEOUT, peer_command="gpu-peer",
                       peer_args=GPU_ARGS) as stack:
        first = await channel(stack)
        # The kernel is not paced: a whole context's worth of tokens (the bundled
        # tokenizer's 131,072) keeps both requests open past the kill.
        await check_peer_killed_mid_stream(stack, max_tokens=130_000)
        stack.peers[0].restart()
        await healthy(stack)
        second = await channel(stack)
        assert second["attached"] and second["epoch"] != first["epoch"]
        await check_stream_equals_full_and_decode(stack)


async def test_a_long_prefill_does_not_fail_the_link() -> None:
    """A 32K-token prompt whose (simulated) prefill takes 3.2 s, three times the peer
    timeout: the heartbeat warp keeps beating, so the daemon never fails the link."""
    with running_stack("shm", timeout=TIMEOUT, peer_command="gpu-peer",
                       peer_args=(*GPU_ARGS, "--prefill-us-per-token", "100")) as stack:
        prompt = [(i * 7919) % 150000 for i in range(32000)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
        started = time.monotonic()
        async with aiohttp.ClientSession() as session, session.post(
                f"{stack.base_url}/v1/completions", json=body) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
        assert time.monotonic() - started > 3.0  # the prefill really held the step
        assert answer["choices"][0]["finish_reason"] == "length"
        stats = await channel(stack)
        assert stats["attachments"] == 1, "the daemon failed the link and reconnected"
        assert stats["kernel_heartbeats"] > 0


def test_sigterm_stops_the_kernel() -> None:
    with running_stack("shm", timeout=TIMEOUT, peer_command="gpu-peer",
                       peer_args=GPU_ARGS) as stack:
        proc = stack.peer
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
