"""One request on a channel's rings: its response records as its handler consumes them.

(A *stream* is what the client sees: the SSE response of ``stream: true``.
A ``RingRequest`` is one sequence on the ring, one request id; a request
with ``n`` choices has ``n`` of them.)
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from dpu_frontend.errors import DpuFrontendError
from dpu_frontend.ring import ResponseRecord

#: Takes a record (and when the poll read it) at once, in the poll loop: True when it
#: did, False to have it buffered and the reader woken as without one.
Direct = Callable[[ResponseRecord, float], bool]


class RingRequest:
    """Records of one request, in order, ending with a final one (or an error).

    The buffer holds at most ``limit`` records: a client that reads slower
    than the GPU writes is cut off (``overflowed``) instead of buffered
    without bound. Iterating raises the error the link ended it with.
    """

    def __init__(self, request_id: int, cost: int, limit: int,
                 on_cancel: Callable[[RingRequest], None]) -> None:
        self.request_id = request_id
        self.cost = cost  # outstanding tokens charged to its link until it ends
        self.limit = limit
        self._on_cancel = on_cancel
        self.submitted_at = time.monotonic()
        self.finished = False  # nothing more will be put
        self.cancel_sent = False  # a cancel record is on its way: never send two
        self._records: deque[ResponseRecord] = deque()
        self._error: DpuFrontendError | None = None
        self._waiter: asyncio.Future[None] | None = None  # the reader, waiting
        #: When the oldest record still buffered arrived (time.monotonic()).
        self.received_at = 0.0
        #: Set by a reader that can take records in the poll loop (``Generation.attach``):
        #: offered each record that finds the reader parked in ``wait`` with nothing
        #: buffered, so that the order of records is kept whichever path each takes.
        self.direct: Direct | None = None

    def put(self, record: ResponseRecord, now: float) -> bool:
        """Hand over a record the poll read at ``now``: to ``direct``, or into the buffer;
        False when the buffer is full (the caller cuts the stream)."""
        if self.finished:
            return True
        records = self._records
        if not records:
            direct, waiter = self.direct, self._waiter
            # The reader parked, and not cancelled there (its task not yet run since).
            if direct is not None and waiter is not None and not waiter.done() \
                    and direct(record, now):
                return True
            self.received_at = now
        elif len(records) >= self.limit:
            return False
        records.append(record)
        self.finished = record.finish != 0  # record.final, without the property call
        self._wake()
        return True

    def cancel(self) -> None:
        """The reader is leaving: stop the generation on the GPU side."""
        if not self.drained:
            self._on_cancel(self)

    def abandon(self) -> None:
        """Nothing will read further: drop what is buffered and what still comes."""
        self.finished = True
        self._records.clear()

    def fail(self, error: DpuFrontendError) -> None:
        if not self.finished:
            self.finished = True
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> RingRequest:
        return self

    async def __anext__(self) -> ResponseRecord:
        if not await self.wait():
            raise StopAsyncIteration
        return self._records.popleft()

    async def wait(self) -> bool:
        """Until a record is here (True) or none will come (False); raises the error the
        request ended with, once the records before it are read."""
        while not self._records:
            if self._error is not None:
                raise self._error
            if self.finished:
                return False
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return True

    def take(self) -> list[ResponseRecord]:
        """Every record here now, in order (a poll's worth, when the reader kept up)."""
        records = list(self._records)
        self._records.clear()
        return records

    @property
    def drained(self) -> bool:
        """Finished and fully read."""
        return self.finished and not self._records
