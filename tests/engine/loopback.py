"""The GPU half of a channel in the test's own process, behind a real ``Transport``.

The in-memory twin of a peer: no socket, no QP, no second process. A
``LoopbackGpu`` is a ``GpuChannel`` on a bytearray; ``LoopbackTransport``
applies the daemon's batch to that memory exactly as the RC rules say
(WRITEs in order, then READs), letting the GPU half run one step between the
two, as a kernel running beside the DPU would. ``LoopbackPeer`` is the
``Connector`` a ``PeerLink`` is given instead of ``PeerSession.connect``: each
connection is a new attachment (a new epoch), optionally with a new layout.

The GPU half answers only what the test tells it to (``emit``), or, with
``echo``, the prompt itself, ``echo`` tokens per record. Nothing here sleeps:
the test decides every order, and every wait is bounded (``within``): a check gone
missing lets a stream run on, which must fail the test, not hang it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dpu_frontend.config import PeerAddress, ServeConfig
from dpu_frontend.errors import DpuFrontendError, TransportError
from dpu_frontend.ring import (
    CancelRecord,
    DpuChannel,
    FinishReason,
    GenerateRecord,
    Geometry,
    GpuChannel,
    ReadOp,
    ResponseRecord,
    WriteOp,
)
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.transport.base import Transport

SMALL = Geometry(channels=1, req_slots=8, arena_bytes=4096, resp_slots=16, max_sequences=8)
#: What an in-memory test waits for comes within a few poll intervals; a wait this long
#: never ends.
WAIT_S = 5.0

T = TypeVar("T")


async def within(awaitable: Awaitable[T], what: str, seconds: float = WAIT_S) -> T:
    """``awaitable``'s result, or an AssertionError saying ``what`` did not come."""
    scope = asyncio.timeout(seconds)
    try:
        async with scope:
            return await awaitable
    except TimeoutError:
        if not scope.expired():
            raise  # the awaitable's own
        raise AssertionError(f"{what}: not within {seconds} s") from None


@dataclass
class Arrival:
    """A generate request as the GPU half took it."""

    record: GenerateRecord
    prompt: tuple[int, ...]
    cancelled: bool = False


@dataclass
class LoopbackGpu:
    """One attachment of one channel: the GPU's memory and what it has seen."""

    geometry: Geometry = SMALL
    epoch: int = 1
    echo: int = 0  # > 0: answer every generate with its own prompt, this many tokens a record
    beating: bool = True  # False: the heartbeat stops (a hung kernel)
    failure: DpuFrontendError | None = None  # raised by the next exchange (a QP in error)
    arrivals: dict[int, Arrival] = field(default_factory=dict)
    cancels: list[int] = field(default_factory=list)
    exchanges: int = 0

    def __post_init__(self) -> None:
        self.layout = self.geometry.plan(instance=0x600D)
        self.mem = AtomicMemory(bytearray(self.layout.region_size))
        self.channel_layout = self.layout.channels[0]
        self.ring = GpuChannel(self.mem, self.channel_layout)
        self.ring.reset(self.epoch)
        self._outbox: deque[ResponseRecord] = deque()
        self._echoing: dict[int, deque[int]] = {}
        self._changed = asyncio.Event()
        self.hung_up = asyncio.Event()  # the control connection closed

    # -- what the test does ------------------------------------------------------

    def emit(self, request_id: int, tokens: tuple[int, ...] = (),
             finish: FinishReason = FinishReason.NONE) -> None:
        """Publish a record at the next exchange (once credits allow)."""
        self._outbox.append(ResponseRecord(request_id, tokens, finish))

    def finish(self, request_id: int, tokens: tuple[int, ...] = (),
               finish: FinishReason = FinishReason.STOP) -> None:
        self.emit(request_id, tokens, finish)

    async def wait_for(self, count: int, *, cancels: int = 0) -> list[Arrival]:
        """Until ``count`` generates (and ``cancels`` cancels) have arrived."""
        def arrived() -> bool:
            return len(self.arrivals) >= count and len(self.cancels) >= cancels

        await within(self._until(arrived), f"{count} generates and {cancels} cancels at the GPU")
        return list(self.arrivals.values())

    async def wait_exchanges(self, count: int) -> None:
        """Until the daemon has run ``count`` more batches."""
        target = self.exchanges + count
        await within(self._until(lambda: self.exchanges >= target), f"{count} more batches")

    async def _until(self, done: Callable[[], bool]) -> None:
        while not done():
            self._changed.clear()
            await self._changed.wait()

    @property
    def published(self) -> int:
        return self.ring.counters.published

    # -- one step between the WRITEs and the READs of a batch ---------------------

    def step(self) -> None:
        for record, prompt, *_ in self.ring.poll_requests():
            if isinstance(record, CancelRecord):
                self.cancels.append(record.request_id)
                arrival = self.arrivals.get(record.request_id)
                if arrival is not None:
                    arrival.cancelled = True
                    self._echoing.pop(record.request_id, None)
            elif isinstance(record, GenerateRecord):
                self.arrivals[record.request_id] = Arrival(record, prompt)
                if self.echo:
                    self._echoing[record.request_id] = deque(prompt)
        for request_id, left in list(self._echoing.items()):
            chunk = tuple(left.popleft() for _ in range(min(self.echo, len(left))))
            finish = FinishReason.NONE if left else FinishReason.LENGTH
            self._outbox.append(ResponseRecord(request_id, chunk, finish))
            if not left:
                del self._echoing[request_id]
        published = self.ring.publish(list(self._outbox))
        for _ in range(published):
            self._outbox.popleft()
        if self.beating:
            self.ring.beat()
        self.exchanges += 1
        self._changed.set()


