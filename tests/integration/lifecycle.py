"""Request-lifecycle scenarios shared by the shm (native) and verbs (soft-RoCE) tests.

Each asserts on states and orderings (counters, outcomes, which request ended
first), never on wall-clock thresholds; waits are bounded polls that fail
with a message when the state never comes.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from dpu_frontend.config import PeerAddress
from dpu_frontend.control.stats import peer_stats
from tests.stack import MODEL, Stack

LONG = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 100_000,
        "ignore_eos": True, "stream": True}


async def eventually(check: Callable[[], Awaitable[bool]], what: str, limit: float = 60) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``limit`` seconds."""
    try:
        async with asyncio.timeout(limit):
            while not await check():  # noqa: ASYNC110 - the state is in another process
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"{what} (waited {limit} s)") from None


async def channel_stats(address: PeerAddress) -> dict[str, Any]:
    return (await peer_stats(address))[0]


async def read_events(resp: aiohttp.ClientResponse) -> list[str]:
    """Every ``data:`` payload of a streamed answer, through ``[DONE]``."""
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line:
            events.append(line.removeprefix("data: "))
    return events


def outcome(events: list[str]) -> str:
    """``finished``, ``error`` or ``truncated`` (no [DONE]: a stream silently dropped)."""
    if not events or events[-1] != "[DONE]":
        return "truncated"
    last = json.loads(events[-2]) if len(events) > 1 else {}
    if "error" in last:
        return "error"
    finish = last.get("choices", [{}])[0].get("finish_reason") if last.get("choices") else None
    return "finished" if finish else "truncated"


async def check_disconnect_cancels_on_the_gpu(stack: Stack) -> None:
    """A client that goes away: the peer stops generating for it and its slots are reused."""
    address = stack.peer_address()
    before = await channel_stats(address)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{stack.base_url}/v1/completions", json=LONG)
        assert resp.status == 200
        async for raw in resp.content:
            if raw.startswith(b"data: {"):
                break  # one chunk: generation is under way on the peer
        active = (await channel_stats(address))["active"]
        assert len(active) == 1
        resp.close()  # the client disconnects mid-stream

    async def cancelled() -> bool:
        stats = await channel_stats(address)
        return stats["cancelled"] == before["cancelled"] + 1 and not stats["active"]

    await eventually(cancelled, "the peer never received the cancel record")
    stats = await channel_stats(address)
    # Not active on the peer any more: its engine generates nothing further for it.
    assert active[0] in stats["cancelled_ids"] and active[0] not in stats["active"]

    # Slots and arena come back: more requests than the ring has slots all complete.
    slots = stats["request_slots"]
    async with aiohttp.ClientSession() as http:
        for i in range(slots + 2):
            body = {"model": MODEL, "prompt": f"again {i}", "max_tokens": 2}
            async with http.post(f"{stack.base_url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
    assert (await channel_stats(address))["request_records"] > slots


async def check_fault_and_reconnect(stack: Stack, streams: int = 6) -> None:
    """kill -9 the peer under open streams: each ends with exactly one error event and
    one [DONE], nothing lost, nothing twice; the restarted peer is reconnected and
    serves again."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        responses = [await http.post(f"{stack.base_url}/v1/completions",
                                     json=LONG | {"prompt": f"stream {i}"})
                     for i in range(streams)]
        assert all(r.status == 200 for r in responses)
        first_chunks = [await r.content.readline() for r in responses]
        assert all(c.startswith(b"data: {") for c in first_chunks)
        stack.peers[0].kill()
        killed = await asyncio.gather(*(read_events(r) for r in responses))
        assert [endings(events) for events in killed] == [["error", "[DONE]"]] * streams
        for events in killed:
            assert json.loads(events[-2])["error"]["code"] == 503, events[-2]
        async with http.post(f"{stack.base_url}/v1/completions",
                             json={"model": MODEL, "prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 503 and "Retry-After" in r.headers
        stack.peers[0].restart()

        async def healthy() -> bool:
            async with http.get(f"{stack.base_url}/health") as h:
                return h.status == 200

        await eventually(healthy, "the daemon never reconnected to the restarted peer")
        async with http.get(f"{stack.base_url}/health") as h:
            assert (await h.json())["peers"][0]["reconnects"] == 1
        after = []
        for i in range(3):
            body = {"model": MODEL, "prompt": f"after {i}", "max_tokens": 5, "stream": True}
            async with http.post(f"{stack.base_url}/v1/completions", json=body) as r:
                after.append(endings(await read_events(r)))
    assert after == [["finish_reason", "[DONE]"]] * 3


def endings(events: list[str]) -> list[str]:
    """Every event that ends a stream, in order: ``error``, ``finish_reason`` (of choice 0)
    and ``[DONE]``. A whole stream has exactly one of the first two, then ``[DONE]``."""
    out = []
    for event in events:
        if event == "[DONE]":
            out.append(event)
            continue
        payload = json.loads(event)
        if "error" in payload:
            out.append("error")
        elif any(c.get("finish_reason") for c in payload.get("choices", [])):
            out.append("finish_reason")
    return out


async def check_two_peers(stack: Stack, requests: int = 12) -> None:
    """Requests spread over both peers, even one after another (equal loads take turns);
    with one killed, the other serves alone."""
    body = {"model": MODEL, "prompt": "spread", "max_tokens": 20, "stream": True}
    async with aiohttp.ClientSession() as http:
        async def one(i: int) -> str:
            async with http.post(f"{stack.base_url}/v1/completions",
                                 json=body | {"prompt": f"spread {i}"}) as r:
                return outcome(await read_events(r)) if r.status == 200 else str(r.status)

        assert [await one(i) for i in range(requests)] == ["finished"] * requests
        admitted = [(await channel_stats(stack.peer_address(i)))["admitted"] for i in (0, 1)]
        assert admitted == [requests // 2, requests - requests // 2], admitted
        stack.peers[0].kill()

        async def one_down() -> bool:
            async with http.get(f"{stack.base_url}/health") as h:
                return [p["up"] for p in (await h.json())["peers"]] == [False, True]

        await eventually(one_down, "the daemon never noticed the dead peer")
        assert await asyncio.gather(*(one(i) for i in range(requests))) == ["finished"] * requests
        survivor = (await channel_stats(stack.peer_address(1)))["admitted"]
        assert survivor == admitted[1] + requests


async def check_drain(stack: Stack, streams: int = 3) -> None:
    """SIGTERM: /health says not ready, open streams finish, the daemon exits 0."""
    body = {"model": MODEL, "prompt": "drain", "max_tokens": 25, "stream": True}
    # A load balancer's probe: one keep-alive connection, opened before the drain
    # (the daemon stops accepting new connections at once).
    probe = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
    async with probe, aiohttp.ClientSession() as http:
        async with probe.get(f"{stack.base_url}/health") as h:
            assert h.status == 200
        responses = [await http.post(f"{stack.base_url}/v1/completions",
                                     json=body | {"prompt": f"drain {i}"})
                     for i in range(streams)]
        stack.daemon.send_signal(signal.SIGTERM)

        async def not_ready() -> bool:
            async with probe.get(f"{stack.base_url}/health") as h:
                return h.status == 503

        await eventually(not_ready, "/health still ready while draining")
        results = await asyncio.gather(*(read_events(r) for r in responses))
    assert [outcome(events) for events in results] == ["finished"] * streams
    assert stack.daemon.wait(timeout=60) == 0
