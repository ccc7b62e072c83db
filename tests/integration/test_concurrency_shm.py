"""Many clients at once through one daemon process (shm): no head-of-line blocking.

Asserts on completion and ordering, never on wall-clock thresholds.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator

import aiohttp
import pytest

from tests.integration.lifecycle import channel_stats, eventually, outcome, read_events
from tests.integration.scenarios import load_vocab, peer_generation
from tests.stack import MODEL, Stack, running_stack

STREAMS = 1000
PROMPT = "Many at once."


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    # A small per-stream buffer, so that the stalled client below is cut off soon.
    with running_stack("shm", timeout=60, serve_args=("--stream-buffer-records", "64")) as s:
        yield s


async def stalled_client(stack: Stack) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client that asks for a long stream and then never reads a byte."""
    host, port = stack.base_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"model": MODEL, "prompt": "never read", "max_tokens": 100_000,
                       "ignore_eos": True, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    return reader, writer


async def test_a_thousand_streams_and_a_stalled_client(stack: Stack) -> None:
    vocab = load_vocab()
    ids, finish = peer_generation(vocab, PROMPT, 24)
    expected = vocab.decode(ids)
    before = await channel_stats(stack.peer_address())
    _, stalled = await stalled_client(stack)

    async def one(http: aiohttp.ClientSession) -> tuple[str, str]:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "stream": True}
        async with http.post(f"{stack.base_url}/v1/completions", json=body) as resp:
            events = await read_events(resp)
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        return outcome(events), text

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:
        results = await asyncio.gather(*(one(http) for _ in range(STREAMS)))
    assert results == [("finished", expected)] * STREAMS
    assert finish == "length"

    # The stalled client did not hold anyone up, and it is not buffered without
    # bound either: a full buffer cut it off and cancelled its generation.
    async def cut_off() -> bool:
        return (await channel_stats(stack.peer_address()))["cancelled"] > before["cancelled"]

    await eventually(cut_off, "the stalled client's generation was never cancelled")
    stalled.close()
    await stalled.wait_closed()


async def test_a_huge_prompt_does_not_block_the_others(stack: Stack) -> None:
    """Tokenizing a ~300K-token prompt runs off the event loop: a short request sent
    after it completes while the big one is still tokenizing (it then gets its 400)."""
    huge = "token " * 300_000
    order: list[str] = []
    async with aiohttp.ClientSession() as http:
        async def big() -> None:
            body = io.BytesIO(json.dumps({"model": MODEL, "prompt": huge, "max_tokens": 1}).encode())
            async with http.post(f"{stack.base_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400  # longer than the context, counted not guessed
                assert (await r.json())["error"]["code"] == "context_length_exceeded"
            order.append("big")

        async def small() -> None:
            await asyncio.sleep(0.05)  # after the big one is in
            body = {"model": MODEL, "prompt": "quick", "max_tokens": 2, "stream": True}
            async with http.post(f"{stack.base_url}/v1/completions", json=body) as r:
                assert outcome(await read_events(r)) == "finished"
            order.append("small")

        await asyncio.gather(big(), small())
    assert order == ["small", "big"]
