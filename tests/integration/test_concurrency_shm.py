"""Many clients at once through one daemon process (shm): no head-of-line blocking.

Asserts on completion and ordering, never on wall-clock thresholds. (A huge
prompt tokenizing beside a short request is tested in memory:
``tests/http/test_generation.py``.)
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.integration.lifecycle import channel_stats, eventually, outcome, read_events
from tests.integration.scenarios import load_vocab, peer_generation
from tests.stack import MODEL, Stack

STREAMS = 1000
PROMPT = "Many at once."


# A small per-request buffer, so that the stalled client below is cut off soon.
STACK = {"serve_args": ("--stream-buffer-records", "64")}


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


async def test_a_thousand_streams_and_a_stalled_client(own_stack: Stack) -> None:
    stack = own_stack
    vocab = load_vocab()
    ids, finish = peer_generation(vocab, PROMPT, 24)
    expected = vocab.decode(ids)
    before: int = (await channel_stats(stack.peer_address()))["cancelled"]
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
        cancelled: int = (await channel_stats(stack.peer_address()))["cancelled"]
        return cancelled > before

    await eventually(cut_off, "the stalled client's generation was never cancelled")
    stalled.close()
    await stalled.wait_closed()
