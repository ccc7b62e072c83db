"""The daemon's half of one ring pair, as a sans-I/O state machine.

``DpuChannel`` never touches a QP or a file. The I/O layer asks it for the
operations to perform (``WriteOp``/``ReadOp``), performs them in order on
one RC QP (or the shm twin), and hands the bytes it read back. The same
object therefore runs over verbs, over shm, and in the in-memory tests.

One poll is one batch posted together: the pending WRITEs (request records,
the credit update), a READ of the GPU control block, and a *fenced* READ of a
window of response records. The fence makes the NIC start the window READ
only once the control READ has completed, so every record below the index
that READ returned was published before the window was read; records past
the window are fetched by exact READs once the index is known. Trusting
records by an index fetched in the *same* READ would be unsound: one DMA READ
gives no ordering between its bytes and the GPU's concurrent stores.
docs/protocol.md, "Memory ordering", has the full argument.
"""

from __future__ import annotations

import array
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from dpu_frontend.errors import PromptTooLong, ProtocolError, RequestError
from dpu_frontend.ring.automaton import Constraint
from dpu_frontend.ring.layout import ALIGN, DPU_CTRL, GPU_CTRL, ChannelLayout, align
from dpu_frontend.ring.records import (
    COMMIT,
    REQUEST_BODY_OFFSET,
    CancelRecord,
    GenerateRecord,
    RequestRecord,
    ResponseRecord,
    SamplingParams,
    decode_responses,
    encode_request_body,
)


@dataclass(frozen=True, slots=True)
class WriteOp:
    """Copy ``data`` to ``offset`` of the peer's region (an RDMA WRITE)."""

    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class ReadOp:
    """Fetch ``length`` bytes at ``offset`` (an RDMA READ).

    For record reads, ``position`` is the ring position of the first record
    and ``count`` how many records the bytes hold.
    """

    offset: int
    length: int
    position: int = -1
    count: int = 0


@dataclass(frozen=True, slots=True)
class Poll:
    """One poll, posted as one batch: ``writes`` in order, then ``reads`` in order, each
    READ after the first fenced (it starts only once the one before completed)."""

    writes: list[WriteOp]
    reads: list[ReadOp]  # the control block, then (maybe) a speculative record window
    sent: list[int]  # generate requests whose records are among the writes


#: Records the first speculative window READ covers; it grows to the largest
#: batch seen (a decode step's worth) and shrinks when polls find less.
MIN_WINDOW = 16


