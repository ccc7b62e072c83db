"""Ordering tests that can fail: the other side runs at every point, on every lap.

``interleave.py`` runs the daemon's half and the GPU's half of a channel as two
programs on one region. Here every schedule ``schedules.py`` makes of the
lockstep run must deliver every request and every record whole and in order:
the DPU after each load and store of the GPU (another warp moving the producer
index first), the GPU after each WRITE and READ of a DPU poll, the DPU after
every GPU access at once, and seeded schedules that cut polls anywhere. The
rings are small, so they are full at times and wrap many times.

Each reordering is also written as a deliberately broken half below, and the
same exploration must fail on it, counting only the points after both rings
have wrapped: there a slot read too early holds an older record of the same
epoch, so nothing but the order (and the checks that depend on it) can catch
it. A zeroed slot of the first lap carries epoch 0, which any epoch check
refuses, whatever the order. Every such schedule runs, and none may deliver a
wrong record where the DPU's sequence check could have refused it. The
issue's script for credits (a full ring, the GPU publishing between a poll's
WRITEs and its READs) is a test of its own.

* ``CommitFirst``: a request's commit WRITE before its body;
* ``ConsumedEarly``: req_consumed stored as soon as the commit word matches, or
  between the body and the prompt: the DPU rewrites the slot or the arena span
  before the GPU has read it;
* ``EarlyCredit``: a poll's credit WRITE releases the records its own window
  READ has yet to fetch: the GPU publishes into them first;
* ``WindowFirst``: the window READ before the control READ;
* ``ProducedFirst``: resp_produced stored before the records it covers;
* ``SeqFirst``: a record's seq stored before its body.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dpu_frontend.errors import ProtocolError
from dpu_frontend.ring import (
    DpuChannel,
    GenerateRecord,
    Geometry,
    GpuChannel,
    Poll,
    ReadOp,
    ResponseRecord,
    WriteOp,
)
from dpu_frontend.ring.gpu import CheckedCache, Taken
from dpu_frontend.ring.layout import DPU_CTRL, GPU_CTRL_STRUCT
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.ring.records import COMMIT, decode_request

from .interleave import GEOMETRIES, apply, run
from .schedules import Seeded, everywhere, explore, failures, schedules

REQ_CONSUMED = GPU_CTRL_STRUCT.offset("req_consumed")

# -- the daemon's half, broken on purpose ----------------------------------------------


class CommitFirst(DpuChannel):
    """Each commit WRITE goes before the body it commits."""

    def take_writes(self) -> tuple[list[WriteOp], list[int]]:
        writes, sent = super().take_writes()
        out: list[WriteOp] = []
        for op in writes:
            if len(op.data) == COMMIT.size and out and op.offset + 8 == out[-1].offset:
                out.insert(len(out) - 1, op)
            else:
                out.append(op)
        return out, sent


class EarlyCredit(DpuChannel):
    """The credit WRITE of a poll also releases the records its window READ is to fetch."""

    def begin_poll(self) -> Poll:
        poll = super().begin_poll()
        if len(poll.reads) < 2:
            return poll
        window = poll.reads[1]
        released = window.position + window.count
        self._resp_published = released  # its own bound on resp_produced moves with it
        credit = WriteOp(self.layout.dpu_ctrl_offset, DPU_CTRL.pack(released))
        return Poll([*poll.writes, credit], poll.reads, poll.sent)


class WindowFirst(DpuChannel):
    """The record window is READ before the control block."""

    def begin_poll(self) -> Poll:
        poll = super().begin_poll()
        return Poll(poll.writes, poll.reads[::-1], poll.sent)

    def end_poll(self, poll: Poll, data: Sequence[bytes | memoryview],
                 now: float) -> tuple[list[ResponseRecord], list[ReadOp]]:
        return super().end_poll(Poll(poll.writes, poll.reads[::-1], poll.sent), data[::-1], now)


# -- the GPU's half, broken on purpose ---------------------------------------------------


class ConsumedEarly(GpuChannel):
    """req_consumed is released as soon as a record's commit word matches (``AFTER``
    "commit"), or once its body is read ("body"), before its prompt is copied out."""

    AFTER = "commit"

    def poll_requests(self, cached: CheckedCache | None = None) -> list[Taken]:
        out: list[Taken] = []
        lay, mem = self.layout, self.mem
        while mem.load_acquire(lay.req_slot_offset(self.consumed + 1)) == self.consumed + 1:
            seq = self.consumed + 1
            self._next_seq = seq + 1
            if self.AFTER == "commit":
                mem.store_release(lay.gpu_ctrl_offset + REQ_CONSUMED, seq)
            record = decode_request(mem.read(lay.req_slot_offset(seq), lay.req_slot_size), self.epoch)
            if self.AFTER == "body":
                mem.store_release(lay.gpu_ctrl_offset + REQ_CONSUMED, seq)
            assert isinstance(record, GenerateRecord)  # this traffic has no cancels
            out.append(Taken(record, self._read_prompt(record)))
        return out


class ConsumedBeforePrompt(ConsumedEarly):
    AFTER = "body"


class ProducedFirst(GpuChannel):
    """resp_produced moves before the records it covers exist."""

    def publish(self, records: list[ResponseRecord]) -> int:
        positions = self.reserve(len(records))
        self.mem.store_release(self.layout.gpu_ctrl_offset, positions.stop)
        for position, record in zip(positions, records, strict=False):
            self.write(position, record)
        self._produced = positions.stop
        return len(positions)


class SeqFirst(GpuChannel):
    """A record's seq is stored before its body."""

    def write(self, position: int, record: ResponseRecord) -> None:
        self.mem.store_release(self.layout.resp_slot_offset(position), position + 1)
        super().write(position, record)


