"""The CUDA peer end to end: daemon (shm transport) -> rings in host memory mapped into the
GPU -> the persistent kernel, and back. Run on a GPU machine (docs/gpu.md).

These tests share one stack for the module; test_cuda_peer_lifecycle.py starts its own,
one at a time: two processes with persistent kernels on one GPU time-slice it, and a
heartbeat can then stall past the daemon's timeout (docs/gpu.md, "One peer per GPU")."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from dpu_frontend.config import PeerAddress, ServeConfig
from dpu_frontend.control.stats import peer_stats
from dpu_frontend.engine.session import PeerSession
from dpu_frontend.ring import SamplingParams
from tests.integration.scenarios import (
    check_chat_stream_sdk,
    check_stream_equals_full_and_decode,
)
from tests.raw_ring import poll_until_final, write_constrained, write_unknown_kind
from tests.stack import MODEL, Stack, running_stack

pytestmark = pytest.mark.gpu

TIMEOUT = 300  # the first start builds the kernel with nvcc
GPU_ARGS = ("--max-sequences", "1024", "--resp-slots", "2048")
#: The shared stack has a spare channel for the raw client of the corrupt-record test.
SHARED_ARGS = (*GPU_ARGS, "--channels", "2")


@pytest.fixture(scope="module")
def gpu_stack() -> Iterator[Stack]:
    with running_stack("shm", timeout=TIMEOUT, peer_command="gpu-peer",
                       peer_args=SHARED_ARGS) as stack:
        yield stack


async def channel(stack: Stack) -> dict[str, Any]:
    return (await peer_stats(stack.peer_address()))[0]


# -- the SDK scenarios that run against the Python peer, unchanged ---------------------


async def test_sdk_completions_stream_equals_full_equals_the_reference(gpu_stack: Stack) -> None:
    await check_stream_equals_full_and_decode(gpu_stack)


async def test_sdk_chat_stream(gpu_stack: Stack) -> None:
    await check_chat_stream_sdk(gpu_stack)


async def test_a_thousand_concurrent_streams(gpu_stack: Stack) -> None:
    streams = 1000

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str]:
        body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 32, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"{gpu_stack.base_url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = [raw.decode().strip().removeprefix("data: ")
                      async for raw in resp.content if raw.strip()]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2]
                  if json.loads(e)["choices"]]
        return usage["completion_tokens"], finish[-1]

    connector = aiohttp.TCPConnector(limit=streams)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        results = await asyncio.gather(*(one(session, i) for i in range(streams)))
    assert results == [(32, "length")] * streams


async def test_a_corrupt_record_is_counted_and_skipped(gpu_stack: Stack) -> None:
    """A raw client on a second channel writes a record of an unknown kind, one flagged
    CONSTRAINED (the CUDA peer's layout offers no automata), then a valid one: the kernel
    counts the first two, serves the third, and goes on serving."""
    address = gpu_stack.peer_address()
    config = ServeConfig(peers=(address,), transport="shm")
    session = await PeerSession.connect(config, address)
    try:
        before = (await peer_stats(address))[session.channel_index]
        await write_unknown_kind(session, 1, [1, 2, 3])
        await write_constrained(session, 3, [7, 8])
        session.channel.submit(2, [4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
        records = await poll_until_final(session, 2)
        assert [t for r in records if r.request_id == 2 for t in r.tokens]
        assert not [r for r in records if r.request_id == 3]
        after = (await peer_stats(address))[session.channel_index]
        assert after["bad_records"] == before["bad_records"] + 2
        assert after["records"] == before["records"] + 3
    finally:
        await session.close()
    await check_stream_equals_full_and_decode(gpu_stack)  # the kernel still serves


def test_peer_stats_cli_reports_kernel_counters(gpu_stack: Stack) -> None:
    stats = asyncio.run(peer_stats(PeerAddress.parse(gpu_stack.peers[0].address)))
    assert {"records", "bad_records", "ring_full_waits", "epoch", "kernel_steps"} <= set(stats[0])


