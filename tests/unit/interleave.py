"""Both halves of a channel as two programs on one region, for schedules to interleave.

The DPU half is a program of RDMA operations (``DpuProgram``): each poll's WRITEs
(request records, then the credit), its control READ, its window READ and the
exact READs past the window, one operation a step. The GPU half is a program of
loads and stores (``GpuProgram``): each engine step takes the request records,
publishes their answers (alternately as one writer and as a warp per record
finishing in reverse order) and beats. Every load and store it makes goes
through ``Region``, which hands the turn to a schedule after it; so does the
point between two steps (``IDLE``). Any interleaving of the two programs is a
schedule: after each GPU access, which DPU operations run, and whether another
warp moves the producer index first (as a CUDA block's leader does while the
other warps still write).

Both sides check, as it happens, that what they receive is what the other
side wrote: the GPU each request record and its prompt, in the order the DPU
submitted them (``Traffic.take``), the DPU each response record against the
one the GPU wrote at that position (``Traffic.deliver``). A reordering shows
as the first record that differs, or as the ``ProtocolError`` of a check that
caught it, at the schedule's point.

The geometries are small and the traffic long enough that both rings are
full at times and wrap several times, so that a slot read too early holds a
record of an earlier lap, with the right epoch. ``schedules.py`` makes the
schedules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dpu_frontend.ring import (
    DpuChannel,
    FinishReason,
    GenerateRecord,
    Geometry,
    GpuChannel,
    ResponseRecord,
    SamplingParams,
    WriteOp,
)
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.ring.records import RequestRecord

EPOCH = 3
#: The turn between two engine steps of the GPU (every other turn follows one access).
IDLE = "idle"
#: Small rings, so that they fill up and wrap: more request slots than the sequence
#: window would make slot reuse wait for a final record; fewer lets a freed slot be
#: rewritten at once. One prompt span per request slot keeps the arena as full as
#: the ring.
GEOMETRIES = {
    "one-request-slot": Geometry(req_slots=1, arena_bytes=128, resp_slots=4, max_sequences=2,
                                 resp_slot_size=64, logprobs=False),
    "two-request-slots": Geometry(req_slots=2, arena_bytes=256, resp_slots=6, max_sequences=3,
                                  resp_slot_size=64, logprobs=False),
}
REQUESTS = 12


def apply(mem: AtomicMemory, op: WriteOp) -> None:
    """One RDMA WRITE: an 8-byte marker as one release store, anything else as a copy."""
    if len(op.data) == 8 and op.offset % 8 == 0:
        mem.store_release(op.offset, int.from_bytes(op.data, "little"))
    else:
        mem.write(op.offset, op.data)


def prompt_of(request_id: int) -> tuple[int, ...]:
    """1 to 32 tokens (one 128-byte arena span), different for every request."""
    return tuple(range(1000 * request_id, 1000 * request_id + 1 + 7 * request_id % 32))


def params_of(request_id: int) -> SamplingParams:
    return SamplingParams(max_tokens=request_id, seed=request_id, top_k=request_id)


def answers(request_id: int) -> list[ResponseRecord]:
    """1 to 5 records: mostly more than a step's share of the response ring, so that it
    fills up, and at times few, so that the GPU has nothing left to publish when the
    next request comes. Of one token (``decode_responses``' one-unpack path) and of
    several (the full decoder); the final one with a token or none."""
    base = 16 * request_id
    tokens = [(base,), (base + 1, base + 2, base + 3), (base + 4,), tuple(range(base + 5, base + 9)),
              (base + 9,) if request_id % 2 else ()]
    count = (5, 1, 5, 2)[request_id % 4]
    records = [ResponseRecord(request_id, t) for t in tokens[5 - count:]]
    records[-1].finish = FinishReason.LENGTH if request_id % 2 else FinishReason.STOP
    return records


@dataclass
class Traffic:
    """What each side must receive, and what it has received."""

    requests: list[int]  # request ids, in the order the DPU submits (and writes) them
    taken: int = 0  # request records the GPU has taken
    written: dict[int, ResponseRecord] = field(default_factory=dict)  # position -> record
    delivered: list[ResponseRecord] = field(default_factory=list)

    def take(self, record: RequestRecord, prompt: tuple[int, ...]) -> None:
        want = self.requests[self.taken] if self.taken < len(self.requests) else None
        got = (record.request_id, record.params if isinstance(record, GenerateRecord) else None,
               prompt)
        if want is None or got != (want, params_of(want), prompt_of(want)):
            raise AssertionError(f"the GPU took {record} with prompt {prompt} as request record "
                                 f"{self.taken + 1}, the DPU wrote request {want} there: a slot "
                                 "or a prompt read before it was written, or after it was reused")
        self.taken += 1

    def deliver(self, records: list[ResponseRecord]) -> None:
        for record in records:
            position = len(self.delivered)
            if self.written.get(position) != record:
                raise AssertionError(f"the DPU decoded {record} at position {position}, the GPU "
                                     f"wrote {self.written.get(position)} there")
            self.delivered.append(record)

    @property
    def done(self) -> bool:
        return len(self.delivered) == sum(len(answers(r)) for r in self.requests)


class Region:
    """The GPU half's memory: after each load and store, ``after`` has the turn (the
    DPU runs, another warp advances), never re-entrantly."""

    def __init__(self, mem: AtomicMemory) -> None:
        self.mem = mem
        self.after: Callable[[str], None] = lambda access: None
        self._inside = False

    def load_acquire(self, offset: int) -> int:
        value = self.mem.load_acquire(offset)
        self.turn("load")
        return value

    def read(self, offset: int, length: int) -> bytes:
        data = self.mem.read(offset, length)
        self.turn("read")
        return data

    def store_release(self, offset: int, value: int) -> None:
        self.mem.store_release(offset, value)
        self.turn("store")

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.mem.write(offset, data)
        self.turn("write")

    def turn(self, access: str) -> None:
        if not self._inside:
            self._inside = True
            try:
                self.after(access)
            finally:
                self._inside = False


class DpuProgram:
    """The daemon's poll loop, one RDMA operation a ``step``."""

    def __init__(self, channel: DpuChannel, mem: AtomicMemory, traffic: Traffic) -> None:
        self.channel = channel
        self.mem = mem
        self.traffic = traffic
        self.mid_poll = False
        self.ops = 0
        self._busy = False  # the last poll wrote or delivered something
        self._steps = self._polls()

    def step(self, count: int = 1) -> None:
        for _ in range(count):
            next(self._steps)
            self.ops += 1

    def poll(self) -> None:
        """The rest of the poll under way, or a whole one."""
        self.step()
        while self.mid_poll:
            self.step()

    def drain(self, limit: int = 8) -> None:
        """Poll until two polls in a row have nothing to do: the second acts on what the
        first learned (a request slot freed, records published)."""
        if self.mid_poll:
            self.poll()
        idle = 0
        for _ in range(limit):
            self.poll()
            idle = 0 if self._busy else idle + 1
            if idle == 2:
                return

    def _polls(self) -> Iterator[None]:
        """Each ``yield`` follows one operation; what it returned is handled first."""
        now = 0.0
        while True:
            now += 1.0
            poll = self.channel.begin_poll()
            self.mid_poll, self._busy = True, bool(poll.writes)
            for op in poll.writes:
                apply(self.mem, op)
                yield
            data = []
            for read in poll.reads[:-1]:
                data.append(self.mem.read(read.offset, read.length))
                yield
            last = poll.reads[-1]
            data.append(self.mem.read(last.offset, last.length))
            records, more = self.channel.end_poll(poll, data, now)
            self._hand(records)
            for read in more:
                yield  # (after the READ before this one)
                self._hand(self.channel.on_records(read, self.mem.read(read.offset, read.length)))
            self.mid_poll = False
            yield

    def _hand(self, records: list[ResponseRecord]) -> None:
        self._busy = self._busy or bool(records)
        self.traffic.deliver(records)


