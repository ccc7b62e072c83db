"""A connect to a GPU peer that is cancelled (SIGTERM's shutdown) ends at once, at
whatever point it is, even when the peer is alive and silent (stopped, or stuck).

Python 3.11's ``asyncio.wait_for`` returns its awaitable's result when a cancellation
lands as that awaitable completes, and the cancellation is lost: a daemon told to stop
as its TCP connection opened went on to wait for the handshake, for the whole
``connect_timeout_s`` (a CI failure of tests/integration/test_workers.py). The package
uses ``asyncio.timeout`` instead, which does not drop a cancellation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import dpu_frontend
from dpu_frontend.config import PeerAddress, ServeConfig
from dpu_frontend.engine.session import PeerSession


@dataclasses.dataclass
class SilentPeer:
    """Accepts control connections and never answers; ``closed`` is set once the
    daemon closes one."""

    address: PeerAddress
    closed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


@pytest.fixture
async def silent() -> AsyncIterator[SilentPeer]:
    peer: SilentPeer | None = None

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the daemon closes its end
        assert peer is not None
        peer.closed.set()
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    peer = SilentPeer(PeerAddress("127.0.0.1", server.sockets[0].getsockname()[1]))
    try:
        yield peer
    finally:
        server.close()


def config(address: PeerAddress) -> ServeConfig:
    return ServeConfig(peers=(address,), transport="shm", connect_timeout_s=300)


async def cancelled_at_once(connect: asyncio.Task[Any]) -> None:
    # A lost cancellation waits for connect_timeout_s.
    await asyncio.wait({connect}, timeout=5)
    assert connect.cancelled()


async def closed_by_the_daemon(peer: SilentPeer) -> None:
    async with asyncio.timeout(5):
        await peer.closed.wait()


async def test_a_connect_cancelled_as_its_connection_opens_ends_at_once(
        silent: SilentPeer, monkeypatch: pytest.MonkeyPatch) -> None:
    opened = asyncio.open_connection
    connect: asyncio.Task[PeerSession] | None = None

    async def opened_then_cancelled(*args: Any, **kwargs: Any) -> Any:
        streams = await opened(*args, **kwargs)
        assert connect is not None
        connect.cancel()  # lands as the connection completes
        return streams

    monkeypatch.setattr(asyncio, "open_connection", opened_then_cancelled)
    connect = asyncio.create_task(PeerSession.connect(config(silent.address), silent.address))
    await cancelled_at_once(connect)
    await closed_by_the_daemon(silent)


async def test_a_connect_cancelled_in_its_handshake_ends_at_once(silent: SilentPeer) -> None:
    connect = asyncio.create_task(PeerSession.connect(config(silent.address), silent.address))
    await asyncio.sleep(0.2)  # connected, the hello sent, waiting for the answer
    assert not connect.done()
    connect.cancel()
    await cancelled_at_once(connect)
    await closed_by_the_daemon(silent)


def test_the_package_does_not_use_asyncio_wait_for() -> None:
    package = Path(dpu_frontend.__file__).parent
    users = [str(path.relative_to(package)) for path in sorted(package.rglob("*.py"))
             if re.search(r"\bwait_for\(", path.read_text())]
    assert users == [], "use asyncio.timeout: 3.11's wait_for can lose a cancellation"
