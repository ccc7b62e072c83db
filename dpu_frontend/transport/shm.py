"""The shared-memory twin of the verbs transport.

The peer's region is a file (normally under /dev/shm) that both processes
map. A WRITE is a copy into the mapping at the same offset, a READ a copy out.
On x86-64 the stores of one copy become visible to the other process in
program order, which is the ordering RC gives RDMA WRITEs of one QP.
"""

from __future__ import annotations

import mmap
import os

from dpu_frontend.errors import TransportError
from dpu_frontend.ring import ReadOp, WriteOp
from dpu_frontend.transport.base import Transport


def map_file(path: str, size: int, *, create: bool) -> mmap.mmap:
    """Map ``size`` bytes of ``path``; with ``create``, make (or truncate) it first."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise TransportError(f"cannot open shared-memory region {path}: {exc}") from exc
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise TransportError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class ShmTransport(Transport):
    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        self._map: mmap.mmap | None = None

    def start(self) -> None:
        self._map = map_file(self.path, self.size, create=False)

    def _mapping(self) -> mmap.mmap:
        if self._map is None or self._map.closed:
            raise TransportError(f"shared-memory region {self.path} is not mapped")
        return self._map

    async def write(self, ops: list[WriteOp]) -> None:
        mem = self._mapping()
        for op in ops:
            self._check(op.offset, len(op.data))
            mem[op.offset:op.offset + len(op.data)] = op.data

    async def read(self, op: ReadOp) -> bytes:
        self._check(op.offset, op.length)
        return self._mapping()[op.offset:op.offset + op.length]

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or offset + length > self.size:
            raise TransportError(f"access [{offset}, {offset + length}) outside the region")

    def close(self) -> None:
        if self._map is not None and not self._map.closed:
            self._map.close()
        self._map = None
