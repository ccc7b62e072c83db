"""The verbs transport against memory registered by another QP on the same rxe device."""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Iterator
from itertools import pairwise

import pytest

from dpu_frontend.errors import TransportError
from dpu_frontend.ring import ReadOp, WriteOp
from dpu_frontend.softroce.harness import RXE_IP
from dpu_frontend.transport.verbs.resources import RdmaResources
from dpu_frontend.transport.verbs.transport import POST_CHUNK, VerbsTransport, pin

pytestmark = pytest.mark.rdma

REGION = 64 * 1024


class Remote:
    """The GPU side's half: a registered region and a QP that never posts."""

    def __init__(self) -> None:
        self.resources = RdmaResources(ip=RXE_IP)
        self.resources.open()
        self.map = mmap.mmap(-1, REGION)
        self.address, self.anchor = pin(self.map)
        self.mr = self.resources.register(self.address, REGION, remote=True)
        self.qp = self.resources.create_qp()

    def close(self) -> None:
        self.resources.close()
        del self.anchor
        self.map.close()


@pytest.fixture
def pair() -> Iterator[tuple[VerbsTransport, Remote]]:
    remote = Remote()
    local_res = RdmaResources(ip=RXE_IP)
    local_res.open()
    transport = VerbsTransport(local_res, staging_bytes=REGION)
    local = transport.start()
    remote_info = remote.resources.local_info(remote.qp)
    remote.resources.to_rts(remote.qp, remote_info, local)
    transport.connect(remote_info, remote.address, remote.mr.rkey, REGION)
    yield transport, remote
    transport.close()
    local_res.close()
    remote.close()


def overlapping_writes(count: int) -> list[WriteOp]:
    """WRITE ``i`` puts its own 2-byte pattern, 32 to 96 bytes of it, at ``24 * i``:
    each one's tail is overwritten by the next one to three."""
    return [WriteOp(24 * i, i.to_bytes(2, "little") * (16 + 8 * (i % 5))) for i in range(count)]


def placed(ops: Iterable[WriteOp]) -> bytes:
    """The region after ``ops`` are applied one after another."""
    region = bytearray(REGION)
    for op in ops:
        region[op.offset:op.offset + len(op.data)] = op.data
    return bytes(region)


async def test_overlapping_writes_land_in_order_and_a_read_returns_them(
        pair: tuple[VerbsTransport, Remote]) -> None:
    transport, remote = pair
    ops = overlapping_writes(600)
    assert len(ops) > 2 * POST_CHUNK  # posted in several chunks
    # Every WRITE overlaps the next, whose first 24 bytes no later one touches: any two
    # neighbours placed the other way round leave different bytes there.
    assert all(a.offset + len(a.data) > b.offset for a, b in pairwise(ops))
    expected = placed(ops)
    await transport.write(ops)
    assert remote.map[:] == expected  # the whole region, not a sample
    written = max(op.offset + len(op.data) for op in ops)
    assert await transport.read(ReadOp(0, written)) == expected[:written]
    remote.map[REGION - 8:] = b"ABCDEFGH"
    assert await transport.read(ReadOp(REGION - 8, 8)) == b"ABCDEFGH"


async def test_a_remote_access_error_is_a_typed_error(
        pair: tuple[VerbsTransport, Remote]) -> None:
    transport, _ = pair
    transport.region_size = REGION * 4  # lie about the region: the NIC must refuse
    with pytest.raises(TransportError, match="IBV_WC_REM_ACCESS_ERR"):
        await transport.read(ReadOp(REGION * 2, 64))


async def test_one_batch_of_writes_then_fenced_reads_sees_every_write(
        pair: tuple[VerbsTransport, Remote]) -> None:
    """A poll's batch: more WRITEs than one post chunk, then two READs (the second
    fenced) in the same exchange; each READ returns what the WRITEs before it put there."""
    transport, remote = pair
    writes = [WriteOp(i * 64, bytes([i % 251]) * 64) for i in range(300)]
    first, last = ReadOp(0, 64), ReadOp(299 * 64, 64)
    assert await transport.exchange(writes, [first, last]) == [writes[0].data, writes[-1].data]
    remote.map[128:136] = b"12345678"  # the GPU side stores between two polls
    assert await transport.exchange([], [ReadOp(128, 8), ReadOp(0, 8)]) == [
        b"12345678", writes[0].data[:8]]
