"""One connected session with one GPU peer: the handshake, and what it leaves to tear down.

``PeerSession.connect`` runs the bootstrap of docs/protocol.md section 7:
the control connection, hello/welcome, the QP to RTS (verbs) or the mapping
(shm), then the layout record read through the data path and checked
against the welcome. ``close`` releases everything in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from dpu_frontend import __version__
from dpu_frontend.config import PeerAddress, ServeConfig
from dpu_frontend.control import messages
from dpu_frontend.errors import LayoutMismatch, PeerError
from dpu_frontend.ring import DpuChannel, Layout, ReadOp
from dpu_frontend.ring.layout import (
    CTRL_SIZE,
    HEADER_SIZE,
    ChannelLayout,
    decode_header_size,
    decode_layout,
)
from dpu_frontend.transport.base import Transport
from dpu_frontend.transport.shm import ShmTransport
from dpu_frontend.transport.verbs.resources import QpInfo, RdmaResources
from dpu_frontend.transport.verbs.transport import VerbsTransport

log = logging.getLogger("dpu_frontend.ring")


def staging_bytes_for(layout: ChannelLayout) -> int:
    """The largest batch the poll loop can issue on this channel: every request
    record with its prompt and the credit WRITE, then the control block and a
    window of the whole response ring (each READ 64-byte aligned)."""
    writes = layout.arena_size + layout.req_slots * (layout.req_slot_size + 16) + 64
    reads = CTRL_SIZE + layout.resp_slots * layout.resp_slot_size + 128
    return max(writes + reads, HEADER_SIZE)


class PeerSession:
    def __init__(self, address: PeerAddress) -> None:
        self.address = address
        self.transport: Transport | None = None
        self.channel: DpuChannel | None = None
        self.layout: Layout | None = None
        self.channel_index = -1
        self.reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._resources: RdmaResources | None = None

    @classmethod
    async def connect(cls, config: ServeConfig, address: PeerAddress) -> PeerSession:
        session = cls(address)
        try:
            await session._connect(config)
        except BaseException:
            await session.close()
            raise
        return session

    async def _connect(self, cfg: ServeConfig) -> None:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.address.host, self.address.port),
                cfg.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise PeerError(f"cannot reach GPU peer {self.address}: {exc}") from exc
        self.reader, self._writer = reader, writer
        qp: dict[str, Any] | None = None
        verbs: VerbsTransport | None = None
        if cfg.transport == "verbs":
            self._resources = RdmaResources(cfg.rdma.device, cfg.rdma.ip)
            self._resources.open()
            verbs = VerbsTransport(self._resources, staging_bytes=HEADER_SIZE)
            self.transport = verbs
            qp = verbs.start().to_dict()
        hello = messages.Hello(cfg.transport, cfg.channel, qp, client=f"dpu-frontend {__version__}")
        try:
            await messages.send(writer, hello.to_dict())
            welcome = messages.Welcome.from_dict(
                await asyncio.wait_for(messages.receive(reader), cfg.connect_timeout_s))
        except (OSError, TimeoutError) as exc:
            raise PeerError(f"handshake with GPU peer {self.address} failed: {exc}") from exc
        try:
            if verbs is not None:
                if welcome.qp is None:
                    raise PeerError("peer sent no QP description")
                verbs.connect(QpInfo.from_dict(welcome.qp), int(welcome.region["addr"]),
                              int(welcome.region["rkey"]), welcome.region_size)
            else:
                shm = ShmTransport(str(welcome.region["path"]), welcome.region_size)
                self.transport = shm
                shm.start()
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerError(f"peer {self.address} described its region badly: {exc!r}") from exc
        self.layout = await self._read_layout(welcome)
        channel_layout = self.layout.channels[welcome.channel]
        if verbs is not None:
            verbs.reserve(staging_bytes_for(channel_layout))
        self.channel = DpuChannel(channel_layout, welcome.epoch)
        self.channel.heartbeat_at = time.monotonic()  # the stall clock starts now
        self.channel_index = welcome.channel
        log.info("connected to peer %s channel %d epoch %d over %s (instance %x, protocol v%d.%d)",
                 self.address, welcome.channel, welcome.epoch, cfg.transport,
                 self.layout.instance, self.layout.version_major, self.layout.version_minor)

    async def _read_layout(self, welcome: messages.Welcome) -> Layout:
        transport = self.transport
        if transport is None:
            raise PeerError("no transport")
        if welcome.region_size < HEADER_SIZE:
            raise LayoutMismatch(f"peer region of {welcome.region_size} bytes is too small")
        head = await transport.read(ReadOp(0, HEADER_SIZE))
        size = decode_header_size(head)
        if not HEADER_SIZE <= size <= welcome.region_size:
            raise LayoutMismatch(f"layout record of {size} bytes in a region of "
                                 f"{welcome.region_size}")
        if isinstance(transport, VerbsTransport):
            transport.reserve(size)
        layout = decode_layout(await transport.read(ReadOp(0, size)))
        if layout.instance != welcome.instance or layout.region_size != welcome.region_size:
            raise LayoutMismatch("layout record does not match the peer's welcome "
                                 "(instance or region size): stale or foreign region")
        if not 0 <= welcome.channel < len(layout.channels):
            raise LayoutMismatch(f"peer granted channel {welcome.channel} of "
                                 f"{len(layout.channels)}")
        return layout

    async def close(self) -> None:
        """Control connection, then QP and staging MR, then PD and context."""
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
            self._writer = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self._resources is not None:
            self._resources.close()
            self._resources = None
