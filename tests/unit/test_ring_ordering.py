"""Ordering tests that can fail: the other side runs between every WRITE and every store.

The pump of test_ring_pump.py applies a whole batch before the other side
looks, so it passes even when a writer puts a marker before the data it
covers. Here the reader runs after *each* operation:

* DPU -> GPU: the request WRITEs of a batch are applied one at a time, and the
  GPU side polls its request ring after each;
* GPU -> DPU: every store the GPU side makes goes through ``Interleaving``,
  which then lets another warp advance the producer index and the DPU poll.

Each check is also run against a deliberately broken writer and must fail
there, which shows it catches that reordering:

* ``CommitFirst`` writes a request's commit word before its body: the GPU
  reads the previous lap's (here: zero) body, refuses it as a record of
  another epoch, and the request is lost -> ``test_commit_before_body_is_caught``;
* ``ProducedFirst`` stores ``resp_produced`` before the records it covers: the
  DPU reads a slot whose ``seq`` is stale -> ``test_produced_before_records_is_caught``;
* ``SeqFirst`` stores a record's ``seq`` before its body: another warp moves
  ``resp_produced`` over it and the DPU decodes the previous lap's body ->
  ``test_seq_before_body_is_caught``;
* ``WindowFirst`` reads the record window before the control block (the
  GPU publishes between the two READs here): the index covers a record the
  window read too early -> ``test_window_before_control_is_caught``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import pytest

from dpu_frontend.errors import ProtocolError
from dpu_frontend.ring import (
    DpuChannel,
    FinishReason,
    GenerateRecord,
    Geometry,
    GpuChannel,
    Poll,
    ResponseRecord,
    SamplingParams,
    WriteOp,
)
from dpu_frontend.ring.dpu import ReadOp
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.ring.records import COMMIT

from .test_ring_pump import apply

GEOMETRY = Geometry(req_slots=4, arena_bytes=1024, resp_slots=8, max_sequences=4)


class Interleaving:
    """``AtomicMemory`` that runs ``after`` once each store has landed (not re-entrantly)."""

    def __init__(self, mem: AtomicMemory) -> None:
        self.mem = mem
        self.after: Callable[[], None] = lambda: None
        self._inside = False

    def load_acquire(self, offset: int) -> int:
        return self.mem.load_acquire(offset)

    def read(self, offset: int, length: int) -> bytes:
        return self.mem.read(offset, length)

    def store_release(self, offset: int, value: int) -> None:
        self.mem.store_release(offset, value)
        self._other_side()

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.mem.write(offset, data)
        self._other_side()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Stores without the other side running (it is the one running now)."""
        inside, self._inside = self._inside, True
        try:
            yield
        finally:
            self._inside = inside

    def _other_side(self) -> None:
        if not self._inside:
            self._inside = True
            try:
                self.after()
            finally:
                self._inside = False


# -- DPU -> GPU --------------------------------------------------------------------


class CommitFirst(DpuChannel):
    """Broken on purpose: each commit WRITE goes before the body it commits."""

    def take_writes(self) -> tuple[list[WriteOp], list[int]]:
        writes, sent = super().take_writes()
        out: list[WriteOp] = []
        for op in writes:
            if len(op.data) == len(COMMIT.pack(0)) and out and op.offset + 8 == out[-1].offset:
                out.insert(len(out) - 1, op)
            else:
                out.append(op)
        return out, sent


def check_requests(dpu_type: type[DpuChannel]) -> None:
    """The GPU polls after every WRITE; whatever it takes must be whole and correct."""
    layout = GEOMETRY.plan(instance=3).channels[0]
    mem = AtomicMemory(bytearray(GEOMETRY.plan(instance=3).region_size))
    gpu = GpuChannel(mem, layout)
    gpu.reset(1)
    dpu = dpu_type(layout, 1)
    prompts = {rid: list(range(rid, rid + 5 * rid)) for rid in (1, 2, 3)}
    for rid, prompt in prompts.items():
        dpu.submit(rid, prompt, SamplingParams(max_tokens=rid))
    taken: dict[int, tuple[int, ...]] = {}
    writes, _sent = dpu.take_writes()
    for op in writes:
        apply(mem, op)
        for record, copied in gpu.poll_requests():
            assert isinstance(record, GenerateRecord)
            assert record.params.max_tokens == record.request_id
            taken[record.request_id] = copied
    assert gpu.counters.bad_records == 0, "the GPU saw a committed record before its body"
    assert taken == {rid: tuple(p) for rid, p in prompts.items()}


