"""One channel to one GPU peer, kept alive: sessions, the poll loop, per-request streams.

``PeerLink`` supervises sessions (``engine/session.py``): connect, serve,
and when the session fails (control connection closed, a completion error, a
heartbeat that stopped, an RDMA operation that did not complete within
``peer_timeout_s``, a protocol violation), end every open stream with that
error, tear the session down and reconnect with exponential backoff. While
it is down, ``submit`` answers 503 at once.

The poll loop is the only code that touches a session's transport: each poll
posts, as one batch, the queued request WRITEs and the credit WRITE that
releases consumed response slots, the READ of the GPU control block and a
fenced READ of the records it may declare; it hands each record to its
request's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence

from dpu_frontend.config import PeerAddress, ServeConfig
from dpu_frontend.engine.session import PeerSession
from dpu_frontend.engine.stream import RequestStream
from dpu_frontend.errors import (
    ClientTooSlow,
    DpuFrontendError,
    LayoutMismatch,
    Overloaded,
    PeerError,
    StartupError,
    TransportError,
    Unavailable,
)
from dpu_frontend.metrics import Metrics
from dpu_frontend.ring import DpuChannel, ResponseRecord, SamplingParams

log = logging.getLogger("dpu_frontend.ring")

MAX_COST = 1 << 20  # a request's max_tokens counts at most this much towards its peer's load


class PeerLink:
    def __init__(self, config: ServeConfig, address: PeerAddress, metrics: Metrics) -> None:
        self.config = config
        self.address = address
        self.metrics = metrics
        self._peer = str(address)  # the metrics label
        self._writes = metrics.rdma_operations.labels(self._peer, "write")  # looked up once
        self._reads = metrics.rdma_operations.labels(self._peer, "read")
        self.session: PeerSession | None = None
        self.up = False
        self.error: DpuFrontendError | None = None
        self.reconnects = 0
        self.outstanding = 0  # tokens: prompt + max_tokens of every open request
        self.idle = asyncio.Event()
        self.idle.set()
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._first: asyncio.Future[None] | None = None
        self._connected_before = False

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Start supervising; return once the first connection attempt is over.

        Raises that attempt's error; the link keeps retrying in the background
        unless the error is fatal (``StartupError``).
        """
        self._first = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._supervise(), name=f"peer-{self.address}")
        await asyncio.shield(self._first)

    async def _supervise(self) -> None:
        cfg = self.config
        delay = cfg.reconnect_initial_s
        while True:
            try:
                session = await PeerSession.connect(cfg, self.address)
            except Exception as exc:
                if not isinstance(exc, DpuFrontendError):
                    log.exception("connecting to GPU peer %s failed unexpectedly", self.address)
                    exc = PeerError(f"connecting to GPU peer {self.address} failed: {exc!r}")
                self.error = exc
                first_attempt = self._first is not None and not self._first.done()
                if first_attempt and self._first is not None:
                    self._first.set_exception(exc)
                if first_attempt and isinstance(exc, StartupError | LayoutMismatch):
                    return  # a configuration that cannot work: the daemon exits
                log.warning("GPU peer %s unavailable: %s; retrying in %.1f s",
                            self.address, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, cfg.reconnect_max_s)
                continue
            delay = cfg.reconnect_initial_s
            self.session, self.up, self.error = session, True, None
            if self._first is not None and not self._first.done():
                self._first.set_result(None)
            if self._connected_before:
                self.reconnects += 1
                self.metrics.reconnects.labels(self._peer).inc()
                log.info("GPU peer %s reconnected (reconnect %d)", self.address, self.reconnects)
            self._connected_before = True
            try:
                await self._serve(session)
            except PeerError as exc:
                self._fail(exc)
            except Exception as exc:  # a bug must end the streams and reconnect, not kill the link
                log.exception("serving GPU peer %s failed unexpectedly", self.address)
                self._fail(PeerError(f"internal error with GPU peer {self.address}: {exc!r}"))
            finally:
                self.up = False
                self.session = None
                await session.close()
            await asyncio.sleep(delay)

    async def close(self) -> None:
        self.abort(PeerError("the daemon is shutting down"))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._first is not None and not self._first.done():
            self._first.cancel()

    # -- requests ---------------------------------------------------------------

    @property
    def channel(self) -> DpuChannel | None:
        """The ring pair of the current session, while the link is up."""
        session = self.session
        return session.channel if self.up and session is not None else None

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> RequestStream:
        channel, cfg = self.channel, self.config
        if channel is None:
            raise Unavailable(f"GPU peer {self.address} is down: {self.error}")
        if channel.queued >= cfg.max_queued_requests:
            raise Overloaded(f"{channel.queued} requests already wait for GPU peer {self.address}")
        if channel.queued_tokens + len(prompt) > cfg.max_queued_prompt_tokens:
            raise Overloaded(f"{channel.queued_tokens} prompt tokens already wait for GPU peer "
                             f"{self.address}")
        request_id = next(self._ids)
        channel.submit(request_id, prompt, params)
        stream = RequestStream(request_id, len(prompt) + min(params.max_tokens, MAX_COST),
                               cfg.stream_buffer_records, self.cancel)
        self._streams[request_id] = stream
        self.outstanding += stream.cost
        self.idle.clear()
        self._wake.set()
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """The client went away: stop generation on the GPU side (a cancel record)."""
        if stream.request_id not in self._streams:
            return
        stream.abandon()
        self._cancel_on_gpu(stream)

    def _cancel_on_gpu(self, stream: RequestStream) -> None:
        channel = self.channel
        if stream.cancel_sent or channel is None:
            return
        stream.cancel_sent = True
        if not channel.cancel(stream.request_id):
            self._end(stream)  # it never left the queue: nothing will answer it
        self._wake.set()

    def _end(self, stream: RequestStream) -> None:
        if self._streams.pop(stream.request_id, None) is not None:
            self.outstanding -= stream.cost
        if not self._streams:
            self.idle.set()

    def abort(self, error: DpuFrontendError) -> None:
        """End every open stream with ``error`` and cancel its generation."""
        for stream in list(self._streams.values()):
            if not stream.finished:
                self.metrics.aborted.labels("shutdown").inc()
                stream.fail(error)
            self._cancel_on_gpu(stream)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    # -- one session ---------------------------------------------------------------

    async def _serve(self, session: PeerSession) -> None:
        """Poll until the session fails; the control connection closing fails it too."""
        poll = asyncio.create_task(self._poll(session))
        watch = asyncio.create_task(self._watch_control(session))
        try:
            done, _ = await asyncio.wait({poll, watch}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises the failure
        finally:
            for task in (poll, watch):
                task.cancel()
            await asyncio.gather(poll, watch, return_exceptions=True)

    async def _watch_control(self, session: PeerSession) -> None:
        if session.reader is not None:
            with contextlib.suppress(OSError):
                await session.reader.read()
        raise PeerError(f"GPU peer {self.address} closed its control connection")

    async def _poll(self, session: PeerSession) -> None:
        try:
            await self._poll_forever(session)
        except TransportError as exc:
            self.metrics.rdma_errors.labels(self._peer, exc.opcode).inc()
            raise
        except TimeoutError as exc:
            raise PeerError(f"GPU peer {self.address}: an RDMA operation did not complete "
                            f"within {self.config.peer_timeout_s} s") from exc
        except (asyncio.CancelledError, PeerError):
            raise
        except Exception as exc:  # a bug must still end the streams, never hang them
            log.exception("poll loop crashed")
            raise PeerError(f"internal error in the ring poll loop: {exc}") from exc

    async def _poll_forever(self, session: PeerSession) -> None:
        cfg = self.config
        channel, transport = session.channel, session.transport
        if channel is None or transport is None:
            raise PeerError("session not connected")
        while True:
            # The deadline covers the RDMA operations only, not our own dispatching.
            async with asyncio.timeout(cfg.peer_timeout_s):
                poll = channel.begin_poll()
                data = await transport.exchange(poll.writes, poll.reads)
                now = time.monotonic()
                records, more = channel.end_poll(poll, data, now)
                for op in more:  # published past the speculative window
                    records += channel.on_records(op, await transport.read(op))
            if poll.writes:
                self._writes.inc(len(poll.writes))
            self._reads.inc(len(poll.reads) + len(more))
            for request_id in poll.sent:
                sent = self._streams.get(request_id)
                if sent is not None:
                    self.metrics.queue_time.observe(now - sent.submitted_at)
            for record in records:
                self._dispatch(record)
            if now - channel.heartbeat_at > cfg.peer_timeout_s:
                raise PeerError(f"GPU peer {self.address}: heartbeat stopped for "
                                f"{now - channel.heartbeat_at:.1f} s")
            if records:
                # More may be waiting: poll again at once, but let the handlers run first
                # (shm operations, and completions already in the CQ, never suspend).
                await asyncio.sleep(0)
                continue
            if self._streams or channel.queued:
                await asyncio.sleep(cfg.poll_interval_s)
            else:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), cfg.idle_poll_interval_s)

    def _dispatch(self, record: ResponseRecord) -> None:
        stream = self._streams.get(record.request_id)
        if stream is None:
            log.warning("peer %s: record for unknown request %d dropped", self.address,
                        record.request_id)
            return
        if record.final:
            self._end(stream)
        if stream.put(record):
            return
        # The client is a whole buffer behind: cut it off rather than buffer more.
        self.metrics.aborted.labels("client_too_slow").inc()
        stream.fail(ClientTooSlow(f"the client read too slowly ({stream.limit} records "
                                  "buffered); the request was cancelled",
                                  code="stream_buffer_overflow"))
        if not record.final:
            self._cancel_on_gpu(stream)

    def _fail(self, exc: PeerError) -> None:
        log.error("GPU peer %s failed: %s", self.address, exc)
        self.error = exc
        self.up = False
        streams, self._streams = self._streams, {}
        self.outstanding = 0
        self.idle.set()
        if streams:
            self.metrics.aborted.labels("peer_failed").inc(len(streams))
        for stream in streams.values():
            stream.fail(exc)
