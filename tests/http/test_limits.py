"""Connection limits and slowloris, through ``BoundedRunner`` on a real loopback socket.

The app is a one-route stand-in: what is tested is the server around it.
Every wait is bounded; the slow client's sleeps only pace it, the outcome is
what the server does.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from aiohttp import web

from dpu_frontend.daemon import FILES_MARGIN, connection_limit
from dpu_frontend.errors import StartupError
from dpu_frontend.http.app import BoundedRunner
from dpu_frontend.metrics import Metrics

REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@dataclass
class Served:
    port: int
    metrics: Metrics

    async def connect(self) -> Streams:
        return await asyncio.open_connection("127.0.0.1", self.port)

    def refused(self) -> float:
        return self.metrics.registry.get_sample_value(
            "dpu_frontend_refused_connections_total") or 0.0


Serve = Callable[..., Awaitable[Served]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``await serve(max_connections=..., idle_timeout_s=...)``"""
    runners: list[BoundedRunner] = []

    async def start(max_connections: int = 100, idle_timeout_s: float = 10.0) -> Served:
        app = web.Application()
        app.router.add_get("/", ok)
        metrics = Metrics()
        runner = BoundedRunner(app, max_connections=max_connections,
                               idle_timeout_s=idle_timeout_s, metrics=metrics)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return Served(runner.addresses[0][1], metrics)

    yield start
    for runner in runners:
        await runner.cleanup()


async def answer(streams: Streams) -> bytes:
    """One request on a kept-alive connection: its status line."""
    reader, writer = streams
    writer.write(REQUEST)
    status = await reader.readline()
    await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(2)  # "ok"
    return status


async def test_connections_past_the_limit_get_503_and_are_closed(serve: Serve) -> None:
    served = await serve(max_connections=2)
    held = [await served.connect(), await served.connect()]
    async with asyncio.timeout(5):
        for streams in held:  # both accepted, counted, and kept alive
            assert await answer(streams) == b"HTTP/1.1 200 OK\r\n"
        reader, writer = await served.connect()
        refused = await reader.read()  # until the server closes it
    assert refused.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"Retry-After: 1\r\n" in refused
    assert b"max_connections" in refused
    assert served.refused() == 1
    writer.close()
    async with asyncio.timeout(5):  # the held ones are unaffected
        assert await answer(held[0]) == b"HTTP/1.1 200 OK\r\n"
    for _, held_writer in held:
        held_writer.close()


async def test_a_slowloris_client_is_cut_off(serve: Serve) -> None:
    served = await serve(idle_timeout_s=0.3)
    reader, writer = await served.connect()

    async def drip() -> None:
        """Headers that never end, a byte every 50 ms: well under the limit per byte."""
        writer.write(b"GET / HTTP/1.1\r\nHost: test\r\n")
        for _ in range(200):
            writer.write(b"X")
            await asyncio.sleep(0.05)

    dripping = asyncio.create_task(drip())
    try:
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed, with no answer
        assert not dripping.done()  # while the client was still sending its headers
    finally:
        dripping.cancel()
        writer.close()


async def test_a_prompt_client_is_served_within_the_idle_timeout(serve: Serve) -> None:
    served = await serve(idle_timeout_s=0.3)
    streams = await served.connect()
    async with asyncio.timeout(5):
        assert await answer(streams) == b"HTTP/1.1 200 OK\r\n"
        # Then idle past the timeout: closed.
        assert await streams[0].read() == b""
    streams[1].close()


def test_max_connections_is_checked_against_the_open_files_limit() -> None:
    with pytest.raises(StartupError, match=re.escape(
            f"the open-files limit is 1024, but max_connections = 1000 needs "
            f"{1000 + FILES_MARGIN}")):
        connection_limit(1000, 1024)
    assert connection_limit(1000, 1000 + FILES_MARGIN) == 1000
    assert connection_limit(0, 4096) == 4096 - FILES_MARGIN  # 0: what the limit allows
    with pytest.raises(StartupError, match="the open-files limit is 100"):
        connection_limit(0, 100)
