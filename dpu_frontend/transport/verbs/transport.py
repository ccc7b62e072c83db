"""The product transport: RDMA WRITE and READ on one RC QP with pyverbs.

Every batch (the WRITEs and READs of one poll) is staged in one registered
buffer, posted with one signalled WR at its end, and waited for by polling
the CQ from the event loop. pyverbs' blocking
completion-channel call holds the GIL on older rdma-core, so it is never
used: a short spin of ``sleep(0)`` yields (RDMA completes in microseconds on
real hardware) then a backoff of short sleeps, so the loop keeps serving
HTTP while an operation is in flight.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import mmap
import time
from collections.abc import Mapping
from typing import Any

from dpu_frontend.config import RdmaConfig, ServeConfig
from dpu_frontend.errors import PeerError, TransportError
from dpu_frontend.ring import ReadOp, WriteOp
from dpu_frontend.ring.layout import HEADER_SIZE
from dpu_frontend.transport.base import Transport
from dpu_frontend.transport.verbs import compat
from dpu_frontend.transport.verbs.resources import SQ_DEPTH, QpInfo, RdmaResources

log = logging.getLogger("dpu_frontend.rdma")

#: Spins of ``sleep(0)`` before backing off to timed sleeps.
SPIN_YIELDS = 64
#: A completion that has not arrived by now will not: the RC retry budget
#: (8 tries of the ack timeout: 0.5 s on hardware, 8.6 s on soft-RoCE) is spent by then.
COMPLETION_DEADLINE_S = 10.0
#: WRs posted before waiting for the last one (bounded by the send queue).
POST_CHUNK = SQ_DEPTH // 2


def pin(buf: mmap.mmap) -> tuple[int, ctypes.c_char]:
    """The virtual address of an mmap, for memory registration.

    The returned ctypes object holds a buffer export: while it lives the
    mapping cannot be closed under a registered MR.
    """
    anchor = ctypes.c_char.from_buffer(buf)
    return ctypes.addressof(anchor), anchor


class VerbsTransport(Transport):
    rdma = True

    def __init__(self, resources: RdmaResources, staging_bytes: int, *,
                 owns_resources: bool = False) -> None:
        self.resources = resources
        self._owns_resources = owns_resources  # close them too (the daemon's one QP each)
        self.staging_bytes = staging_bytes
        self.qp: Any = None
        self.local: QpInfo | None = None
        self.remote_addr = 0
        self.rkey = 0
        self.region_size = 0
        self._staging: mmap.mmap | None = None
        self._mr: Any = None
        self._address = 0
        self._anchor: ctypes.c_char | None = None
        self._ids = itertools.count(1)

    @classmethod
    def open(cls, rdma: RdmaConfig, staging_bytes: int) -> VerbsTransport:
        """Open the device (context, PD, CQ) for a transport that owns it."""
        resources = RdmaResources(rdma.device, rdma.ip)
        resources.open()
        return cls(resources, staging_bytes, owns_resources=True)

    @classmethod
    def for_config(cls, config: ServeConfig) -> VerbsTransport:
        """The session's own device and QP; its staging buffer starts at the size of the
        layout header, the first thing read."""
        return cls.open(config.rdma, staging_bytes=HEADER_SIZE)

    def offer(self) -> dict[str, Any]:
        return self.start().to_dict()

    def attach(self, region: Mapping[str, Any], size: int,
               remote: Mapping[str, Any] | None) -> None:
        if remote is None:
            raise PeerError("peer sent no QP description")
        try:
            info = QpInfo.from_dict(dict(remote))
            addr, rkey = int(region["addr"]), int(region["rkey"])
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerError(f"peer described its region or QP badly: {exc!r}") from exc
        self.connect(info, addr, rkey, size)

    def start(self) -> QpInfo:
        """Register the staging buffer and create the QP; return what the peer needs."""
        self.reserve(self.staging_bytes)
        self.qp = self.resources.create_qp()
        self.local = self.resources.local_info(self.qp)
        return self.local

    def reserve(self, nbytes: int) -> None:
        """Make the staging buffer at least ``nbytes`` (set-up only: it re-registers)."""
        if self._staging is not None and nbytes <= self.staging_bytes:
            return
        self._release_staging()
        self.staging_bytes = max(nbytes, 4096)
        self._staging = mmap.mmap(-1, self.staging_bytes)
        self._address, self._anchor = pin(self._staging)
        self._mr = self.resources.register(self._address, self.staging_bytes, remote=False)

    def connect(self, remote: QpInfo, addr: int, rkey: int, size: int) -> None:
        if self.local is None:
            raise TransportError("transport not started")
        self.resources.to_rts(self.qp, self.local, remote)
        self.remote_addr, self.rkey, self.region_size = addr, rkey, size

    async def exchange(self, writes: list[WriteOp], reads: list[ReadOp]) -> list[bytes]:
        try:
            return await self._exchange(writes, reads)
        except TransportError as exc:
            exc.opcode = "read" if reads else "write"
            raise

    async def _exchange(self, writes: list[WriteOp], reads: list[ReadOp]) -> list[bytes]:
        """Stage every WRITE, then room for every READ, in the one staging buffer; post
        them all (WRITEs unsignalled, READs after the first fenced, the last WR
        signalled) and wait for that one completion: RC completes a QP's WRs in
        order, so it covers them all. One doorbell batch, one round trip."""
        write_at = self._stage(writes)
        cursor = write_at[-1] + len(writes[-1].data) if writes else 0
        read_at: list[int] = []
        for op in reads:
            self._check(op.offset, op.length)
            cursor = (cursor + 63) & ~63
            read_at.append(cursor)
            cursor += op.length
        if cursor > self.staging_bytes:
            raise TransportError(f"batch of {cursor} bytes exceeds staging ({self.staging_bytes})")
        posts = [(compat.enum("IBV_WR_RDMA_WRITE"), local, len(op.data), op.offset, 0)
                 for op, local in zip(writes, write_at, strict=True)]
        fence = compat.enum("IBV_SEND_FENCE")
        posts += [(compat.enum("IBV_WR_RDMA_READ"), local, op.length, op.offset, fence if i else 0)
                  for i, (op, local) in enumerate(zip(reads, read_at, strict=True))]
        for start in range(0, len(posts), POST_CHUNK):
            chunk = posts[start:start + POST_CHUNK]
            last = 0
            for i, (opcode, local, length, remote, flags) in enumerate(chunk):
                last = self._post(opcode, local, length, remote, flags,
                                  signaled=i == len(chunk) - 1)
            await self._wait(last)
        staging = self._staging
        if staging is None:
            raise TransportError("transport closed during a batch")
        return [staging[local:local + op.length] for op, local in zip(reads, read_at, strict=True)]

    def _stage(self, ops: list[WriteOp]) -> list[int]:
        """Copy each op's bytes into staging, one after another; return their offsets."""
        staging = self._staging
        if staging is None:
            raise TransportError("transport not started")
        offsets, cursor = [], 0
        for op in ops:
            self._check(op.offset, len(op.data))
            end = cursor + len(op.data)
            if end > self.staging_bytes:
                raise TransportError(f"write batch of more than {self.staging_bytes} bytes")
            staging[cursor:end] = op.data
            offsets.append(cursor)
            cursor = (end + 7) & ~7
        return offsets

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or offset + length > self.region_size:
            raise TransportError(f"access [{offset}, {offset + length}) outside the peer region")

    def _post(self, opcode: int, local_offset: int, length: int, remote_offset: int,
              flags: int, *, signaled: bool) -> int:
        wr_mod = compat.module("wr")
        wr_id = next(self._ids)
        sge = wr_mod.SGE(self._address + local_offset, length, self._mr.lkey)
        flags |= compat.enum("IBV_SEND_SIGNALED") if signaled else 0
        wr = wr_mod.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=flags)
        wr.set_wr_rdma(self.rkey, self.remote_addr + remote_offset)
        try:
            self.qp.post_send(wr)
        except compat.module("errors").PyverbsError as exc:
            raise TransportError(f"post_send failed: {exc}") from exc
        return wr_id

    async def _wait(self, wr_id: int) -> None:
        """Poll the CQ until ``wr_id`` completes; any error completion raises."""
        deadline = time.monotonic() + COMPLETION_DEADLINE_S
        spins, delay = 0, 0.0
        while True:
            n, wcs = self.resources.cq.poll(16)
            for wc in wcs[:n]:
                if wc.status != compat.enum("IBV_WC_SUCCESS"):
                    raise TransportError(
                        f"RDMA completion error {compat.status_name(wc.status)} "
                        f"(vendor {wc.vendor_err}) on wr {wc.wr_id}: the QP is in error"
                    )
                if wc.wr_id == wr_id:
                    return
            if n:
                continue
            if time.monotonic() > deadline:
                raise TransportError(f"no completion for wr {wr_id} in {COMPLETION_DEADLINE_S}s")
            spins += 1
            if spins < SPIN_YIELDS:
                await asyncio.sleep(0)
            else:
                delay = min(0.001, delay * 2 or 0.00005)
                await asyncio.sleep(delay)

    def close(self) -> None:
        """QP, then staging MR, then (when owned) PD and context."""
        if self.qp is not None:
            self.resources.destroy_qp(self.qp)
            self.qp = None
        self._release_staging()
        if self._owns_resources:
            self.resources.close()

    def _release_staging(self) -> None:
        if self._mr is not None:
            self.resources.deregister(self._mr)
            self._mr = None
        if self._staging is not None:
            self._anchor = None  # drop the export before unmapping
            self._staging.close()
            self._staging = None
