"""One channel to one GPU peer: bootstrap, the poll loop, and per-request streams.

``PeerLink`` owns the transport and the sans-I/O ``DpuChannel``. Its poll
loop is the only code that touches the transport: it posts the queued
request WRITEs, READs the GPU control block, READs the records it declares,
hands each record to the stream of its request, and releases consumed
response slots. Any transport or protocol failure ends every open stream
with that error: nothing waits forever on a dead peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from dpu_frontend import __version__
from dpu_frontend.config import ServeConfig
from dpu_frontend.control import messages
from dpu_frontend.errors import LayoutMismatch, PeerError
from dpu_frontend.ring import DpuChannel, ReadOp, ResponseRecord, SamplingParams
from dpu_frontend.ring.layout import HEADER_SIZE, ChannelLayout, decode_header_size, decode_layout
from dpu_frontend.transport.base import Transport
from dpu_frontend.transport.shm import ShmTransport
from dpu_frontend.transport.verbs.resources import QpInfo, RdmaResources
from dpu_frontend.transport.verbs.transport import VerbsTransport

log = logging.getLogger("dpu_frontend.ring")


class RequestStream:
    """The response records of one request, in order, ending with a final one.

    Iterating raises ``PeerError`` if the link fails before the final record.
    """

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[ResponseRecord | PeerError] = asyncio.Queue()
        self.finished = False

    def _put(self, item: ResponseRecord | PeerError) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> ResponseRecord:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, PeerError):
            self.finished = True
            raise item
        if item.final:
            self.finished = True
        return item


def staging_bytes_for(layout: ChannelLayout) -> int:
    """The largest batch the poll loop can issue on this channel."""
    writes = layout.arena_size + layout.req_slots * (layout.req_slot_size + 16) + 64
    return max(writes, layout.resp_slots * layout.resp_slot_size, HEADER_SIZE)


class PeerLink:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.channel: DpuChannel | None = None
        self.transport: Transport | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.channel_index = -1
        self.up = False
        self._resources: RdmaResources | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.error: PeerError | None = None
        self.down = asyncio.Event()  # set once the link has failed

    async def start(self) -> None:
        """Connect, run the handshake, validate the layout record, start polling."""
        cfg = self.config
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(cfg.peer.host, cfg.peer.port), cfg.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise PeerError(f"cannot reach GPU peer {cfg.peer}: {exc}") from exc
        self._writer = writer
        qp: dict[str, Any] | None = None
        verbs: VerbsTransport | None = None
        if cfg.transport == "verbs":
            self._resources = RdmaResources(cfg.rdma.device, cfg.rdma.ip)
            self._resources.open()
            verbs = VerbsTransport(self._resources, staging_bytes=HEADER_SIZE)
            qp = verbs.start().to_dict()
        hello = messages.Hello(cfg.transport, cfg.channel, qp, client=f"dpu-frontend {__version__}")
        await messages.send(writer, hello.to_dict())
        welcome = messages.Welcome.from_dict(
            await asyncio.wait_for(messages.receive(reader), cfg.connect_timeout_s))
        if verbs is not None:
            if welcome.qp is None:
                raise PeerError("peer sent no QP description")
            verbs.connect(QpInfo.from_dict(welcome.qp), int(welcome.region["addr"]),
                          int(welcome.region["rkey"]), welcome.region_size)
            self.transport = verbs
        else:
            shm = ShmTransport(str(welcome.region["path"]), welcome.region_size)
            shm.start()
            self.transport = shm
        layout = await self._read_layout(welcome)
        channel_layout = layout.channels[welcome.channel]
        if verbs is not None:
            verbs.reserve(staging_bytes_for(channel_layout))
        self.channel = DpuChannel(channel_layout)
        self.channel_index = welcome.channel
        self.eos_token_ids = tuple(int(t) for t in welcome.model.get("eos_token_ids", ()))
        self.up = True
        self._tasks = [asyncio.create_task(self._poll_loop(), name="peer-poll"),
                       asyncio.create_task(self._watch_control(reader), name="peer-control")]
        log.info("connected to peer %s channel %d over %s (instance %x, protocol v%d.%d)",
                 cfg.peer, welcome.channel, cfg.transport, layout.instance,
                 layout.version_major, layout.version_minor)

    async def _read_layout(self, welcome: messages.Welcome) -> Any:
        transport = self.transport
        if transport is None:
            raise PeerError("no transport")
        if welcome.region_size < HEADER_SIZE:
            raise LayoutMismatch(f"peer region of {welcome.region_size} bytes is too small")
        head = await transport.read(ReadOp(0, HEADER_SIZE))
        size = decode_header_size(head)
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

    # -- requests -----------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> RequestStream:
        if not self.up or self.channel is None:
            raise self.error or PeerError("GPU peer is not connected")
        request_id = next(self._ids)
        self.channel.submit(request_id, prompt, params)
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._wake.set()
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """The client went away: stop generation on the GPU side."""
        if stream.finished or not self.up or self.channel is None:
            return
        if not self.channel.cancel(stream.request_id):
            # It never reached the ring: nothing will answer it.
            self._streams.pop(stream.request_id, None)
        stream.finished = True
        self._wake.set()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    # -- the poll loop ---------------------------------------------------------

    async def _poll_loop(self) -> None:
        try:
            await self._poll_forever()
        except asyncio.CancelledError:
            raise
        except PeerError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug must still end the streams, never hang them
            log.exception("poll loop crashed")
            self._fail(PeerError(f"internal error in the ring poll loop: {exc}"))

    async def _poll_forever(self) -> None:
        cfg = self.config
        channel, transport = self.channel, self.transport
        if channel is None or transport is None:
            raise PeerError("link not started")
        while True:
            writes = channel.take_writes()
            if writes:
                await transport.write(writes)
            ctrl = await transport.read(channel.ctrl_read())
            reads = channel.on_ctrl(ctrl, time.monotonic())
            for op in reads:
                for record in channel.on_records(op, await transport.read(op)):
                    self._dispatch(record)
            release = channel.consumer_update(idle=not reads)
            if release is not None:
                await transport.write([release])
            if reads:
                continue  # more may be waiting: poll again at once
            if self._streams or channel.queued:
                await asyncio.sleep(cfg.poll_interval_s)
            else:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), cfg.idle_poll_interval_s)

    def _dispatch(self, record: ResponseRecord) -> None:
        stream = self._streams.get(record.request_id)
        if stream is None:
            log.warning("record for unknown request %d dropped", record.request_id)
            return
        if record.final:
            del self._streams[record.request_id]
        if not stream.finished:
            stream._put(record)

    async def _watch_control(self, reader: asyncio.StreamReader) -> None:
        """The control connection closes when the peer process dies."""
        with contextlib.suppress(ConnectionError):
            await reader.read()
        self._fail(PeerError(f"GPU peer {self.config.peer} closed its control connection"))

    def _fail(self, exc: PeerError) -> None:
        if self.error is None:
            log.error("peer %s failed: %s", self.config.peer, exc)
            self.error = exc
        self.up = False
        self.down.set()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._put(exc)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def close(self) -> None:
        self.up = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._put(PeerError("the daemon is shutting down"))
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
        if self.transport is not None:
            self.transport.close()
        if self._resources is not None:
            self._resources.close()