class GpuProgram:
    """The GPU half's engine steps: every request record taken and answered, as many
    records published as fit, a heartbeat."""

    def __init__(self, channel: GpuChannel, traffic: Traffic) -> None:
        self.channel = channel
        self.traffic = traffic
        self.steps = 0
        self._outbox: list[ResponseRecord] = []
        self._reserved = 0  # positions handed out

    def step(self) -> None:
        for record, prompt, *_ in self.channel.poll_requests():
            self.traffic.take(record, prompt)
            self._outbox += answers(record.request_id)
        if self.channel.counters.bad_records:
            raise AssertionError("the GPU refused a request record: it read the slot before "
                                 "its body was written")
        if self._outbox:
            self._publish()
        self.channel.beat()
        self.steps += 1

    def _publish(self) -> None:
        first, batch, written = self._reserved, self._outbox, self.traffic.written
        for i, record in enumerate(batch):  # before any store: the DPU may read it at once
            written[first + i] = record
        if self.steps % 2:
            # A warp per record, the last reserved finishing first: resp_produced moves
            # only when the walk finds the whole prefix published.
            positions = self.channel.reserve(len(batch))
            for position in reversed(positions):
                self.channel.write(position, batch[position - first])
            self.channel.advance()
            count = len(positions)
        else:
            count = self.channel.publish(batch)
        for i in range(count, len(batch)):
            del written[first + i]
        self._reserved += count
        del batch[:count]


