"""One interface for moving bytes to and from the GPU peer's ring memory.

``verbs`` (the product) turns each operation into an RDMA WRITE or READ on
one RC QP; ``shm`` (development and tests) into a copy inside a shared-memory
file, with the barriers RC gives. Both are driven by the same sans-I/O
``DpuChannel``.

A transport runs one batch at a time (the channel's poll loop awaits each
call), which lets the verbs side stage every batch in a single registered
buffer.

Its life follows the bootstrap (docs/protocol.md section 7): ``offer`` sets
up the local end and says what the hello carries, ``attach`` reaches the
region the welcome describes, ``reserve`` sizes it for the channel's largest
batch, then ``exchange`` until ``close``. ``transport/factory.py`` picks the
class from the configuration, so the session never asks which one it holds.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

from dpu_frontend.config import ServeConfig
from dpu_frontend.ring import ReadOp, WriteOp


class Transport(abc.ABC):
    """The DPU's view of one channel of a peer's region."""

    #: Bytes move by RDMA: the daemon needs an RDMA device and pyverbs, and registers
    #: (pins) its staging memory.
    rdma: ClassVar[bool] = False

    @classmethod
    def for_config(cls, config: ServeConfig) -> Transport:
        """A transport for one session of ``config``'s daemon."""
        return cls()

    def offer(self) -> dict[str, Any] | None:
        """Set up the local end; what the hello carries to the peer (verbs: the QP)."""
        return None

    @abc.abstractmethod
    def attach(self, region: Mapping[str, Any], size: int,
               remote: Mapping[str, Any] | None) -> None:
        """Reach the ``size``-byte region the peer's welcome describes (``region``,
        and ``remote``, the peer's QP, for verbs). Raises ``PeerError`` when the
        description is unusable."""

    def reserve(self, nbytes: int) -> None:
        """Make room for batches of up to ``nbytes`` (verbs: the staging buffer)."""
        return  # a copy needs no room of its own

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