# -- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
@pytest.mark.parametrize("later", [False, True], ids=["first-lap", "after-both-rings-wrapped"])
def test_the_other_side_may_run_at_every_point(later: bool, geometry: Geometry) -> None:
    """The DPU after each GPU load and store, the GPU after each WRITE and READ of a poll:
    on the first lap of either ring, where a slot read too early is zero, and after,
    where it holds an older record of this epoch."""
    assert explore(geometry, later=later) > (150 if later else 25)


@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_the_dpu_may_run_after_every_gpu_access(geometry: Geometry) -> None:
    run(geometry, everywhere)


@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_seeded_schedules_cut_polls_and_steps_anywhere(geometry: Geometry) -> None:
    for seed in range(100):
        run(geometry, Seeded(seed))


def check_credits(dpu_type: type[DpuChannel]) -> None:
    """The ring full, the GPU publishes between a poll's WRITEs and its READs: it must find
    no slot that the poll's window READ is still to fetch."""
    plan = Geometry(req_slots=2, resp_slots=4, max_sequences=2, arena_bytes=256).plan(instance=5)
    layout, mem = plan.channels[0], AtomicMemory(bytearray(plan.region_size))
    gpu, dpu = GpuChannel(mem, layout), dpu_type(layout, 1)
    gpu.reset(1)
    first = [ResponseRecord(1, (i,)) for i in range(4)]
    assert gpu.publish(first) == 4
    poll = dpu.begin_poll()
    for op in poll.writes:
        apply(mem, op)
    assert gpu.publish([ResponseRecord(2, (9,))]) == 0, "a credit released an unread slot"
    records, _ = dpu.end_poll(poll, [mem.read(r.offset, r.length) for r in poll.reads], 1.0)
    assert records == first


def test_a_credit_releases_no_slot_the_same_polls_window_is_to_fetch() -> None:
    check_credits(DpuChannel)


def test_a_credit_for_the_window_is_caught_by_the_script() -> None:
    with pytest.raises(AssertionError, match="released an unread slot"):
        check_credits(EarlyCredit)


DELIVERED = "the DPU decoded"  # a wrong record delivered: no check caught it
BROKEN: dict[str, tuple[type[DpuChannel], type[GpuChannel], str]] = {
    # name: (DPU half, GPU half, how a schedule it breaks fails)
    "commit before body": (CommitFirst, GpuChannel, "the GPU took"),
    "req_consumed at the commit": (DpuChannel, ConsumedEarly, "the GPU took"),
    "req_consumed before the prompt": (DpuChannel, ConsumedBeforePrompt, "the GPU took"),
    "credit before the window READ": (EarlyCredit, GpuChannel, "carries sequence"),
    "window READ before control READ": (WindowFirst, GpuChannel, "carries sequence"),
    "resp_produced before the records": (DpuChannel, ProducedFirst, "carries sequence"),
    # Nothing in the record tells: the DPU delivers the last lap's.
    "seq before body": (DpuChannel, SeqFirst, DELIVERED),
}


#: Halves so broken that the lockstep run fails before the rings wrap: the credit covers
#: records that no READ has fetched, so the GPU overwrites one on the first lap. No later
#: point can be explored (the run never gets there); they fail there, on every lap.
#: (A subtler form, a credit for records the poll has learned of but not yet read, cannot
#: be written against this DpuChannel: a poll reads everything it learns of.)
FAIL_IN_LOCKSTEP = {"credit before the window READ"}


@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
@pytest.mark.parametrize("broken", BROKEN, ids=lambda name: name.replace(" ", "-"))
def test_each_reordering_fails_after_the_rings_wrapped(broken: str, geometry: Geometry) -> None:
    """Some schedule of the points after both rings wrapped fails as it should, and none
    that a check could catch delivers a wrong record: one torn record slipping past the
    DPU's sequence check, where another was refused, fails the test. The halves of
    ``FAIL_IN_LOCKSTEP`` fail the lockstep run itself, as they should."""
    dpu_type, gpu_type, failure = BROKEN[broken]
    if broken in FAIL_IN_LOCKSTEP:
        with pytest.raises(ProtocolError, match=failure):
            schedules(geometry, dpu_type, gpu_type, later=True)
        return
    found = [str(exc) for exc in failures(geometry, dpu_type, gpu_type, later=True)]
    assert any(failure in message for message in found), found[:3]
    if failure != DELIVERED:
        assert not [m for m in found if DELIVERED in m], "a wrong record was delivered"
