"""In-memory pumping between the daemon's and the GPU's halves of a channel.

No socket, no QP: the DPU's operations are applied to a bytearray that the
GPU half reads and writes directly, exactly as RDMA would apply them.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_frontend.errors import PromptTooLong, ProtocolError
from dpu_frontend.ring import (
    CancelRecord,
    DpuChannel,
    FinishReason,
    GenerateRecord,
    Geometry,
    GpuChannel,
    ResponseRecord,
    SamplingParams,
)


class Pump:
    def __init__(self, geometry: Geometry) -> None:
        self.layout = geometry.plan(instance=7)
        self.mem = bytearray(self.layout.region_size)
        self.view = memoryview(self.mem)
        ch = self.layout.channels[0]
        self.dpu = DpuChannel(ch)
        self.gpu = GpuChannel(self.view, ch)
        self.gpu.reset()
        self.now = 0.0

    def flush(self) -> None:
        for op in self.dpu.take_writes():
            self.mem[op.offset:op.offset + len(op.data)] = op.data

    def poll(self) -> list[ResponseRecord]:
        self.now += 1.0
        ctrl = self.dpu.ctrl_read()
        reads = self.dpu.on_ctrl(bytes(self.mem[ctrl.offset:ctrl.offset + ctrl.length]), self.now)
        out: list[ResponseRecord] = []
        for op in reads:
            out += self.dpu.on_records(op, bytes(self.mem[op.offset:op.offset + op.length]))
        release = self.dpu.consumer_update(idle=not reads)
        if release:
            self.mem[release.offset:release.offset + len(release.data)] = release.data
        return out


def test_generate_roundtrip_carries_prompt_and_params() -> None:
    pump = Pump(Geometry(req_slots=4, arena_bytes=64, resp_slots=4))
    params = SamplingParams(max_tokens=5, temperature=0.5, top_k=3, seed=9, stop_token_ids=(1, 2),
                            ignore_eos=True)
    pump.dpu.submit(11, [5, 6, 7], params)
    pump.flush()
    [(record, prompt)] = pump.gpu.poll_requests()
    assert record == GenerateRecord(11, 0, 3, params)
    assert prompt == (5, 6, 7)
    assert pump.gpu.publish([ResponseRecord(11, (1, 2, 3)),
                             ResponseRecord(11, (4,), FinishReason.LENGTH)]) == 2
    assert pump.poll() == [ResponseRecord(11, (1, 2, 3)),
                           ResponseRecord(11, (4,), FinishReason.LENGTH)]


def test_request_credits_hold_records_until_the_gpu_consumes() -> None:
    pump = Pump(Geometry(req_slots=2, arena_bytes=64, resp_slots=4))
    for rid in (1, 2, 3):
        pump.dpu.submit(rid, [rid], SamplingParams(max_tokens=1))
    pump.flush()
    assert pump.dpu.queued == 1 and pump.dpu.in_ring == 2
    assert [r.request_id for r, _ in pump.gpu.poll_requests()] == [1, 2]
    pump.poll()  # learns req_consumed
    pump.flush()
    assert [r.request_id for r, _ in pump.gpu.poll_requests()] == [3]


def test_arena_never_wraps_a_prompt_and_reclaims_in_order() -> None:
    pump = Pump(Geometry(req_slots=8, arena_bytes=40, resp_slots=4))  # 10 tokens
    pump.dpu.submit(1, list(range(6)), SamplingParams(max_tokens=1))
    pump.dpu.submit(2, list(range(6)), SamplingParams(max_tokens=1))  # does not fit yet
    pump.flush()
    assert pump.dpu.queued == 1
    [(_first, p1)] = pump.gpu.poll_requests()
    assert p1 == tuple(range(6))
    pump.poll()
    pump.flush()
    [(second, p2)] = pump.gpu.poll_requests()
    assert isinstance(second, GenerateRecord) and second.arena_offset == 0  # skipped the tail
    assert p2 == tuple(range(6))


def test_prompt_larger_than_the_arena_is_refused() -> None:
    pump = Pump(Geometry(arena_bytes=16))
    with pytest.raises(PromptTooLong):
        pump.dpu.submit(1, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))


def test_cancel_of_a_queued_request_never_reaches_the_ring() -> None:
    pump = Pump(Geometry(req_slots=1, arena_bytes=64, resp_slots=4))
    pump.dpu.submit(1, [1], SamplingParams(max_tokens=1))
    pump.dpu.submit(2, [2], SamplingParams(max_tokens=1))
    pump.flush()
    assert pump.dpu.cancel(2) is False
    assert pump.dpu.cancel(1) is True
    pump.gpu.poll_requests()
    pump.poll()
    pump.flush()
    assert [r for r, _ in pump.gpu.poll_requests()] == [CancelRecord(1)]


def test_response_ring_backpressure_and_release() -> None:
    pump = Pump(Geometry(req_slots=2, arena_bytes=64, resp_slots=4))
    records = [ResponseRecord(1, (i,)) for i in range(6)]
    assert pump.gpu.publish(records) == 4  # ring full
    assert pump.gpu.publish(records[4:]) == 0
    assert len(pump.poll()) == 4  # consumed 4 = whole ring: released at once
    assert pump.gpu.publish(records[4:]) == 2
    assert [r.tokens for r in pump.poll()] == [(4,), (5,)]


def test_a_record_published_before_its_body_is_a_protocol_error() -> None:
    pump = Pump(Geometry(req_slots=2, arena_bytes=64, resp_slots=4))
    ch = pump.layout.channels[0]
    pump.mem[ch.gpu_ctrl_offset:ch.gpu_ctrl_offset + 8] = (1).to_bytes(8, "little")
    with pytest.raises(ProtocolError, match="carries sequence 0"):
        pump.poll()


def test_peer_index_going_back_is_a_protocol_error() -> None:
    pump = Pump(Geometry(req_slots=2, arena_bytes=64, resp_slots=4))
    pump.gpu.publish([ResponseRecord(1, (1,))])
    pump.poll()
    ch = pump.layout.channels[0]
    pump.mem[ch.gpu_ctrl_offset:ch.gpu_ctrl_offset + 8] = (0).to_bytes(8, "little")
    with pytest.raises(ProtocolError, match="went back"):
        pump.poll()


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=12), min_size=1, max_size=30),
    req_slots=st.integers(1, 5),
    resp_slots=st.integers(2, 6),
    per_poll=st.integers(1, 4),
)
def test_any_interleaving_delivers_every_token_once_in_order(
    prompts: list[list[int]], req_slots: int, resp_slots: int, per_poll: int
) -> None:
    """The GPU echoes each prompt back, a few records a step; nothing is lost or reordered."""
    pump = Pump(Geometry(req_slots=req_slots, arena_bytes=64, resp_slots=resp_slots,
                         resp_slot_size=32))  # 2 tokens per record
    for rid, prompt in enumerate(prompts, 1):
        pump.dpu.submit(rid, prompt, SamplingParams(max_tokens=1))
    backlog: list[ResponseRecord] = []
    got: dict[int, list[int]] = {}
    finished: set[int] = set()
    for _ in range(10_000):
        pump.flush()
        for record, prompt in pump.gpu.poll_requests():
            assert isinstance(record, GenerateRecord)
            chunks = [prompt[i:i + 2] for i in range(0, len(prompt), 2)] or [()]
            backlog += [ResponseRecord(record.request_id, c) for c in chunks[:-1]]
            backlog.append(ResponseRecord(record.request_id, chunks[-1], FinishReason.STOP))
        sent = pump.gpu.publish(backlog[:per_poll])
        del backlog[:sent]
        for rec in pump.poll():
            assert rec.request_id not in finished
            got.setdefault(rec.request_id, []).extend(rec.tokens)
            if rec.final:
                finished.add(rec.request_id)
        if len(finished) == len(prompts):
            break
    assert {rid: got.get(rid, []) for rid in finished} == {
        rid: p for rid, p in enumerate(prompts, 1)
    }
