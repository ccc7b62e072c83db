"""One connected session with one GPU peer: the handshake, and what it leaves to tear down.

``PeerSession.connect`` runs the bootstrap of docs/protocol.md section 7:
the control connection, hello/welcome, the transport attached to the granted
region, then the layout record read through the data path and checked
against the welcome. ``close`` releases everything in reverse order.

``PeerLink`` sees a session only through ``Session``; tests hand it sessions
that run the GPU half in the same process (``tests/engine/loopback.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from dpu_frontend import __version__
from dpu_frontend.config import PeerAddress, ServeConfig
from dpu_frontend.control import auth, messages
from dpu_frontend.errors import LayoutMismatch, PeerError, StartupError
from dpu_frontend.ring import DpuChannel, Layout, ReadOp
from dpu_frontend.ring.layout import (
    CTRL_SIZE,
    HEADER_SIZE,
    ChannelLayout,
    decode_header_size,
    decode_layout,
)
from dpu_frontend.transport.base import Transport
from dpu_frontend.transport.factory import open_transport

log = logging.getLogger("dpu_frontend.engine")


class Session(Protocol):
    """What a link needs of a connected session."""

    @property
    def channel(self) -> DpuChannel: ...

    @property
    def transport(self) -> Transport: ...

    async def ended(self) -> None:
        """Return when the peer ends the session (its control connection closed)."""

    async def close(self) -> None: ...


#: How a link opens a session: ``PeerSession.connect`` in the daemon.
Connector = Callable[[ServeConfig, PeerAddress], Awaitable[Session]]


def staging_bytes_for(layout: ChannelLayout) -> int:
    """The largest batch the poll loop can issue on this channel: every request
    record with its prompt and the credit WRITE, then the control block and a
    window of the whole response ring (each READ 64-byte aligned)."""
    writes = layout.arena_size + layout.req_slots * (layout.req_slot_size + 16) + 64
    reads = CTRL_SIZE + layout.resp_slots * layout.resp_slot_size + 128
    return max(writes + reads, HEADER_SIZE)


class PeerSession:
    """A session over a real control connection and a real transport."""

    def __init__(self, address: PeerAddress, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, transport: Transport) -> None:
        self.address = address
        self.transport = transport
        self.layout: Layout | None = None
        self.channel_index = -1
        self._channel: DpuChannel | None = None
        self._reader = reader
        self._writer: asyncio.StreamWriter | None = writer

    @property
    def channel(self) -> DpuChannel:
        if self._channel is None:
            raise PeerError("session not connected")
        return self._channel

    @classmethod
    async def connect(cls, config: ServeConfig, address: PeerAddress,
                      transports: Callable[[ServeConfig], Transport] = open_transport,
                      ) -> PeerSession:
        try:
            async with asyncio.timeout(config.connect_timeout_s):
                reader, writer = await asyncio.open_connection(address.host, address.port)
        except (OSError, TimeoutError) as exc:
            raise PeerError(f"cannot reach GPU peer {address}: {exc}") from exc
        session: PeerSession | None = None
        try:
            session = cls(address, reader, writer, transports(config))
            await session._handshake(config)
        except BaseException:
            if session is not None:
                await session.close()
            else:
                writer.close()
            raise
        return session

    async def _handshake(self, cfg: ServeConfig) -> None:
        # Re-read at each handshake: replacing the file rotates the secret.
        secret = auth.load_secret(cfg.peer_secret_file) if cfg.peer_secret_file else None
        nonce = auth.nonce() if secret is not None else None
        hello = messages.Hello(cfg.transport, cfg.channel, self.transport.offer(),
                               client=f"dpu-frontend {__version__}", nonce=nonce)
        try:
            await messages.send(self._require_writer(), hello.to_dict())
            answer = await self._receive(cfg)
            if answer.get("op") == "challenge":
                answer = await self._answer_challenge(cfg, secret, nonce, answer)
            elif secret is not None and answer.get("op") == "welcome":
                raise StartupError(f"GPU peer {self.address} did not prove the shared secret "
                                   "(peer_secret_file is set here, not on the peer?)")
        except (OSError, TimeoutError) as exc:
            raise PeerError(f"handshake with GPU peer {self.address} failed: {exc}") from exc
        welcome = messages.Welcome.from_dict(answer)
        self.transport.attach(welcome.region, welcome.region_size, welcome.qp)
        self.layout = await self._read_layout(welcome)
        channel_layout = self.layout.channels[welcome.channel]
        self.transport.reserve(staging_bytes_for(channel_layout))
        self._channel = DpuChannel(channel_layout, welcome.epoch, time.monotonic())
        self.channel_index = welcome.channel
        log.info("connected to peer %s channel %d epoch %d over %s (instance %x, protocol v%d.%d)",
                 self.address, welcome.channel, welcome.epoch, cfg.transport,
                 self.layout.instance, self.layout.version_major, self.layout.version_minor)

    async def _receive(self, cfg: ServeConfig) -> dict[str, Any]:
        async with asyncio.timeout(cfg.connect_timeout_s):
            return await messages.receive(self._reader)

    async def _answer_challenge(self, cfg: ServeConfig, secret: bytes | None,
                                nonce: bytes | None, message: dict[str, Any]) -> dict[str, Any]:
        """Check the peer's proof, give ours; the peer's next message is the welcome."""
        if secret is None or nonce is None:
            raise StartupError(f"GPU peer {self.address} requires authentication: set "
                               "peer_secret_file to the secret it shares")
        challenge = messages.Challenge.from_dict(message)
        if not auth.verify(secret, "peer", nonce, challenge.nonce, challenge.proof):
            raise StartupError(f"GPU peer {self.address} failed to prove the shared secret: "
                               "the secrets differ, or it is not our peer")
        await messages.send(self._require_writer(), messages.Auth(
            auth.proof(secret, "daemon", nonce, challenge.nonce)).to_dict())
        return await self._receive(cfg)

    def _require_writer(self) -> asyncio.StreamWriter:
        if self._writer is None:
            raise PeerError("session closed")
        return self._writer

    async def _read_layout(self, welcome: messages.Welcome) -> Layout:
        if welcome.region_size < HEADER_SIZE:
            raise LayoutMismatch(f"peer region of {welcome.region_size} bytes is too small")
        head = await self.transport.read(ReadOp(0, HEADER_SIZE))
        size = decode_header_size(head)
        if not HEADER_SIZE <= size <= welcome.region_size:
            raise LayoutMismatch(f"layout record of {size} bytes in a region of "
                                 f"{welcome.region_size}")
        self.transport.reserve(size)
        layout = decode_layout(await self.transport.read(ReadOp(0, size)))
        if layout.instance != welcome.instance or layout.region_size != welcome.region_size:
            raise LayoutMismatch("layout record does not match the peer's welcome "
                                 "(instance or region size): stale or foreign region")
        if not 0 <= welcome.channel < len(layout.channels):
            raise LayoutMismatch(f"peer granted channel {welcome.channel} of "
                                 f"{len(layout.channels)}")
        return layout

    async def ended(self) -> None:
        with contextlib.suppress(OSError):
            await self._reader.read()

    async def close(self) -> None:
        """Control connection, then the transport (QP, staging MR, PD, context)."""
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
            self._writer = None
        self.transport.close()
