"""One interface for moving bytes to and from the GPU peer's ring memory.

``verbs`` (the product) turns each operation into an RDMA WRITE or READ on
one RC QP; ``shm`` (development and tests) into a copy inside a shared-memory
file, with the barriers RC gives. Both are driven by the same sans-I/O
``DpuChannel``.

A transport runs one batch at a time (the channel's poll loop awaits each
call), which lets the verbs side stage every batch in a single registered
buffer.
"""

from __future__ import annotations

import abc

from dpu_frontend.ring import ReadOp, WriteOp


class Transport(abc.ABC):
    """The DPU's view of one channel of a peer's region."""

    @abc.abstractmethod
    async def exchange(self, writes: list[WriteOp], reads: list[ReadOp]) -> list[bytes]:
        """Post ``writes`` in order, then ``reads`` in order, as one batch, and return
        what each READ fetched.

        The semantics are those of one RC QP: WRITEs are placed in order, a READ
        sees every WRITE posted before it, and every READ after the first is
        *fenced*: it starts only once the READs before it have completed (a poll
        reads the control block, then records published below the index it saw).
        """

    async def write(self, ops: list[WriteOp]) -> None:
        await self.exchange(ops, [])

    async def read(self, op: ReadOp) -> bytes:
        return (await self.exchange([], [op]))[0]

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource; idempotent."""