class LoopbackTransport(Transport):
    def __init__(self, gpu: LoopbackGpu) -> None:
        self.gpu = gpu
        self.closed = False

    def attach(self, region: Mapping[str, Any], size: int,
               remote: Mapping[str, Any] | None) -> None:
        """The memory is already there."""

    async def exchange(self, writes: list[WriteOp], reads: list[ReadOp]) -> list[bytes]:
        gpu = self.gpu
        if self.closed:
            raise TransportError("loopback transport closed")
        if gpu.failure is not None:
            raise gpu.failure
        for op in writes:
            if len(op.data) == 8 and op.offset % 8 == 0:
                gpu.mem.store_release(op.offset, int.from_bytes(op.data, "little"))
            else:
                gpu.mem.write(op.offset, op.data)
        gpu.step()
        return [gpu.mem.read(op.offset, op.length) for op in reads]

    def close(self) -> None:
        self.closed = True


class LoopbackSession:
    def __init__(self, gpu: LoopbackGpu) -> None:
        self.gpu = gpu
        self.transport = LoopbackTransport(gpu)
        self.channel = DpuChannel(gpu.channel_layout, gpu.epoch, time.monotonic())
        self.closed = False

    async def ended(self) -> None:
        await self.gpu.hung_up.wait()

    async def close(self) -> None:
        self.transport.close()
        self.closed = True


class LoopbackPeer:
    """A ``Connector``: every connection a new attachment of one channel."""

    def __init__(self, geometry: Geometry = SMALL, *, echo: int = 0) -> None:
        self.geometry = geometry
        self.echo = echo
        self.refusal: DpuFrontendError | None = None  # the next connections fail with it
        self.sessions: list[LoopbackSession] = []
        self._epochs = itertools.count(1)
        self._connected = asyncio.Event()

    async def connect(self, config: ServeConfig, address: PeerAddress) -> LoopbackSession:
        if self.refusal is not None:
            raise self.refusal
        session = LoopbackSession(LoopbackGpu(self.geometry, next(self._epochs), self.echo))
        self.sessions.append(session)
        self._connected.set()
        return session

    @property
    def gpu(self) -> LoopbackGpu:
        """The current attachment."""
        return self.sessions[-1].gpu

    async def wait_sessions(self, count: int) -> LoopbackGpu:
        async def connected() -> None:
            while len(self.sessions) < count:
                self._connected.clear()
                await self._connected.wait()

        await within(connected(), f"session {count}")
        return self.gpu
