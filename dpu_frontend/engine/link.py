"""One channel to one GPU peer, kept alive: sessions, the poll loop, its ring requests.

``PeerLink`` supervises sessions (``engine/session.py``): connect, serve,
and when the session fails (control connection closed, a completion error, a
heartbeat that stopped, an RDMA operation that did not complete within
``peer_timeout_s``, a protocol violation), end every open request with that
error, tear the session down and reconnect with exponential backoff. While
it is not up, ``submit`` answers 503 at once.

Its lifecycle is one explicit state (``LinkState``), checked on every
transition::

    CONNECTING --> UP --> DOWN --> CONNECTING ...
         \\-------------> DOWN        (an attempt that failed)
    any state --> CLOSED              (the daemon stops)

The poll loop is the only code that touches a session's transport: each poll
posts, as one batch, the queued request WRITEs and the credit WRITE that
releases consumed response slots, the READ of the GPU control block and a
fenced READ of the records it may declare; it hands each record to its
request.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from collections.abc import Sequence

from dpu_frontend.config import PeerAddress, ServeConfig
from dpu_frontend.engine.cadence import Cadence
from dpu_frontend.engine.request import RingRequest
from dpu_frontend.engine.session import Connector, PeerSession, Session
from dpu_frontend.errors import (
    ClientTooSlow,
    DpuFrontendError,
    LayoutMismatch,
    Overloaded,
    PeerError,
    ProtocolError,
    StartupError,
    TransportError,
    Unavailable,
)
from dpu_frontend.metrics import Metrics
from dpu_frontend.ring import DpuChannel, ResponseRecord, SamplingParams
from dpu_frontend.ring.automaton import Constraint

log = logging.getLogger("dpu_frontend.engine")

MAX_COST = 1 << 20  # a request's max_tokens counts at most this much towards its peer's load


class LinkState(enum.Enum):
    CONNECTING = "connecting"  # an attempt is under way; no session
    UP = "up"  # a session serves requests
    DOWN = "down"  # the last attempt or session failed (``error``); a retry waits
    CLOSED = "closed"  # for good


_NEXT = {
    LinkState.CONNECTING: {LinkState.UP, LinkState.DOWN, LinkState.CLOSED},
    LinkState.UP: {LinkState.DOWN, LinkState.CLOSED},
    LinkState.DOWN: {LinkState.CONNECTING, LinkState.CLOSED},
    LinkState.CLOSED: set(),
}


class PeerLink:
    def __init__(self, config: ServeConfig, address: PeerAddress, metrics: Metrics,
                 connect: Connector = PeerSession.connect) -> None:
        self.config = config
        self.address = address
        self.metrics = metrics
        self._connect = connect
        self._peer = str(address)  # the metrics label
        self._writes = metrics.rdma_operations.labels(self._peer, "write")  # looked up once
        self._reads = metrics.rdma_operations.labels(self._peer, "read")
        self.state = LinkState.CONNECTING
        self._session: Session | None = None  # set exactly while UP
        self.error: DpuFrontendError | None = None  # why it went DOWN last
        self.reconnects = 0
        self.outstanding = 0  # tokens: prompt + max_tokens of every open request
        self.idle = asyncio.Event()
        self.idle.set()
        self._requests: dict[int, RingRequest] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._skips = metrics.poll_cadence.labels(self._peer, "skip")
        self._late = metrics.poll_cadence.labels(self._peer, "late")
        self._task: asyncio.Task[None] | None = None
        self._first: asyncio.Future[None] | None = None
        self._sessions = 0
        # Token ids at or above this are not in the daemon's vocabulary: a record
        # holding one fails its request (set by the pool once the tokenizer is loaded).
        self.vocab_size: int | None = None

    # -- state -------------------------------------------------------------------

    def _enter(self, state: LinkState, session: Session | None = None,
               error: DpuFrontendError | None = None) -> None:
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"peer link {self.address}: {self.state.value} -> {state.value}")
        self.state, self._session = state, session
        if error is not None:
            self.error = error
        elif state is LinkState.UP:
            self.error = None
        if state is not LinkState.UP and self._first is not None and not self._first.done():
            self._first.set_exception(self.error or PeerError("closed"))
        elif state is LinkState.UP and self._first is not None and not self._first.done():
            self._first.set_result(None)

    @property
    def up(self) -> bool:
        return self.state is LinkState.UP

    @property
    def channel(self) -> DpuChannel | None:
        """The ring pair of the current session, while the link is up."""
        return self._session.channel if self._session is not None else None

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Start supervising; return once the first connection attempt is over.

        Raises that attempt's error; the link keeps retrying in the background
        unless the error is fatal (``StartupError``, ``LayoutMismatch``).
        """
        self._first = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._supervise(), name=f"peer-{self.address}")
        await asyncio.shield(self._first)

    async def _supervise(self) -> None:
        """Connect, serve until the session fails, back off, again."""
        delay = self.config.reconnect_initial_s
        while True:
            session = await self._open_session()
            if session is None:
                if self._sessions == 0 and isinstance(self.error, StartupError | LayoutMismatch):
                    return  # a configuration that cannot work: the daemon exits
                log.warning("GPU peer %s unavailable: %s; retrying in %.1f s",
                            self.address, self.error, delay)
            else:
                delay = self.config.reconnect_initial_s
                try:
                    await self._serve(session)
                finally:
                    await session.close()
            await asyncio.sleep(delay)
            if session is None:
                delay = min(delay * 2, self.config.reconnect_max_s)
            self._enter(LinkState.CONNECTING)

    async def _open_session(self) -> Session | None:
        """One attempt: UP with its session, or DOWN with its error (and None)."""
        try:
            session = await self._connect(self.config, self.address)
        except Exception as exc:
            if not isinstance(exc, DpuFrontendError):
                log.exception("connecting to GPU peer %s failed unexpectedly", self.address)
                exc = PeerError(f"connecting to GPU peer {self.address} failed: {exc!r}")
            self._enter(LinkState.DOWN, error=exc)
            return None
        self._enter(LinkState.UP, session)
        self._sessions += 1
        if self._sessions > 1:
            self.reconnects += 1
            self.metrics.reconnects.labels(self._peer).inc()
            log.info("GPU peer %s reconnected (reconnect %d)", self.address, self.reconnects)
        return session

    async def close(self) -> None:
        self.abort(PeerError("the daemon is shutting down"), reason="shutdown")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.state is not LinkState.CLOSED:
            self._enter(LinkState.CLOSED)

    # -- requests ---------------------------------------------------------------

    @property
    def offers_constraints(self) -> bool:
        """Whether the peer's ring takes structured output's automata."""
        return self.channel is not None and self.channel.layout.constraints

    def submit(self, prompt: Sequence[int], params: SamplingParams,
               constraint: Constraint | None = None) -> RingRequest:
        channel, cfg = self.channel, self.config
        if channel is None:
            raise Unavailable(f"GPU peer {self.address} is {self.state.value}: {self.error}")
        if channel.waiting >= cfg.max_queued_requests:
            raise Overloaded(f"{channel.waiting} requests already wait for GPU peer "
                             f"{self.address}")
        if channel.queued_tokens + len(prompt) > cfg.max_queued_prompt_tokens:
            raise Overloaded(f"{channel.queued_tokens} prompt tokens already wait for GPU peer "
                             f"{self.address}")
        request_id = next(self._ids)
        channel.submit(request_id, prompt, params, constraint)
        request = RingRequest(request_id, len(prompt) + min(params.max_tokens, MAX_COST),
                              cfg.stream_buffer_records, self.cancel)
        self._requests[request_id] = request
        self.outstanding += request.cost
        self.idle.clear()
        self._wake.set()
        return request

    def cancel(self, request: RingRequest) -> None:
        """The client went away: stop generation on the GPU side (a cancel record)."""
        if request.request_id not in self._requests:
            return
        request.abandon()
        self._cancel_on_gpu(request)

    def _cancel_on_gpu(self, request: RingRequest) -> None:
        channel = self.channel
        if request.cancel_sent or channel is None:
            return
        request.cancel_sent = True
        if not channel.cancel(request.request_id):
            self._end(request)  # it never left the queue: nothing will answer it
        self._wake.set()

    def _end(self, request: RingRequest) -> None:
        if self._requests.pop(request.request_id, None) is not None:
            self.outstanding -= request.cost
        if not self._requests:
            self.idle.set()

    def abort(self, error: DpuFrontendError, *, reason: str) -> None:
        """End every open request with ``error`` (counted as ``reason``) and cancel its
        generation."""
        for request in list(self._requests.values()):
            if not request.finished:
                self.metrics.aborted.labels(reason).inc()
                request.fail(error)
            self._cancel_on_gpu(request)

    # -- one session ---------------------------------------------------------------

    async def _serve(self, session: Session) -> None:
        """Poll until the session fails (the peer ending it fails it too); then DOWN,
        every open request ended with the failure."""
        poll = asyncio.create_task(self._poll(session))
        ended = asyncio.create_task(session.ended())
        try:
            done, _ = await asyncio.wait({poll, ended}, return_when=asyncio.FIRST_COMPLETED)
            if poll in done:
                poll.result()  # raises the failure
            raise PeerError(f"GPU peer {self.address} closed its control connection")
        except PeerError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug must end the requests and reconnect, not kill the link
            log.exception("serving GPU peer %s failed unexpectedly", self.address)
            self._fail(PeerError(f"internal error with GPU peer {self.address}: {exc!r}"))
        finally:
            for task in (poll, ended):
                task.cancel()
            await asyncio.gather(poll, ended, return_exceptions=True)
            # The failure's traceback holds this frame, which holds the tasks, which hold
            # the failure: a cycle that, for the first session (frozen out of the
            # collector's sight after start, daemon.tune_garbage_collector), would never
            # be freed.
            del poll, ended

    async def _poll(self, session: Session) -> None:
        """Poll forever; every way out is a ``PeerError``."""
        cfg, channel = self.config, session.channel
        # Learned afresh each session: a restarted peer may step at another pace.
        cadence = (Cadence(cfg.poll_interval_s, longest=max(cfg.poll_interval_s,
                                                             cfg.peer_timeout_s / 4))
                   if cfg.poll_cadence else None)
        try:
            while True:
                records, polled_at = await self._poll_once(session)
                # The poll's own time (its exchange's end, before its records were handed
                # out): a burst's start, not the end of the work it made.
                if cadence is not None and cadence.polled(polled_at, records):
                    self._late.inc()
                now = time.monotonic()
                stalled = now - channel.heartbeat_at
                if stalled > cfg.peer_timeout_s:
                    raise PeerError(f"GPU peer {self.address}: heartbeat stopped for "
                                    f"{stalled:.1f} s")
                await self._pace(channel, cadence, now, records=records, polled_at=polled_at)
        except TransportError as exc:
            self.metrics.rdma_errors.labels(self._peer, exc.opcode).inc()
            raise
        except ProtocolError:
            # A stale epoch, a torn record, a sequence out of place: nothing the peer
            # publishes can be trusted after it, so the session is reset.
            self.metrics.bad_records.labels(self._peer, "protocol").inc()
            raise
        except TimeoutError as exc:
            raise PeerError(f"GPU peer {self.address}: an RDMA operation did not complete "
                            f"within {cfg.peer_timeout_s} s") from exc
        except (asyncio.CancelledError, PeerError):
            raise
        except Exception as exc:  # a bug must still end the requests, never hang them
            log.exception("poll loop crashed")
            raise PeerError(f"internal error in the ring poll loop: {exc}") from exc

    async def _poll_once(self, session: Session) -> tuple[int, float]:
        """One batch on the transport; each record to its request. Returns how many, and
        when the exchange ended."""
        channel, transport = session.channel, session.transport
        # The deadline covers the RDMA operations only, not our own dispatching.
        async with asyncio.timeout(self.config.peer_timeout_s):
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
            sent = self._requests.get(request_id)
            if sent is not None:
                self.metrics.queue_time.observe(now - sent.submitted_at)
        for record in records:
            self._dispatch(record, now)
        return len(records), now

    async def _pace(self, channel: DpuChannel, cadence: Cadence | None, now: float, *,
                    records: int, polled_at: float) -> None:
        """Wait before the next poll. After records: until a poll interval from that
        poll's exchange (its READs took everything published before them, so a record
        waits no longer than after an empty poll), or none where they filled a quarter
        of the ring (the peer may be waiting for the slots back), the handlers running
        first either way. With requests open and no records: the poll interval, or
        where the peer's cadence says its next records are not due before then, until
        just before they are (or a request is submitted or cancelled). With none open:
        until one is submitted or the idle interval passes (the heartbeat is still
        watched)."""
        interval = self.config.poll_interval_s
        if records:
            backlog = records * 4 >= channel.layout.resp_slots
            await asyncio.sleep(0 if backlog else max(0.0, polled_at + interval - now))
            return
        if self._requests or channel.queued:
            wait = cadence.wait(now) if cadence is not None and not channel.queued else interval
            if wait <= interval:
                await asyncio.sleep(interval)
                return
            self._skips.inc()
        else:
            wait = self.config.idle_poll_interval_s
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._wake.wait()

    def _dispatch(self, record: ResponseRecord, now: float) -> None:
        request = self._requests.get(record.request_id)
        if request is None:
            self.metrics.bad_records.labels(self._peer, "unknown_request").inc()
            log.warning("peer %s: record for unknown request %d dropped", self.address,
                        record.request_id)
            return
        if record.finish:  # final (an int test: this runs per record)
            self._end(request)
        limit = self.vocab_size
        if limit is not None and record.tokens and max(record.tokens) >= limit:
            # Only this request is wrong: it ends with the error, the others go on.
            self.metrics.bad_records.labels(self._peer, "token_id").inc()
            request.fail(PeerError(f"GPU peer {self.address} sent token id "
                                   f"{max(record.tokens)}, outside the vocabulary "
                                   f"({limit} ids)"))
            if not record.final:
                self._cancel_on_gpu(request)
            return
        if request.put(record, now):
            return
        # The client is a whole buffer behind: cut it off rather than buffer more.
        self.metrics.aborted.labels("client_too_slow").inc()
        request.fail(ClientTooSlow(f"the client read too slowly ({request.limit} records "
                                   "buffered); the request was cancelled",
                                   code="stream_buffer_overflow"))
        if not record.final:
            self._cancel_on_gpu(request)

    def _fail(self, exc: PeerError) -> None:
        log.error("GPU peer %s failed: %s", self.address, exc)
        self._enter(LinkState.DOWN, error=exc)
        requests, self._requests = self._requests, {}
        self.outstanding = 0
        self.idle.set()
        if requests:
            self.metrics.aborted.labels("peer_failed").inc(len(requests))
        for request in requests.values():
            request.fail(exc)