def test_request_records_are_whole_whenever_the_gpu_looks() -> None:
    check_requests(DpuChannel)


def test_commit_before_body_is_caught() -> None:
    with pytest.raises(AssertionError, match="before its body"):
        check_requests(CommitFirst)


# -- GPU -> DPU --------------------------------------------------------------------


class ProducedFirst(GpuChannel):
    """Broken on purpose: resp_produced moves before the records it covers exist."""

    def publish(self, records: list[ResponseRecord]) -> int:
        positions = self.reserve(len(records))
        self.mem.store_release(self.layout.gpu_ctrl_offset, positions.stop)
        for position, record in zip(positions, records, strict=False):
            self.write(position, record)
        self._produced = positions.stop
        return len(positions)


class SeqFirst(GpuChannel):
    """Broken on purpose: a record's seq is stored before its body."""

    def write(self, position: int, record: ResponseRecord) -> None:
        slot = self.layout.resp_slot_offset(position)
        self.mem.store_release(slot, position + 1)
        super().write(position, record)


class WindowFirst(DpuChannel):
    """Broken on purpose: the record window is READ before the control block."""

    def begin_poll(self) -> Poll:
        poll = super().begin_poll()
        return Poll(poll.writes, poll.reads[::-1], poll.sent)

    def end_poll(self, poll: Poll, data: Sequence[bytes | memoryview],
                 now: float) -> tuple[list[ResponseRecord], list[ReadOp]]:
        return super().end_poll(Poll(poll.writes, poll.reads[::-1], poll.sent), data[::-1], now)


def check_responses(gpu_type: type[GpuChannel], dpu_type: type[DpuChannel] = DpuChannel) -> None:
    """The DPU polls after every GPU store (another warp advancing the index first), and
    the GPU publishes one more record between the poll's two READs; the DPU must
    receive exactly the records published, in order, over several laps."""
    plan = GEOMETRY.plan(instance=3)
    layout = plan.channels[0]
    mem = Interleaving(AtomicMemory(bytearray(plan.region_size)))
    gpu = gpu_type(mem, layout)
    gpu.reset(1)
    dpu = dpu_type(layout, 1)
    got: list[ResponseRecord] = []
    sent: list[ResponseRecord] = []
    backlog: list[ResponseRecord] = []
    clock = [0.0]

    def publish(batch: list[ResponseRecord]) -> int:
        n = gpu.publish(batch)
        sent.extend(batch[:n])
        return n

    def dpu_polls(gpu_between_reads: bool = False) -> None:
        gpu.advance()  # another warp moves the index over what it finds published
        clock[0] += 1
        poll = dpu.begin_poll()
        for op in poll.writes:
            apply(mem.mem, op)
        data = []
        for read in poll.reads:
            data.append(mem.mem.read(read.offset, read.length))
            if gpu_between_reads and backlog:
                with mem.quiet():  # the GPU goes on between the two READs
                    del backlog[:publish(backlog[:1])]
        records, more = dpu.end_poll(poll, data, clock[0])
        for read in more:
            records += dpu.on_records(read, mem.mem.read(read.offset, read.length))
        got.extend(records)

    mem.after = dpu_polls  # (not re-entrant: no publish inside a publish)
    for lap in range(3):  # more records than slots: the ring wraps, old bodies remain
        backlog += [ResponseRecord(10 * lap + i, (lap, i), FinishReason.NONE) for i in range(6)]
        while backlog:
            del backlog[:publish(backlog[:2])]  # the DPU polls between these stores
            dpu_polls(gpu_between_reads=True)
    for _ in range(3):
        dpu_polls()
    assert got == sent, "the DPU received a record that was not the one published"


def test_response_records_are_whole_whenever_the_dpu_looks() -> None:
    check_responses(GpuChannel)


def test_produced_before_records_is_caught() -> None:
    with pytest.raises(ProtocolError, match="index before the record"):
        check_responses(ProducedFirst)


def test_seq_before_body_is_caught() -> None:
    with pytest.raises((AssertionError, ProtocolError)):
        check_responses(SeqFirst)


def test_window_before_control_is_caught() -> None:
    with pytest.raises((AssertionError, ProtocolError)):
        check_responses(GpuChannel, WindowFirst)
