"""The shared-memory twin of the verbs transport.

The peer's region is a file (normally under /dev/shm) that both processes
map. A WRITE is a copy into the mapping at the same offset, a READ a copy out.
RC's ordering is made explicit with barriers, because the daemon runs on Arm
cores where plain stores and loads may become visible out of program order:

* a release fence before each WRITE: it becomes visible only after every
  earlier WRITE, as RC places the WRITEs of one QP in order (a record's
  commit word after its body);
* an acquire fence after each READ: no later READ is satisfied before it, as
  a fenced RDMA READ starts only once the one before completed (the records
  after the control block that published them).

An 8-byte WRITE (a commit word, a counter) is one release store, and a READ
of a control block (up to 128 bytes) is one acquire load per word, so that no
marker is ever seen torn, whatever ``memcpy`` does.

The GPU side pairs them with release stores of its markers and acquire loads
of ours (``ring/gpu.py``, the CUDA kernel).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from typing import Any

from dpu_frontend.errors import PeerError, TransportError
from dpu_frontend.ring import ReadOp, WriteOp
from dpu_frontend.ring.memory import AtomicMemory, fence_acquire, fence_release
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


#: READs up to this size (control blocks) are taken word by word with acquire loads.
SMALL_READ = 128


class ShmTransport(Transport):
    def __init__(self, path: str = "", size: int = 0) -> None:
        self.path = path
        self.size = size
        self._map: mmap.mmap | None = None
        self._atomic: AtomicMemory | None = None

    def attach(self, region: Mapping[str, Any], size: int,
               remote: Mapping[str, Any] | None) -> None:
        path = region.get("path")
        if not isinstance(path, str) or not path:
            raise PeerError(f"shm region without a path: {dict(region)!r}")
        self.path, self.size = path, size
        self.start()

    def start(self) -> None:
        self._map = map_file(self.path, self.size, create=False)
        self._atomic = AtomicMemory(self._map)

    def _mapping(self) -> mmap.mmap:
        if self._map is None or self._map.closed:
            raise TransportError(f"shared-memory region {self.path} is not mapped")
        return self._map

    async def exchange(self, writes: list[WriteOp], reads: list[ReadOp]) -> list[bytes]:
        mem = self._mapping()
        atomic = self._atomic
        if atomic is None:
            raise TransportError(f"shared-memory region {self.path} is not mapped")
        for w in writes:
            self._check(w.offset, len(w.data))
            if len(w.data) == 8 and w.offset % 8 == 0:
                atomic.store_release(w.offset, int.from_bytes(w.data, "little"))
            else:
                fence_release()
                mem[w.offset:w.offset + len(w.data)] = w.data
        out = []
        for r in reads:
            self._check(r.offset, r.length)
            fence_release()  # a READ sees every WRITE posted before it
            if r.length <= SMALL_READ and r.length % 8 == 0 and r.offset % 8 == 0:
                out.append(b"".join(atomic.load_acquire(r.offset + i).to_bytes(8, "little")
                                    for i in range(0, r.length, 8)))
            else:
                out.append(mem[r.offset:r.offset + r.length])
                fence_acquire()
        return out

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or offset + length > self.size:
            raise TransportError(f"access [{offset}, {offset + length}) outside the region")

    def close(self) -> None:
        if self._atomic is not None:
            self._atomic.release()
            self._atomic = None
        if self._map is not None and not self._map.closed:
            self._map.close()
        self._map = None