@dataclass(frozen=True, slots=True)
class Turn:
    """A point of the lockstep schedule, as ``explore`` numbers them."""

    access: str  # IDLE, or the GPU access it follows: load, read, store, write
    later: bool  # both rings have wrapped: every slot holds a record of this epoch
    ops: int  # at IDLE: the operations of the DPU's poll there


Schedule = Callable[["World", int, str], None]


class World:
    """One channel's region, both programs on it, and the traffic they carry."""

    def __init__(self, geometry: Geometry, dpu_type: type[DpuChannel] = DpuChannel,
                 gpu_type: type[GpuChannel] = GpuChannel, requests: int = REQUESTS) -> None:
        plan = geometry.plan(instance=5)
        self.layout = plan.channels[0]
        mem = AtomicMemory(bytearray(plan.region_size))
        self.region = Region(mem)
        self.traffic = Traffic(list(range(1, requests + 1)))
        gpu = gpu_type(self.region, self.layout)
        gpu.reset(EPOCH)
        dpu = dpu_type(self.layout, EPOCH)
        for request_id in self.traffic.requests:
            dpu.submit(request_id, prompt_of(request_id), params_of(request_id))
        self.dpu = DpuProgram(dpu, mem, self.traffic)
        self.gpu = GpuProgram(gpu, self.traffic)
        self.turns: list[Turn] = []
        self.full_request_ring = False  # the DPU had records waiting for a slot

    def run(self, schedule: Schedule, max_steps: int = 300) -> None:
        """Until the DPU has every record; a schedule that deadlocks fails."""
        self.region.after = lambda access: self._turn(schedule, access)
        while not self.traffic.done:
            if self.gpu.steps >= max_steps:
                raise AssertionError(f"no progress in {max_steps} engine steps: "
                                     f"{self.traffic.taken} requests taken, "
                                     f"{len(self.traffic.delivered)} records delivered")
            self.region.turn(IDLE)
            self.gpu.step()

    def advance(self) -> None:
        """Another warp moves resp_produced over what it finds published."""
        self.gpu.channel.advance()

    def _turn(self, schedule: Schedule, access: str) -> None:
        dpu, ops = self.dpu.channel, self.dpu.ops
        if dpu.in_ring == self.layout.req_slots and dpu.queued:
            self.full_request_ring = True
        gpu = self.gpu.channel
        later = (gpu.consumed >= self.layout.req_slots
                 and gpu.counters.published >= self.layout.resp_slots)
        point = len(self.turns)
        self.turns.append(Turn(access, later, 0))
        schedule(self, point, access)
        if access == IDLE:
            self.turns[point] = Turn(access, later, self.dpu.ops - ops)


def run(geometry: Geometry, schedule: Schedule, dpu_type: type[DpuChannel] = DpuChannel,
        gpu_type: type[GpuChannel] = GpuChannel) -> World:
    """A new world run under ``schedule``; a failure carries the schedule and the turn
    in a note."""
    world = World(geometry, dpu_type, gpu_type)
    try:
        world.run(schedule)
    except Exception as exc:
        exc.add_note(f"schedule {schedule}, at turn {len(world.turns) - 1} "
                     f"({world.turns[-1] if world.turns else None})")
        raise
    return world
