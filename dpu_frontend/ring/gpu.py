"""The GPU side of one ring pair: loads and stores on its own memory, by the v2 rules.

This is the executable specification of what the persistent GPU kernel
(``dpu_frontend/gpu/peer_kernel.cu``) does. It posts no verbs; the daemon
moves every byte with RDMA. Every marker and counter goes through
``RingMemory`` as one aligned 8-byte acquire load or release store, the
Python spelling of the kernel's system-scope ``ld.acquire``/``st.release``
(docs/protocol.md, "Memory ordering"); ``struct.pack_into`` would be wrong
for them anyway, because it zero-fills its target before writing the value.

Publishing follows the multi-warp rule even here, so that the interleaving
tests exercise it: positions are *reserved* against the DPU's credits, each
record's body is written and then its ``seq`` stored (release), and the
producer index moves only over the contiguous prefix of published records.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from dpu_frontend.errors import ProtocolError
from dpu_frontend.ring.automaton import CheckedAutomaton, automaton_identity
from dpu_frontend.ring.layout import (
    ALIGN,
    AUTOMATON_HEADER_SIZE,
    CTRL_SIZE,
    DPU_CTRL_STRUCT,
    GPU_CTRL_STRUCT,
    ChannelLayout,
)
from dpu_frontend.ring.records import (
    REQUEST_STRUCT,
    GenerateRecord,
    RequestRecord,
    ResponseRecord,
    decode_request,
    encode_response_body,
)

_RESP_PRODUCED = GPU_CTRL_STRUCT.offset("resp_produced")
_REQ_CONSUMED = GPU_CTRL_STRUCT.offset("req_consumed")
_HEARTBEAT = GPU_CTRL_STRUCT.offset("heartbeat")
_EPOCH = GPU_CTRL_STRUCT.offset("epoch")
_RESP_CONSUMED = DPU_CTRL_STRUCT.offset("resp_consumed")
_COMMIT = REQUEST_STRUCT.offset("commit")


class RingMemory(Protocol):
    """What the GPU side needs of its region (``memory.AtomicMemory``, or a test's
    interleaving wrapper around one)."""

    def load_acquire(self, offset: int) -> int: ...

    def store_release(self, offset: int, value: int) -> None: ...

    def read(self, offset: int, length: int) -> bytes: ...

    def write(self, offset: int, data: bytes | memoryview) -> None: ...


class Taken(NamedTuple):
    """A request record taken from the ring, with what it carries in the arena, copied
    out: the prompt, and for a constrained request its automaton's ``identity`` and
    either the checked automaton the caller already holds under that identity
    (``checked``) or the encoded bytes (``automaton``; checked by whoever walks them:
    ``ring.automaton.decode_automaton``)."""

    record: RequestRecord
    prompt: tuple[int, ...] = ()
    automaton: bytes = b""
    identity: bytes = b""
    checked: CheckedAutomaton | None = None


#: What a walker holds under an automaton's identity (``poll_requests``' ``cached``).
CheckedCache = Callable[[bytes], CheckedAutomaton | None]


@dataclass(slots=True)
class ChannelCounters:
    """What the kernel reports in its mailbox (see ``ring/mailbox.py``)."""

    records: int = 0  # request records consumed
    bad_records: int = 0  # refused: counted and skipped
    published: int = 0  # response records published
    ring_full_waits: int = 0  # times a record found no free response slot


class GpuChannel:
    """Consume request records and publish response records in ``mem``."""

    def __init__(self, mem: RingMemory, layout: ChannelLayout) -> None:
        if sys.byteorder != "little":
            raise ValueError("the reference peer stores native words: it needs a little-endian host")
        self.mem = mem
        self.layout = layout
        self.epoch = 0
        self.counters = ChannelCounters()
        self._gpu_ctrl = layout.gpu_ctrl_offset
        self._next_seq = 1
        self._consumed_published = 0  # req_consumed as last stored
        self._reserved = 0  # response positions handed out
        self._produced = 0  # the published prefix (resp_produced)
        self._heartbeat = 0

    def reset(self, epoch: int) -> None:
        """Start attachment ``epoch``: zero both rings and the ring counters, then
        publish the epoch. Runs between two engine steps (the mailbox's ATTACH), so
        no store of an earlier step can land after it. ``heartbeat`` is left alone:
        it is monotonic across attachments."""
        if epoch <= self.epoch:
            raise ValueError(f"epoch {epoch} does not follow {self.epoch}")
        lay, mem = self.layout, self.mem
        mem.write(lay.req_ring_offset, bytes(lay.req_slots * lay.req_slot_size))
        mem.write(lay.resp_ring_offset, bytes(lay.resp_slots * lay.resp_slot_size))
        mem.write(lay.dpu_ctrl_offset, bytes(CTRL_SIZE))
        for field in (_RESP_PRODUCED, _REQ_CONSUMED):
            mem.store_release(self._gpu_ctrl + field, 0)
        self._next_seq, self._consumed_published, self._reserved, self._produced = 1, 0, 0, 0
        self.epoch = epoch
        # Last, with release: a DPU that sees this epoch sees the zeroed channel.
        mem.store_release(self._gpu_ctrl + _EPOCH, epoch)

    # -- requests ---------------------------------------------------------------

    def poll_requests(self, cached: CheckedCache | None = None) -> list[Taken]:
        """Every request record committed since the last call, with its prompt (and
        automaton) copied out. ``cached``: the checked automaton the caller holds under
        an identity; a constrained request of one it holds is handed that, and its
        automaton's bytes past the header are not read (one key, one automaton).

        A slot is valid once its commit word (acquire load) equals the expected
        sequence number. A record that breaks the protocol (another epoch, an
        unknown kind, a prompt span outside the arena, ...) is counted in
        ``bad_records`` and skipped: consumed, never answered, and the channel
        goes on.
        """
        out: list[Taken] = []
        lay, mem = self.layout, self.mem
        while True:
            slot = lay.req_slot_offset(self._next_seq)
            if mem.load_acquire(slot + _COMMIT) != self._next_seq:
                break
            self._next_seq += 1
            self.counters.records += 1
            try:
                record = decode_request(mem.read(slot, lay.req_slot_size), self.epoch)
                taken = (self._read_automaton(
                    Taken(record, self._read_prompt(record)), cached)
                         if isinstance(record, GenerateRecord) else Taken(record))
            except ProtocolError:
                self.counters.bad_records += 1
                continue
            out.append(taken)
        if self._next_seq - 1 != self._consumed_published:  # taken records, bad ones too
            # The prompts are copied out above, so the DPU may reuse the slots and the
            # arena spans as soon as it sees this index (release).
            self._consumed_published = self._next_seq - 1
            mem.store_release(self._gpu_ctrl + _REQ_CONSUMED, self._consumed_published)
        return out

    def refuse(self) -> None:
        """The engine refused a record this channel handed over (a duplicate request id,
        or no room in its store): count it as bad."""
        self.counters.bad_records += 1

    def _read_prompt(self, record: GenerateRecord) -> tuple[int, ...]:
        lay = self.layout
        end = record.arena_offset + record.prompt_len * 4
        if record.arena_offset % ALIGN or end > lay.arena_size:
            raise ProtocolError(f"request {record.request_id}: prompt span "
                                f"[{record.arena_offset}, {end}) misaligned or past the arena")
        if record.prompt_len > lay.max_prompt_tokens:
            raise ProtocolError(f"request {record.request_id}: prompt of {record.prompt_len} "
                                f"tokens exceeds {lay.max_prompt_tokens}")
        ids = array.array("I")
        ids.frombytes(self.mem.read(lay.arena_offset + record.arena_offset, record.prompt_len * 4))
        return tuple(ids)

    def _read_automaton(self, taken: Taken, cached: CheckedCache | None) -> Taken:
        """``taken`` with its record's automaton: what ``cached`` holds under its identity,
        else its bytes."""
        lay, record = self.layout, taken.record
        assert isinstance(record, GenerateRecord)
        n = record.automaton_bytes
        if not n:
            return taken
        start = record.automaton_offset
        if not lay.constraints or n > lay.max_automaton_bytes or start + n > lay.arena_size:
            raise ProtocolError(f"request {record.request_id}: an automaton of {n} bytes at "
                                f"{start} on a channel that takes {lay.max_automaton_bytes} "
                                f"in an arena of {lay.arena_size}")
        at = lay.arena_offset + start
        if n >= AUTOMATON_HEADER_SIZE:
            identity = automaton_identity(self.mem.read(at, AUTOMATON_HEADER_SIZE), n)
            checked = cached(identity) if cached is not None else None
            if checked is not None:
                return taken._replace(identity=identity, checked=checked)
        else:
            identity = b""  # shorter than a header: its check refuses it
        return taken._replace(automaton=self.mem.read(at, n), identity=identity)

    # -- responses --------------------------------------------------------------

    def reserve(self, wanted: int) -> range:
        """Reserve up to ``wanted`` response positions that the DPU's credits allow."""
        released = self.mem.load_acquire(self.layout.dpu_ctrl_offset + _RESP_CONSUMED)
        free = self.layout.resp_slots - (self._reserved - released)
        n = max(0, min(wanted, free))
        if n < wanted:
            self.counters.ring_full_waits += 1
        first = self._reserved
        self._reserved += n
        return range(first, first + n)

    def write(self, position: int, record: ResponseRecord) -> None:
        """Publish one reserved record: the body, then its ``seq`` (release)."""
        lay = self.layout
        slot = lay.resp_slot_offset(position)
        self.mem.write(slot + 8, encode_response_body(record, lay.resp_slot_size, self.epoch))
        self.mem.store_release(slot, position + 1)
        self.counters.published += 1

    def advance(self) -> int:
        """Move ``resp_produced`` over the contiguous prefix of published records."""
        lay, mem = self.layout, self.mem
        produced = self._produced
        while produced < self._reserved and (
            mem.load_acquire(lay.resp_slot_offset(produced)) == produced + 1
        ):
            produced += 1
        if produced != self._produced:
            self._produced = produced
            mem.store_release(self._gpu_ctrl + _RESP_PRODUCED, produced)
        return produced

    def publish(self, records: list[ResponseRecord]) -> int:
        """Reserve, write and publish as many of ``records`` as fit; return how many."""
        alone = self._produced == self._reserved  # no other writer holds a reservation
        positions = self.reserve(len(records))
        for position, record in zip(positions, records, strict=False):
            self.write(position, record)
        if alone and positions:
            # This writer published the whole prefix itself, in order: no need to read
            # its own seq words back to find it.
            self._produced = positions.stop
            self.mem.store_release(self._gpu_ctrl + _RESP_PRODUCED, self._produced)
        else:
            self.advance()
        return len(positions)

    def beat(self) -> None:
        """Advance the liveness counter the daemon watches."""
        self._heartbeat += 1
        self.mem.store_release(self._gpu_ctrl + _HEARTBEAT, self._heartbeat)

    @property
    def consumed(self) -> int:
        """Request records taken this attachment."""
        return self._next_seq - 1
