"""The daemon's half of one ring pair, as a sans-I/O state machine.

``DpuChannel`` never touches a QP or a file. The I/O layer asks it for the
operations to perform (``WriteOp``/``ReadOp``), performs them in order on
one RC QP (or the shm twin), and hands the bytes it read back. The same
object therefore runs over verbs, over shm, and in the in-memory tests.

One poll is two READs: the GPU control block first, then the records it
declares published. Trusting records by an index fetched in the *same* READ
would be unsound: one DMA READ gives no ordering between its bytes and the
GPU's concurrent stores, so it could see the new index beside a stale record.
docs/protocol.md, "Memory ordering", has the full argument.
"""

from __future__ import annotations

import array
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from dpu_frontend.errors import PromptTooLong, ProtocolError
from dpu_frontend.ring.layout import DPU_CTRL, GPU_CTRL, ChannelLayout
from dpu_frontend.ring.records import (
    COMMIT,
    REQUEST_BODY_OFFSET,
    CancelRecord,
    GenerateRecord,
    RequestRecord,
    ResponseRecord,
    SamplingParams,
    decode_response,
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


@dataclass(slots=True)
class _Pending:
    record: RequestRecord
    prompt: bytes  # u32 little-endian token ids, empty for a cancel


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian bytes (the arena's format)."""
    buf = array.array("I", tokens)
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tobytes()


class DpuChannel:
    """Sequence numbers, credits, the prompt arena and response parsing for one channel."""

    def __init__(self, layout: ChannelLayout) -> None:
        self.layout = layout
        self._pending: deque[_Pending] = deque()
        self._pending_tokens = 0  # prompt tokens in _pending
        self._next_seq = 1  # the next request record's sequence number
        self._req_consumed = 0  # request records the GPU has taken (from its ctrl block)
        self._arena_head = 0  # monotonic byte counters; offset = counter % arena_size
        self._arena_tail = 0
        self._arena_spans: deque[tuple[int, int]] = deque()  # (seq, arena end) in seq order
        self._resp_consumed = 0  # response records parsed
        self._resp_published = 0  # resp_consumed value last written to the DPU ctrl block
        self._resp_produced = 0
        self.heartbeat = 0
        self.heartbeat_at = 0.0
        self.sent: list[int] = []  # generate requests the last take_writes() sent

    # -- requests ---------------------------------------------------------

    def submit(self, request_id: int, prompt: Sequence[int], params: SamplingParams) -> None:
        """Queue a generate request; ``take_writes`` sends it when credits allow."""
        data = pack_tokens(prompt)
        if len(data) > self.layout.arena_size:
            raise PromptTooLong(
                f"prompt of {len(prompt)} tokens exceeds the peer's prompt arena "
                f"({self.layout.arena_tokens} tokens)", param="prompt",
                code="context_length_exceeded",
            )
        self._pending.append(_Pending(GenerateRecord(request_id, 0, len(prompt), params), data))
        self._pending_tokens += len(prompt)

    def cancel(self, request_id: int) -> bool:
        """Stop ``request_id``. False if it never left this object (nothing will answer it)."""
        for item in self._pending:
            if isinstance(item.record, GenerateRecord) and item.record.request_id == request_id:
                self._pending.remove(item)
                self._pending_tokens -= item.record.prompt_len
                return False
        self._pending.append(_Pending(CancelRecord(request_id), b""))
        return True

    @property
    def queued(self) -> int:
        """Records waiting for a request slot or arena space."""
        return len(self._pending)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of the records waiting."""
        return self._pending_tokens

    def take_writes(self) -> list[WriteOp]:
        """The WRITEs for every queued record that fits now, in the order to post them.

        Per record: the prompt into the arena, the body, then the commit word.
        RC executes WRITEs of one QP in order, so the commit lands last.
        """
        ops: list[WriteOp] = []
        layout = self.layout
        self.sent = []
        while self._pending:
            if self._next_seq - 1 - self._req_consumed >= layout.req_slots:
                break  # no request slot: wait for the GPU to consume
            item = self._pending[0]
            record = item.record
            if isinstance(record, GenerateRecord):
                placed = self._place_prompt(len(item.prompt))
                if placed is None:
                    break  # the arena is full: FIFO order keeps arena reclamation trivial
                record = GenerateRecord(record.request_id, placed, record.prompt_len, record.params)
                if item.prompt:
                    ops.append(WriteOp(layout.arena_offset + placed, item.prompt))
            slot = layout.req_slot_offset(self._next_seq)
            ops.append(WriteOp(slot + REQUEST_BODY_OFFSET, encode_request_body(record)))
            ops.append(WriteOp(slot, COMMIT.pack(self._next_seq)))
            if isinstance(record, GenerateRecord):
                self.sent.append(record.request_id)
            self._next_seq += 1
            self._pending.popleft()
            self._pending_tokens -= len(item.prompt) // 4
        return ops

    def _place_prompt(self, nbytes: int) -> int | None:
        size = self.layout.arena_size
        start = self._arena_head
        offset = start % size
        if offset + nbytes > size:  # prompts never wrap: skip the arena's tail
            start += size - offset
            offset = 0
        if self._arena_tail == self._arena_head:
            self._arena_tail = start  # nothing is live: the skipped tail is free too
        end = start + nbytes
        if end - self._arena_tail > size:
            return None
        self._arena_head = end
        self._arena_spans.append((self._next_seq, end))
        return offset

    # -- responses --------------------------------------------------------

    def ctrl_read(self) -> ReadOp:
        return ReadOp(self.layout.gpu_ctrl_offset, GPU_CTRL.size)

    def on_ctrl(self, data: bytes | memoryview, now: float) -> list[ReadOp]:
        """Take the GPU control block; return the READs for newly published records."""
        produced, req_consumed, heartbeat = GPU_CTRL.unpack_from(data, 0)
        layout = self.layout
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
        ops: list[ReadOp] = []
        position = self._resp_consumed
        end = produced
        while position < end:
            index = position % layout.resp_slots
            count = min(end - position, layout.resp_slots - index)  # stop at the ring's end
            ops.append(ReadOp(layout.resp_slot_offset(position),
                              count * layout.resp_slot_size, position, count))
            position += count
        return ops

    def on_records(self, op: ReadOp, data: bytes | memoryview) -> list[ResponseRecord]:
        """Parse the bytes of a record READ returned by ``on_ctrl``; call in op order."""
        if op.position != self._resp_consumed:
            raise ValueError(f"records at {op.position} handed over out of order")
        size = self.layout.resp_slot_size
        records = [
            decode_response(data, i * size, op.position + i + 1, size) for i in range(op.count)
        ]
        self._resp_consumed += op.count
        return records

    def consumer_update(self, *, idle: bool) -> WriteOp | None:
        """The WRITE that releases consumed response slots, batched.

        Sent once half the ring is consumed, or as soon as a poll found nothing
        new (so a GPU that filled the ring is never left waiting).
        """
        unreleased = self._resp_consumed - self._resp_published
        if unreleased and (idle or unreleased * 2 >= self.layout.resp_slots):
            self._resp_published = self._resp_consumed
            return WriteOp(self.layout.dpu_ctrl_offset, DPU_CTRL.pack(self._resp_consumed))
        return None

    @property
    def in_ring(self) -> int:
        """Request records written and not yet consumed by the GPU."""
        return self._next_seq - 1 - self._req_consumed

    @property
    def unread(self) -> int:
        """Response records published by the GPU and not yet read (as of the last poll)."""
        return self._resp_produced - self._resp_consumed