@dataclass(slots=True)
class _Pending:
    record: RequestRecord
    prompt: bytes  # u32 little-endian token ids, empty for a cancel
    automaton: bytes = b""  # an encoded automaton (ring.automaton), after the prompt


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian bytes (the arena's format)."""
    buf = array.array("I", tokens)
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tobytes()


class DpuChannel:
    """Sequence numbers, credits, the prompt arena and response parsing for one channel."""

    def __init__(self, layout: ChannelLayout, epoch: int, now: float = 0.0) -> None:
        self.layout = layout
        self.epoch = epoch  # the attachment; every record must carry it
        self._pending: deque[_Pending] = deque()  # generates, in submission order
        self._cancels: deque[int] = deque()  # cancels jump the queue (see take_writes)
        self._pending_tokens = 0  # prompt tokens in _pending
        self._open: set[int] = set()  # generates written and not yet finished
        self._next_seq = 1  # the next request record's sequence number
        self._req_consumed = 0  # request records the GPU has taken (from its ctrl block)
        self._arena_head = 0  # monotonic byte counters; offset = counter % arena_size
        self._arena_tail = 0
        self._arena_spans: deque[tuple[int, int]] = deque()  # (seq, arena end) in seq order
        self._resp_consumed = 0  # response records parsed
        self._resp_published = 0  # resp_consumed value last written to the DPU ctrl block
        self._resp_produced = 0
        self._window = MIN_WINDOW
        self.heartbeat = 0
        self.heartbeat_at = now  # when the heartbeat last moved; the stall clock starts now

    # -- requests ---------------------------------------------------------

    def submit(self, request_id: int, prompt: Sequence[int], params: SamplingParams,
               constraint: Constraint | None = None) -> None:
        """Queue a generate request; ``take_writes`` sends it when credits allow.
        ``constraint``'s automaton constrains its tokens; a channel that does not take
        one, or not that large, is the request's error on the constraint's field."""
        limit = self.layout.max_prompt_tokens
        automaton = b""
        if constraint is not None:
            automaton = constraint.automaton
            self._check_automaton(len(automaton), constraint.param)
        if not self.layout.offers_logprobs(params.logprobs):
            if not self.layout.logprobs:
                raise RequestError("the GPU peer does not compute log probabilities",
                                   param="logprobs", code="unsupported_parameter")
            raise RequestError(f"the GPU peer gives at most {self.layout.max_top_logprobs} "
                               f"alternatives per token, {params.logprobs} were asked for",
                               param="logprobs")
        if len(prompt) > limit:
            raise PromptTooLong(
                f"prompt of {len(prompt)} tokens exceeds what the GPU peer takes "
                f"({limit} tokens)", param="prompt", code="context_length_exceeded",
            )
        self._pending.append(_Pending(
            GenerateRecord(request_id, 0, len(prompt), params, len(automaton)),
            pack_tokens(prompt), automaton))
        self._pending_tokens += len(prompt)

    def _check_automaton(self, nbytes: int, param: str) -> None:
        layout = self.layout
        if not layout.constraints:
            raise RequestError("the GPU peer does not decode structured output (its ring "
                               "layout offers no constraints)", param=param,
                               code="unsupported_parameter")
        if nbytes > layout.max_automaton_bytes:
            raise RequestError(f"the constraint's automaton takes {nbytes} bytes, more than "
                               f"the {layout.max_automaton_bytes} the GPU peer takes",
                               param=param, code="constraint_too_large")

    def cancel(self, request_id: int) -> bool:
        """Stop ``request_id``. False if it never left this object (nothing will answer it)."""
        for item in self._pending:
            if isinstance(item.record, GenerateRecord) and item.record.request_id == request_id:
                self._pending.remove(item)
                self._pending_tokens -= item.record.prompt_len
                return False
        self._cancels.append(request_id)
        return True

    @property
    def queued(self) -> int:
        """Records waiting for a request slot, arena space or the sequence window."""
        return len(self._pending) + len(self._cancels)

    @property
    def waiting(self) -> int:
        """Generate requests not yet written (cancels, also queued, are not requests)."""
        return len(self._pending)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of the records waiting."""
        return self._pending_tokens

    def take_writes(self) -> tuple[list[WriteOp], list[int]]:
        """The WRITEs for every queued record that fits now, in the order to post them,
        and the generate requests they send.

        Per record: the prompt into the arena, the body, then the commit word.
        RC executes WRITEs of one QP in order, so the commit lands last.
        Cancels go first and need only a request slot: the GPU side drains every
        record into its own store at once (the ``max_sequences`` window below
        guarantees it has room), so a cancel never waits behind generates.
        """
        ops: list[WriteOp] = []
        sent: list[int] = []
        layout = self.layout
        while self._cancels and self._slot_free():
            self._write_record(ops, CancelRecord(self._cancels.popleft()))
        while self._pending and self._slot_free() and len(self._open) < layout.max_sequences:
            item = self._pending[0]
            record = item.record
            if not isinstance(record, GenerateRecord):
                raise TypeError("only generates wait in the pending queue")
            span = (align(len(item.prompt), ALIGN) + len(item.automaton) if item.automaton
                    else len(item.prompt))
            placed = self._place_prompt(span)
            if placed is None:
                break  # the arena is full: FIFO order keeps arena reclamation trivial
            record = GenerateRecord(record.request_id, placed, record.prompt_len, record.params,
                                    record.automaton_bytes)
            if item.prompt:
                ops.append(WriteOp(layout.arena_offset + placed, item.prompt))
            if item.automaton:
                ops.append(WriteOp(layout.arena_offset + record.automaton_offset,
                                   item.automaton))
            self._write_record(ops, record)
            self._open.add(record.request_id)
            sent.append(record.request_id)
            self._pending.popleft()
            self._pending_tokens -= len(item.prompt) // 4
        return ops, sent

    def _slot_free(self) -> bool:
        return self._next_seq - 1 - self._req_consumed < self.layout.req_slots

    def _write_record(self, ops: list[WriteOp], record: RequestRecord) -> None:
        slot = self.layout.req_slot_offset(self._next_seq)
        ops.append(WriteOp(slot + REQUEST_BODY_OFFSET, encode_request_body(record, self.epoch)))
        ops.append(WriteOp(slot, COMMIT.pack(self._next_seq)))
        self._next_seq += 1

    def _place_prompt(self, nbytes: int) -> int | None:
        size = self.layout.arena_size
        start = self._arena_head
        offset = start % size
        if offset + nbytes > size:  # prompts never wrap: skip the arena's tail
            start += size - offset
            offset = 0
        if self._arena_tail == self._arena_head:
            self._arena_tail = start  # nothing is live: the skipped tail is free too
        end = start + align(nbytes, ALIGN)  # the next prompt starts 128-byte aligned
        if end - self._arena_tail > size:
            return None
        self._arena_head = end
        self._arena_spans.append((self._next_seq, end))
        return offset

    # -- responses --------------------------------------------------------

    def begin_poll(self) -> Poll:
        """The batch of one poll: pending request WRITEs, the credit WRITE if slots were
        consumed since the last one, the control READ and a speculative window READ."""
        writes, sent = self.take_writes()
        if self._resp_consumed != self._resp_published:
            # Unsignalled and in the same batch: releasing slots costs no round trip.
            self._resp_published = self._resp_consumed
            writes.append(WriteOp(self.layout.dpu_ctrl_offset, DPU_CTRL.pack(self._resp_consumed)))
        reads = [ReadOp(self.layout.gpu_ctrl_offset, GPU_CTRL.size)]
        window = self._record_read(self._resp_consumed, self._window)
        if window is not None:
            reads.append(window)
        return Poll(writes, reads, sent)

    def _record_read(self, position: int, count: int) -> ReadOp | None:
        """A READ of up to ``count`` records from ``position``, stopping at the ring's end."""
        layout = self.layout
        index = position % layout.resp_slots
        count = min(count, layout.resp_slots - index)
        if count <= 0:
            return None
        return ReadOp(layout.resp_slot_offset(position), count * layout.resp_slot_size,
                      position, count)

    def end_poll(self, poll: Poll, data: Sequence[bytes | memoryview],
                 now: float) -> tuple[list[ResponseRecord], list[ReadOp]]:
        """Take what the poll's READs returned: the records published within the window,
        and the exact READs for records published past it (hand their bytes to
        ``on_records`` in order)."""
        self.on_ctrl(data[0], now)
        records: list[ResponseRecord] = []
        before = self._resp_consumed
        if len(poll.reads) > 1:
            window = poll.reads[1]
            count = min(window.count, self._resp_produced - self._resp_consumed)
            if count > 0:
                records = self._parse(window.position, count, data[1])
        published = self._resp_produced - before
        if published > self._window:
            self._window = min(self.layout.resp_slots, 1 << (published - 1).bit_length())
        elif published * 4 < self._window:
            self._window = max(MIN_WINDOW, self._window // 2)
        return records, self._follow_up_reads()

    def on_ctrl(self, data: bytes | memoryview, now: float) -> None:
        """Take the GPU control block (the first READ of a poll) and check it."""
        produced, req_consumed, heartbeat, epoch = GPU_CTRL.unpack_from(data, 0)
        layout = self.layout
        if epoch != self.epoch:
            raise ProtocolError(
                f"the channel is in epoch {epoch}, this session attached in epoch "
                f"{self.epoch}: it was reset under us"
            )
        if not self._req_consumed <= req_consumed < self._next_seq:
            raise ProtocolError(
                f"peer claims {req_consumed} request records consumed; "
                f"{self._next_seq - 1} were written, {self._req_consumed} seen consumed"
            )
        if not self._resp_produced <= produced <= self._resp_published + layout.resp_slots:
            raise ProtocolError(
                f"peer published response index {produced}: it went back or overran "
                f"records not yet released (released up to {self._resp_published})"
            )
        self._req_consumed = req_consumed
        while self._arena_spans and self._arena_spans[0][0] <= req_consumed:
            self._arena_tail = max(self._arena_tail, self._arena_spans.popleft()[1])
        if heartbeat != self.heartbeat:
            self.heartbeat, self.heartbeat_at = heartbeat, now
        self._resp_produced = produced

    def _follow_up_reads(self) -> list[ReadOp]:
        ops: list[ReadOp] = []
        position = self._resp_consumed
        while position < self._resp_produced:
            op = self._record_read(position, self._resp_produced - position)
            if op is None:
                break
            ops.append(op)
            position += op.count
        return ops

    def on_records(self, op: ReadOp, data: bytes | memoryview) -> list[ResponseRecord]:
        """Parse the bytes of a record READ from ``end_poll``; call in op order."""
        return self._parse(op.position, op.count, data)

    def _parse(self, position: int, count: int, data: bytes | memoryview) -> list[ResponseRecord]:
        if position != self._resp_consumed:
            raise ValueError(f"records at {position} handed over out of order")
        records = decode_responses(data, count, position + 1, self.layout.resp_slot_size,
                                   self.epoch)
        self._resp_consumed += count
        for record in records:
            if record.finish:  # the last record of its request (a plain int test: hot path)
                self._open.discard(record.request_id)
        return records

    @property
    def in_ring(self) -> int:
        """Request records written and not yet consumed by the GPU."""
        return self._next_seq - 1 - self._req_consumed

    @property
    def open_sequences(self) -> int:
        """Generates sent and not yet finished (at most the layout's ``max_sequences``)."""
        return len(self._open)

    @property
    def unread(self) -> int:
        """Response records published by the GPU and not yet read (as of the last poll)."""
        return self._resp_produced - self._resp_consumed
