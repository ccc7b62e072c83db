"""One interface for moving bytes to and from the GPU peer's ring memory.

``verbs`` (the product) turns each operation into an RDMA WRITE or READ on
one RC QP; ``shm`` (development and tests) into a copy inside a shared-memory
file. Both are driven by the same sans-I/O ``DpuChannel``.

A transport runs one batch at a time (the channel's poll loop awaits each
call), which lets the verbs side stage every batch at the start of a single
registered buffer.
"""

from __future__ import annotations

import abc

from dpu_frontend.ring import ReadOp, WriteOp


class Transport(abc.ABC):
    """The DPU's view of one channel of a peer's region."""

    @abc.abstractmethod
    async def write(self, ops: list[WriteOp]) -> None:
        """Apply ``ops`` in order; return once all of them are placed."""

    @abc.abstractmethod
    async def read(self, op: ReadOp) -> bytes:
        """Fetch the bytes ``op`` names."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource; idempotent."""
