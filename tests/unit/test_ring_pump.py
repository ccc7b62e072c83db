"""In-memory pumping between the daemon's and the GPU's halves of a channel.

No socket, no QP: the DPU's operations are applied to a buffer that the GPU
half reads and writes through the same ``AtomicMemory`` the peers use,
exactly as RDMA would apply them.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_frontend.errors import LayoutMismatch, PromptTooLong, ProtocolError, RequestError
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
from dpu_frontend.ring.automaton import (
    NONE,
    CheckedAutomaton,
    Constraint,
    TokenAutomaton,
    automaton_identity,
    encode_automaton,
)
from dpu_frontend.ring.layout import (
    ALIGN,
    FEATURE_LOGPROBS,
    HEADER_STRUCT,
    decode_layout,
    validate,
)
from dpu_frontend.ring.mailbox import (
    ChannelState,
    Command,
    HostMailbox,
    KernelMailbox,
    MailboxError,
    mailbox_area_size,
)
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.ring.records import REQUEST_BODY_OFFSET, encode_request_body

from .interleave import apply


class Pump:
    def __init__(self, geometry: Geometry, epoch: int = 1) -> None:
        self.layout = geometry.plan(instance=7)
        self.mem = AtomicMemory(bytearray(self.layout.region_size))
        self.ch = self.layout.channels[0]
        self.dpu = DpuChannel(self.ch, epoch)
        self.gpu = GpuChannel(self.mem, self.ch)
        self.gpu.reset(epoch)
        self.now = 0.0

    def flush(self) -> None:
        writes, _sent = self.dpu.take_writes()
        for op in writes:
            apply(self.mem, op)

    def poll(self) -> list[ResponseRecord]:
        """One poll as the transports run it: WRITEs, the control READ, the fenced window
        READ, then exact READs past the window."""
        self.now += 1.0
        poll = self.dpu.begin_poll()
        for op in poll.writes:
            apply(self.mem, op)
        data = [self.mem.read(read.offset, read.length) for read in poll.reads]
        records, more = self.dpu.end_poll(poll, data, self.now)
        for read in more:
            records += self.dpu.on_records(read, self.mem.read(read.offset, read.length))
        return records


def small(**kw: Any) -> Geometry:
    base = {"req_slots": 4, "arena_bytes": 512, "resp_slots": 4, "max_sequences": 2}
    return Geometry(**(base | kw))


def test_generate_roundtrip_carries_prompt_and_params() -> None:
    pump = Pump(small())
    params = SamplingParams(max_tokens=5, temperature=0.5, top_k=3, seed=9, stop_token_ids=(1, 2),
                            ignore_eos=True)
    pump.dpu.submit(11, [5, 6, 7], params)
    pump.flush()
    [(record, prompt, automaton, *_)] = pump.gpu.poll_requests()
    assert record == GenerateRecord(11, 0, 3, params)
    assert prompt == (5, 6, 7) and automaton == b""
    assert pump.gpu.publish([ResponseRecord(11, (1, 2, 3)),
                             ResponseRecord(11, (4,), FinishReason.LENGTH)]) == 2
    assert pump.poll() == [ResponseRecord(11, (1, 2, 3)),
                           ResponseRecord(11, (4,), FinishReason.LENGTH)]


def test_request_credits_hold_records_until_the_gpu_consumes() -> None:
    pump = Pump(small(req_slots=2, max_sequences=4, resp_slots=8))
    for rid in (1, 2, 3):
        pump.dpu.submit(rid, [rid], SamplingParams(max_tokens=1))
    pump.flush()
    assert pump.dpu.queued == 1 and pump.dpu.in_ring == 2
    assert [t.record.request_id for t in pump.gpu.poll_requests()] == [1, 2]
    pump.poll()  # learns req_consumed
    pump.flush()
    assert [t.record.request_id for t in pump.gpu.poll_requests()] == [3]


def test_the_sequence_window_holds_generates_but_never_a_cancel() -> None:
    """Cancels cannot wait behind generates: with the window full, a cancel still goes."""
    pump = Pump(small(max_sequences=1, resp_slots=2))
    pump.dpu.submit(1, [1], SamplingParams(max_tokens=9))
    pump.dpu.submit(2, [2], SamplingParams(max_tokens=9))
    pump.flush()
    assert [t.record.request_id for t in pump.gpu.poll_requests()] == [1]
    assert pump.dpu.open_sequences == 1 and pump.dpu.queued == 1  # 2 waits for the window
    assert pump.dpu.cancel(1) is True
    # The cancel is queued too, but it is not a request waiting: the gauges and the
    # admission limit count only generates.
    assert pump.dpu.queued == 2 and pump.dpu.waiting == 1
    pump.poll()
    pump.flush()
    assert [t.record for t in pump.gpu.poll_requests()] == [CancelRecord(1)]
    pump.gpu.publish([ResponseRecord(1, (), FinishReason.CANCELLED)])
    pump.poll()  # the final record closes 1: the window opens for 2
    pump.flush()
    assert [t.record.request_id for t in pump.gpu.poll_requests()] == [2]


def test_arena_never_wraps_a_prompt_aligns_spans_and_reclaims_in_order() -> None:
    pump = Pump(small(req_slots=8, arena_bytes=3 * ALIGN, max_sequences=4, resp_slots=8))
    pump.dpu.submit(1, list(range(20)), SamplingParams(max_tokens=1))  # 80 B: one 128 B span
    pump.dpu.submit(2, list(range(40)), SamplingParams(max_tokens=1))  # 160 B: two spans
    pump.dpu.submit(3, list(range(40)), SamplingParams(max_tokens=1))  # does not fit yet
    pump.flush()
    assert pump.dpu.queued == 1
    got = pump.gpu.poll_requests()
    assert [(r.arena_offset, p) for r, p, *_ in got if isinstance(r, GenerateRecord)] == [
        (0, tuple(range(20))), (ALIGN, tuple(range(40)))]
    pump.poll()
    pump.flush()
    [(third, p3, *_)] = pump.gpu.poll_requests()
    assert isinstance(third, GenerateRecord) and third.arena_offset == 0  # skipped the tail
    assert p3 == tuple(range(40))


def test_prompt_longer_than_the_gpu_takes_is_refused() -> None:
    pump = Pump(small(max_prompt_tokens=4))
    with pytest.raises(PromptTooLong, match="4 tokens"):
        pump.dpu.submit(1, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))


def test_cancel_of_a_queued_request_never_reaches_the_ring() -> None:
    pump = Pump(small(req_slots=1))
    pump.dpu.submit(1, [1], SamplingParams(max_tokens=1))
    pump.dpu.submit(2, [2], SamplingParams(max_tokens=1))
    pump.flush()
    assert pump.dpu.cancel(2) is False
    assert pump.dpu.cancel(1) is True
    pump.gpu.poll_requests()
    pump.poll()
    pump.flush()
    assert [t.record for t in pump.gpu.poll_requests()] == [CancelRecord(1)]


def test_response_ring_backpressure_and_release() -> None:
    pump = Pump(small())
    records = [ResponseRecord(1, (i,)) for i in range(6)]
    assert pump.gpu.publish(records) == 4  # ring full
    assert pump.gpu.publish(records[4:]) == 0
    assert pump.gpu.counters.ring_full_waits == 2
    assert len(pump.poll()) == 4
    pump.poll()  # the credit WRITE rides in the next poll's batch
    assert pump.gpu.publish(records[4:]) == 2
    assert [r.tokens for r in pump.poll()] == [(4,), (5,)]


def test_records_past_the_speculative_window_are_read_exactly() -> None:
    pump = Pump(small(resp_slots=64, max_sequences=32))
    records = [ResponseRecord(1, (i,)) for i in range(40)]  # more than the first window
    assert pump.gpu.publish(records) == 40
    assert pump.poll() == records


def test_a_record_published_before_its_body_is_a_protocol_error() -> None:
    pump = Pump(small())
    pump.mem.store_release(pump.ch.gpu_ctrl_offset, 1)
    with pytest.raises(ProtocolError, match="carries sequence 0"):
        pump.poll()


def test_peer_index_going_back_is_a_protocol_error() -> None:
    pump = Pump(small())
    pump.gpu.publish([ResponseRecord(1, (1,))])
    pump.poll()
    pump.mem.store_release(pump.ch.gpu_ctrl_offset, 0)
    with pytest.raises(ProtocolError, match="went back"):
        pump.poll()


def test_a_channel_reset_under_the_daemon_is_a_protocol_error() -> None:
    """A record or a control block of another epoch is never accepted."""
    pump = Pump(small())
    pump.gpu.reset(2)
    with pytest.raises(ProtocolError, match="reset under us"):
        pump.poll()
    stale = Pump(small(), epoch=2)
    stale.gpu.epoch = 1  # a store from a step of the previous attachment
    stale.gpu.publish([ResponseRecord(1, (1,))])
    with pytest.raises(ProtocolError, match="earlier attachment"):
        stale.poll()


@pytest.mark.parametrize("tokens", [(1,), (1, 2, 3)], ids=["one-token", "three-tokens"])
@pytest.mark.parametrize("laps", [0, 1, 3])
def test_a_record_of_another_epoch_is_refused_on_any_lap(laps: int, tokens: tuple[int, ...]) -> None:
    """A step of the previous attachment, still in flight, stores the very record the DPU
    reads next, with the right sequence word: only its epoch tells. After the first lap
    the slot's old record has this epoch too, so the check cannot lean on zeroed slots.
    One token and three: ``decode_responses`` reads the first in one unpack."""
    pump = Pump(small(), epoch=2)
    for i in range(laps * pump.ch.resp_slots):
        pump.gpu.publish([ResponseRecord(1, (i,))])
        assert pump.poll() == [ResponseRecord(1, (i,))]
    pump.gpu.epoch = 1
    pump.gpu.publish([ResponseRecord(1, tokens)])
    with pytest.raises(ProtocolError, match="earlier attachment"):
        pump.poll()


@pytest.mark.parametrize("laps", [0, 1, 3])
def test_a_request_record_of_another_epoch_is_counted_and_skipped_on_any_lap(laps: int) -> None:
    """The GPU side's twin: a record a daemon of the previous attachment wrote, with the
    commit word the GPU expects next, is bad; the channel goes on."""
    pump = Pump(small(), epoch=2)
    for rid in range(1, laps * pump.ch.req_slots + 1):
        pump.dpu.submit(rid, [rid], SamplingParams(max_tokens=1))
        pump.flush()
        assert [t.record.request_id for t in pump.gpu.poll_requests()] == [rid]
        pump.gpu.publish([ResponseRecord(rid, (), FinishReason.STOP)])
        pump.poll()
    pump.dpu.epoch = 1
    pump.dpu.submit(100, [1], SamplingParams(max_tokens=1))
    pump.flush()
    assert pump.gpu.poll_requests() == []
    assert pump.gpu.counters.bad_records == 1 and pump.gpu.consumed == laps * pump.ch.req_slots + 1


def test_the_gpu_counts_and_skips_a_corrupt_record() -> None:
    pump = Pump(small())
    slot = pump.ch.req_slot_offset(1)
    body = bytearray(encode_request_body(CancelRecord(5), epoch=1))
    struct.pack_into("<I", body, 0, 9)  # an unknown kind
    pump.mem.write(slot + REQUEST_BODY_OFFSET, bytes(body))
    pump.mem.store_release(slot, 1)
    pump.dpu._next_seq = 2  # the daemon writes its own records after the corrupt one
    pump.dpu.submit(7, [1, 2], SamplingParams(max_tokens=1))
    pump.flush()
    assert [t.record.request_id for t in pump.gpu.poll_requests()] == [7]
    assert pump.gpu.counters.bad_records == 1 and pump.gpu.consumed == 2


def test_out_of_order_writers_publish_only_a_contiguous_prefix() -> None:
    """Warps finish in any order; resp_produced never passes a record not yet written."""
    pump = Pump(small(resp_slots=8, max_sequences=4))
    positions = pump.gpu.reserve(3)
    records = [ResponseRecord(p, (p,)) for p in positions]
    pump.gpu.write(positions[2], records[2])
    assert pump.gpu.advance() == 0 and pump.poll() == []
    pump.gpu.write(positions[0], records[0])
    assert pump.gpu.advance() == 1 and pump.poll() == records[:1]
    pump.gpu.write(positions[1], records[1])
    assert pump.gpu.advance() == 3 and pump.poll() == records[1:]


def test_mailbox_commands_and_acks() -> None:
    mem = AtomicMemory(bytearray(mailbox_area_size(2)))
    host, kernel = HostMailbox(mem, 1), KernelMailbox(mem, 1)
    assert kernel.pending() is None
    seq = host.post(Command.ATTACH, epoch=5)
    assert host.acked(seq) is None
    assert kernel.pending() == (seq, Command.ATTACH, 5)
    kernel.ack(seq, ChannelState.ATTACHED, MailboxError.OK)
    assert host.acked(seq) is not None and kernel.pending() is None
    ack = host.acked(seq)
    assert ack is not None and (ack.state, ack.error) == (ChannelState.ATTACHED, MailboxError.OK)
    kernel.publish_counters({"records": 3, "ring_full_waits": 4})
    assert host.counters()["records"] == 3 and host.counters()["ring_full_waits"] == 4
    assert HostMailbox(mem, 0).counters()["records"] == 0  # channels do not share a mailbox


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=12), min_size=1, max_size=30),
    req_slots=st.integers(1, 5),
    sequences=st.integers(1, 3),
    per_poll=st.integers(1, 4),
)
def test_any_interleaving_delivers_every_token_once_in_order(
    prompts: list[list[int]], req_slots: int, sequences: int, per_poll: int
) -> None:
    """The GPU echoes each prompt back, a few records a step; nothing is lost or reordered."""
    pump = Pump(Geometry(req_slots=req_slots, arena_bytes=1024, resp_slots=2 * sequences,
                         resp_slot_size=64, logprobs=False,
                         max_sequences=sequences))  # 8 tokens per record
    for rid, prompt in enumerate(prompts, 1):
        pump.dpu.submit(rid, prompt, SamplingParams(max_tokens=1))
    backlog: list[ResponseRecord] = []
    got: dict[int, list[int]] = {}
    finished: set[int] = set()
    for _ in range(10_000):
        pump.flush()
        for record, echoed, *_ in pump.gpu.poll_requests():
            assert isinstance(record, GenerateRecord)
            chunks = [echoed[i:i + 8] for i in range(0, len(echoed), 8)] or [()]
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


# -- structured output (minor version 2): an automaton after the prompt ------------------


AUTOMATON = bytes(range(200))  # the ring moves it; decoding it is the peer's (test_automaton)
#: Over 8 ids: token 1 from state 0 to 1, which may only end (7).
CHAIN = TokenAutomaton(8, 7, array("i", [0, 1, 2]), array("i", [1, 7]), array("i", [1, 1]),
                       array("i", [NONE, NONE]), array("i", [NONE, NONE]), array("I"))


def test_an_automaton_follows_its_prompt_in_the_arena() -> None:
    pump = Pump(small(arena_bytes=4096, max_automaton_bytes=1024, max_prompt_tokens=100))
    params = SamplingParams(max_tokens=5)
    pump.dpu.submit(1, [5, 6, 7], params, Constraint(AUTOMATON, "guided_regex"))
    pump.dpu.submit(2, [8], params)  # unconstrained: its span starts after the automaton
    pump.flush()
    [first, second] = pump.gpu.poll_requests()
    assert first.record == GenerateRecord(1, 0, 3, params, automaton_bytes=200)
    assert first.record.automaton_offset == ALIGN  # the 12-byte prompt, rounded up
    assert first.prompt == (5, 6, 7) and first.automaton == AUTOMATON
    assert second.record == GenerateRecord(2, 3 * ALIGN, 1, params)
    assert second.prompt == (8,) and second.automaton == b""


def test_an_automaton_the_gpu_side_holds_is_not_read_again() -> None:
    """One key, one automaton: the GPU side names an automaton by its header's key and
    size, and a request of one it holds is handed the checked copy, its bytes unread."""
    pump = Pump(small(arena_bytes=4096, max_automaton_bytes=1024, max_prompt_tokens=100))
    params = SamplingParams(max_tokens=5)
    encoded = encode_automaton(CHAIN, key=9)
    held = CheckedAutomaton(CHAIN, automaton_identity(encoded, len(encoded)))
    asked: list[bytes] = []

    def cached(identity: bytes) -> CheckedAutomaton | None:
        asked.append(identity)
        return held if identity == held.digest else None

    pump.dpu.submit(1, [5], params, Constraint(encoded))
    pump.dpu.submit(2, [6], params, Constraint(encode_automaton(CHAIN, key=10)))
    pump.flush()
    first, second = pump.gpu.poll_requests(cached)
    assert (first.checked, first.automaton, first.identity) == (held, b"", held.digest)
    assert second.checked is None and second.automaton == encode_automaton(CHAIN, key=10)
    assert asked == [held.digest, second.identity]


def test_a_channel_without_automata_or_with_smaller_ones_refuses_before_writing() -> None:
    plain = Pump(small())
    with pytest.raises(RequestError, match="does not decode structured output") as no:
        plain.dpu.submit(1, [5], SamplingParams(max_tokens=5), Constraint(AUTOMATON, "x"))
    assert no.value.param == "x" and no.value.code == "unsupported_parameter"
    bounded = Pump(small(arena_bytes=4096, max_automaton_bytes=128, max_prompt_tokens=100))
    with pytest.raises(RequestError, match="takes 200 bytes, more than the 128") as large:
        bounded.dpu.submit(1, [5], SamplingParams(max_tokens=5), Constraint(AUTOMATON))
    assert large.value.param == "response_format" and large.value.code == "constraint_too_large"
    assert plain.dpu.queued == bounded.dpu.queued == 0


def test_the_gpu_side_refuses_an_automaton_its_layout_does_not_offer() -> None:
    """A record that says CONSTRAINED on a channel without the feature (or one larger
    than the channel takes) is a bad record, never served unconstrained."""
    pump = Pump(small(arena_bytes=4096, max_automaton_bytes=1024, max_prompt_tokens=100))
    pump.gpu.layout = replace(pump.ch, features=FEATURE_LOGPROBS, max_automaton_bytes=0)
    pump.dpu.submit(1, [5], SamplingParams(max_tokens=5), Constraint(AUTOMATON))
    pump.flush()
    assert pump.gpu.poll_requests() == [] and pump.gpu.counters.bad_records == 1


def test_the_layout_offers_automata_from_minor_version_2() -> None:
    layout = Geometry(arena_bytes=4096, max_automaton_bytes=1024, max_prompt_tokens=100).plan(3)
    ch = layout.channels[0]
    assert ch.constraints and ch.max_automaton_bytes == 1024
    assert decode_layout(layout.encode()).channels[0] == ch
    older = bytearray(layout.encode())
    struct.pack_into("<H", older, HEADER_STRUCT.offset("version_minor"), 1)
    ch1 = decode_layout(bytes(older)).channels[0]  # the bound's bytes were reserved in 2.1
    assert not ch1.constraints and ch1.max_automaton_bytes == 0 and ch1.logprobs
    # The prompt arena holds the longest prompt beside the largest automaton.
    assert Geometry(arena_bytes=4096, max_automaton_bytes=1024).prompt_tokens == 768
    with pytest.raises(ValueError, match="must fit the arena"):
        Geometry(arena_bytes=4096, max_automaton_bytes=1024, max_prompt_tokens=1000)
    with pytest.raises(LayoutMismatch, match="cannot hold the longest prompt"):
        validate(replace(layout, channels=(replace(ch, max_automaton_bytes=8192),)))
