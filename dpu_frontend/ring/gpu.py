"""The GPU side of one ring pair: plain loads and stores on its own memory.

This is the executable specification of what a persistent GPU kernel does.
It posts no verbs at all; the daemon moves every byte with RDMA. Each store
sequence below is annotated with the fence a CUDA kernel needs in its place
(docs/protocol.md, "Memory ordering"). The reference peer runs it in Python,
where x86-64's total store order keeps loads and stores in program order,
so no explicit fence exists to write here.

Every counter and validity marker is one aligned 8-byte load or store
(``self._words``, a ``Q`` view of the region). ``struct.pack_into`` would be
wrong here: it zero-fills its target before writing the value, so a reader
polling concurrently can see a transient 0 (the integration tests caught
exactly that: a ``req_consumed`` going back to 0).
"""

from __future__ import annotations

import array
import sys

from dpu_frontend.errors import ProtocolError
from dpu_frontend.ring.layout import CTRL_SIZE, ChannelLayout
from dpu_frontend.ring.records import (
    GenerateRecord,
    RequestRecord,
    ResponseRecord,
    decode_request,
    encode_response_body,
)

# Fields of the GPU control block (layout.GPU_CTRL), in 8-byte words.
_RESP_PRODUCED = 0
_REQ_CONSUMED = 1
_HEARTBEAT = 2


class GpuChannel:
    """Consume request records and publish response records in ``mem``."""

    def __init__(self, mem: memoryview, layout: ChannelLayout) -> None:
        if sys.byteorder != "little":
            raise ValueError("the reference peer stores native words: it needs a little-endian host")
        self.mem = mem
        self._words = mem.cast("B").cast("Q")  # the region's 8-byte words, for single stores
        self._gpu_ctrl = layout.gpu_ctrl_offset // 8
        self._dpu_ctrl = layout.dpu_ctrl_offset // 8
        self.layout = layout
        self._next_seq = 1
        self._produced = 0
        self._heartbeat = 0

    def reset(self) -> None:
        """Start a fresh session: zero both control blocks and both rings.

        Runs before the daemon is told the channel is ready, so the daemon
        never sees state from the previous session.
        """
        lay = self.layout
        for offset, size in (
            (lay.gpu_ctrl_offset, CTRL_SIZE),
            (lay.dpu_ctrl_offset, CTRL_SIZE),
            (lay.req_ring_offset, lay.req_slots * lay.req_slot_size),
            (lay.resp_ring_offset, lay.resp_slots * lay.resp_slot_size),
        ):
            self.mem[offset:offset + size] = bytes(size)
        self._next_seq, self._produced = 1, 0

    def poll_requests(self) -> list[tuple[RequestRecord, tuple[int, ...]]]:
        """Every request record committed since the last call, with its prompt copied out.

        A slot is valid once its commit word equals the expected sequence
        number. A CUDA kernel reads the commit word with a volatile load and
        issues ``__threadfence()`` before reading the body (acquire).
        """
        out: list[tuple[RequestRecord, tuple[int, ...]]] = []
        lay, mem, words = self.layout, self.mem, self._words
        while True:
            slot = lay.req_slot_offset(self._next_seq)
            if words[slot // 8] != self._next_seq:
                break
            record = decode_request(mem[slot:slot + lay.req_slot_size])
            prompt: tuple[int, ...] = ()
            if isinstance(record, GenerateRecord):
                prompt = self._read_prompt(record)
            out.append((record, prompt))
            self._next_seq += 1
        if out:
            # The prompt is copied out above, so the DPU may reuse the slots and
            # the arena span as soon as it sees this index. CUDA: fence first.
            words[self._gpu_ctrl + _REQ_CONSUMED] = self._next_seq - 1
        return out

    def _read_prompt(self, record: GenerateRecord) -> tuple[int, ...]:
        end = record.arena_offset + record.prompt_len * 4
        if end > self.layout.arena_size:
            raise ProtocolError(
                f"request {record.request_id}: prompt span ends at {end}, "
                f"past the {self.layout.arena_size}-byte arena"
            )
        start = self.layout.arena_offset + record.arena_offset
        ids = array.array("I")
        ids.frombytes(self.mem[start:start + record.prompt_len * 4])
        if sys.byteorder != "little":
            ids.byteswap()
        return tuple(ids)

    def free_response_slots(self) -> int:
        released = self._words[self._dpu_ctrl]  # resp_consumed, written by the DPU
        return self.layout.resp_slots - (self._produced - released)

    def publish(self, records: list[ResponseRecord]) -> int:
        """Append as many records as the ring has room for; return how many.

        Per record the body goes first and the sequence word last; once the
        batch is in place, ``resp_produced`` moves. A CUDA kernel issues
        ``__threadfence_system()`` before each of those two publishing stores,
        so that a DMA read ordered after them sees everything they cover.
        """
        lay, mem, words = self.layout, self.mem, self._words
        n = min(len(records), self.free_response_slots())
        for i in range(n):
            position = self._produced + i
            slot = lay.resp_slot_offset(position)
            mem[slot + 8:slot + lay.resp_slot_size] = encode_response_body(
                records[i], lay.resp_slot_size
            )
            words[slot // 8] = position + 1
        if n:
            self._produced += n
            words[self._gpu_ctrl + _RESP_PRODUCED] = self._produced
        return n

    def beat(self) -> None:
        """Advance the liveness counter the daemon watches."""
        self._heartbeat += 1
        self._words[self._gpu_ctrl + _HEARTBEAT] = self._heartbeat

    def release(self) -> None:
        """Drop this object's views of the region (before the region is unmapped)."""
        self._words.release()

    @property
    def consumed(self) -> int:
        """Request records taken this session (slots reused once it passes req_slots)."""
        return self._next_seq - 1

