"""Records written behind each engine step (``--records gpu``), with the writer's
Python twin on a real ring region (no GPU): the same tokens as the engine
generates, one final per request, cancels, refusals, a full ring that holds only
its own channel, and a reset."""

from __future__ import annotations

import asyncio
from array import array
from collections import defaultdict

import numpy as np
import pytest

from dpu_frontend.config import PeerConfig, RdmaConfig
from dpu_frontend.model.engine import Completion, ModelEngine
from dpu_frontend.model.publish import HostRecordBackend, RingRecords, Target
from dpu_frontend.model.source import EngineHub, RingSource
from dpu_frontend.peer.reference import ReferenceKernel
from dpu_frontend.peer.region import VerbsRegion
from dpu_frontend.ring import (
    FinishReason,
    Geometry,
    GpuChannel,
    Layout,
    ResponseRecord,
    SamplingParams,
)
from dpu_frontend.ring.automaton import Constraint, TokenAutomaton, encode_automaton
from dpu_frontend.ring.dpu import DpuChannel
from dpu_frontend.ring.layout import DPU_CTRL_STRUCT, GPU_CTRL_STRUCT
from dpu_frontend.ring.mailbox import Ack, ChannelState, Command, HostMailbox, MailboxError
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.ring.records import decode_response
from tests.model.test_engine import EOS, engine

_PRODUCED = GPU_CTRL_STRUCT.offset("resp_produced")
_CONSUMED = DPU_CTRL_STRUCT.offset("resp_consumed")


class Dpu:
    """Reads every channel's response ring as the daemon does: up to resp_produced,
    each record's seq checked, then resp_consumed released."""

    def __init__(self, layout: Layout, memory: AtomicMemory, epoch: int = 1) -> None:
        self.layout, self.memory = layout, memory
        self.read = [0] * len(layout.channels)
        self.epoch = [epoch] * len(layout.channels)
        self.records: dict[int, list[ResponseRecord]] = defaultdict(list)

    def poll(self, channels: list[int] | None = None) -> None:
        for c in channels if channels is not None else range(len(self.layout.channels)):
            ch = self.layout.channels[c]
            produced = self.memory.load_acquire(ch.gpu_ctrl_offset + _PRODUCED)
            while self.read[c] < produced:
                p = self.read[c]
                off = ch.resp_slot_offset(p)
                data = self.memory.read(off, ch.resp_slot_size)
                self.records[c].append(decode_response(data, 0, p + 1, ch.resp_slot_size,
                                                       self.epoch[c]))
                self.read[c] += 1
            self.memory.store_release(ch.dpu_ctrl_offset + _CONSUMED, self.read[c])

    def streams(self, c: int) -> dict[int, list[ResponseRecord]]:
        out: dict[int, list[ResponseRecord]] = defaultdict(list)
        for r in self.records[c]:
            out[r.request_id].append(r)
        return out


def ring(channels: int = 2, resp_slots: int = 64, max_seqs: int = 8,
         overlap: bool = True) -> tuple[ModelEngine, RingRecords, Dpu]:
    layout = Geometry(channels=channels, req_slots=16, arena_bytes=4096, resp_slots=resp_slots,
                      max_sequences=min(resp_slots // 2, 32)).plan(instance=1)
    memory = AtomicMemory(bytearray(layout.region_size))
    eng = engine(overlap, max_seqs=max_seqs)
    backend = HostRecordBackend(layout, memory, max_seqs, tuple(eng.eos))
    records = RingRecords(backend, layout, memory, max_seqs)
    for c in range(channels):
        records.reset(c, 1)
    eng.publish_to(records)
    return eng, records, Dpu(layout, memory)


def run(eng: ModelEngine, dpu: Dpu, steps: int = 10_000) -> None:
    for _ in range(steps):
        dpu.poll()
        if eng.idle:
            return
        eng.step()
    raise AssertionError("the engine never went idle")


def expected(prompts: list[list[int]], params: list[SamplingParams],
             overlap: bool) -> list[Completion]:
    reference = engine(overlap, max_seqs=8)
    return reference.generate(prompts, params)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_gpu_records_carry_what_the_engine_generates(overlap: bool) -> None:
    eng, _, dpu = ring(overlap=overlap)
    prompts = [[1 + i] * (3 + i) for i in range(12)]
    params = [SamplingParams(max_tokens=5 + i, seed=i, logprobs=(2 if i % 3 == 0 else None),
                             ignore_eos=i % 4 == 1) for i in range(12)]
    want = expected(prompts, params, overlap)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        eng.add(i, prompt, p, Target(i % 2, 100 + i))
    run(eng, dpu)
    for i, completion in enumerate(want):
        stream = dpu.streams(i % 2)[100 + i]
        assert [t for r in stream for t in r.tokens] == completion.tokens
        assert [r.finish for r in stream[:-1]] == [FinishReason.NONE] * (len(stream) - 1)
        assert stream[-1].finish is completion.finish
        if params[i].logprobs is not None:
            entries = [e for r in stream for e in (r.logprobs or ())]
            assert [e.logprob for e in entries] == pytest.approx(completion.logprobs)
            assert all(len(e.top) == 2 for e in entries)
        else:
            assert all(r.logprobs is None for r in stream)
        if completion.finish is FinishReason.STOP:
            assert stream[-1].tokens == ()  # the stop token is not emitted
    assert len(want) == 12 and any(c.finish is FinishReason.STOP for c in want)


def test_cancel_ends_a_request_once_and_a_refusal_gets_an_error() -> None:
    eng, records, dpu = ring()
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    eng.add(0, [5, 6, 7], long, Target(0, 10))  # running when cancelled
    eng.add(1, [5, 6, 8], long, Target(0, 11))  # cancelled twice
    for _ in range(3):
        eng.step()
    eng.cancel(0)
    eng.cancel(1)
    eng.cancel(1)
    records.final(-1, Target(1, 99), FinishReason.ERROR)  # refused before admission
    run(eng, dpu)
    s0, s1 = dpu.streams(0), dpu.streams(1)
    for rid in (10, 11):
        finals = [r for r in s0[rid] if r.finish is not FinishReason.NONE]
        assert finals == [ResponseRecord(rid, (), FinishReason.CANCELLED)]
        assert s0[rid][-1] is finals[0]
    assert s1[99] == [ResponseRecord(99, (), FinishReason.ERROR)]
    assert records.tally(0).cancelled == 2 and records.tally(1).completed == 1


def test_a_cancel_after_the_last_record_adds_nothing() -> None:
    eng, _, dpu = ring(overlap=True)
    eng.add(0, [3], SamplingParams(max_tokens=2, ignore_eos=True), Target(0, 1))
    eng.step()
    eng.step()  # the second token's step is launched: its record ends the request
    assert not eng.idle  # the host has not landed it yet
    eng.cancel(0)
    run(eng, dpu)
    stream = dpu.streams(0)[1]
    assert [r.finish for r in stream] == [FinishReason.NONE, FinishReason.LENGTH]


def test_a_cancel_between_prefill_chunks_still_ends_the_request() -> None:
    eng, records, dpu = ring()
    eng.add(0, [3] * 100, SamplingParams(max_tokens=4), Target(0, 1))
    eng.step()  # a first 64-token chunk: no token drawn, the slot armed by a launch alone
    eng.cancel(0)
    run(eng, dpu)
    assert dpu.streams(0)[1] == [ResponseRecord(1, (), FinishReason.CANCELLED)]
    assert not records.pending


def test_a_full_ring_holds_its_own_channel_and_loses_nothing() -> None:
    """Channel 0's reader stops: its sequences wait for room; channel 1 runs on.
    When the reader comes back every token arrives, in order."""
    eng, records, dpu = ring(resp_slots=16, max_seqs=8)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, seed=i) for i in range(4)]
    for i in range(4):
        eng.add(i, [7, i], params[i], Target(0, i))
        eng.add(10 + i, [7, i], params[i], Target(1, i))
    for _ in range(60):
        eng.step()
        dpu.poll([1])  # channel 0's DPU reads nothing
    assert all(len(dpu.streams(1)[i]) == 30 for i in range(4))
    assert records.tally(0).reserved == 16  # the whole ring, not a slot more
    assert records.ring_full_waits[0] > 0 and records.ring_full_waits[1] == 0
    run(eng, dpu)
    reference = {i: c.tokens for i, c in enumerate(
        expected([[7, i] for i in range(4)], params, True))}
    for i in range(4):
        stream = dpu.streams(0)[i]
        assert [t for r in stream for t in r.tokens] == reference[i]
        assert stream[-1].finish is FinishReason.LENGTH


def test_a_reset_restarts_the_channel_and_drops_what_was_queued_for_it() -> None:
    eng, records, dpu = ring()
    eng.add(0, [4], SamplingParams(max_tokens=50, ignore_eos=True), Target(0, 1))
    eng.add(1, [4], SamplingParams(max_tokens=3, ignore_eos=True), Target(1, 1))
    for _ in range(3):
        eng.step()
        dpu.poll()
    eng.cancel(0, final=False)
    records.final(-1, Target(0, 2), FinishReason.ERROR)  # queued for the old epoch
    records.drain()  # as the peer does at ATTACH: drained, the ring zeroed, then the writer
    GpuChannel(dpu.memory, dpu.layout.channels[0]).reset(2)
    records.reset(0, 2)
    dpu.read[0], dpu.epoch[0] = 0, 2
    eng.add(2, [4], SamplingParams(max_tokens=2, ignore_eos=True), Target(0, 7))
    run(eng, dpu)
    new = [r for r in dpu.records[0] if r.request_id == 7]
    assert [r.finish for r in new] == [FinishReason.NONE, FinishReason.LENGTH]
    assert records.tally(0).epoch == 2 and records.tally(0).reserved == 2
    assert not any(r.request_id == 2 for r in dpu.records[0])
    assert dpu.streams(1)[1][-1].finish is FinishReason.LENGTH


def test_stop_ids_and_eos_are_judged_on_the_writer_side() -> None:
    """The writer's own judgement (a twin of the kernel's): an EOS ends a sequence
    unless ignore_eos, a stop id always does, and neither is emitted."""
    eng, _, dpu = ring()
    eng.add(0, [9], SamplingParams(max_tokens=200), Target(0, 1))
    run(eng, dpu)
    stream = dpu.streams(0)[1]
    tokens = [t for r in stream for t in r.tokens]
    assert EOS not in tokens
    assert stream[-1].finish in (FinishReason.STOP, FinishReason.LENGTH)
    assert np.all(np.array(tokens) != EOS)


def poll(dpu: DpuChannel, memory: AtomicMemory) -> list[ResponseRecord]:
    """One poll of the daemon's side, its RDMA operations as copies."""
    p = dpu.begin_poll()
    for w in p.writes:
        memory.write(w.offset, w.data)
    records, more = dpu.end_poll(p, [memory.read(r.offset, r.length) for r in p.reads], 0.0)
    for op in more:
        records += dpu.on_records(op, memory.read(op.offset, op.length))
    return records


def tick(kernel: ReferenceKernel, hub: EngineHub) -> None:
    """One turn of the peer's loop (``ReferenceKernel._run``'s body)."""
    for channel in kernel._channels:
        kernel._obey(channel)
        if channel.attached:
            kernel._intake(channel, 0.0)
    asyncio.run(hub.step())
    for channel in kernel._channels:
        if channel.attached:
            kernel._publish(channel, 0.0)
        channel.mailbox.publish_counters(kernel._counters(channel))


def test_with_gpu_records_a_broken_automaton_ends_its_request_with_an_error() -> None:
    """The model peer's loop with ``RingSource`` channels takes structured output: a
    request whose automaton fails its checks is counted bad and ended with an error
    record by the ring's writer (the loop publishes nothing for such a source), and a
    request beside it with a good automaton runs on."""
    eng = engine(True, max_seqs=8)
    hub = EngineHub(eng, lambda memory, lay: RingRecords(
        HostRecordBackend(lay, memory, 8, tuple(eng.eos)), lay, memory, 8))
    vocab = eng.config.vocab_size
    kernel = ReferenceKernel(PeerConfig(transport="verbs"), [], (), vocab_size=vocab,
                             sources=lambda c, space: RingSource(hub, c), between_steps=hub.step,
                             stats=hub.stats, opened=hub.opened, closing=hub.closed)
    layout = Geometry(req_slots=16, arena_bytes=8192, resp_slots=64, max_sequences=32,
                      max_prompt_tokens=64, max_automaton_bytes=4096).plan(instance=5)
    kernel.open(layout, VerbsRegion(RdmaConfig()))
    memory, mailbox = kernel._region, HostMailbox(kernel.mailbox, 0)
    assert memory is not None
    seq = mailbox.post(Command.ATTACH, 3)
    tick(kernel, hub)
    assert mailbox.acked(seq) == Ack(ChannelState.ATTACHED, MailboxError.OK)
    dpu = DpuChannel(layout.channels[0], 3)
    # Over the model's ids: token 5 from state 0 to 1, which may only end.
    good = encode_automaton(TokenAutomaton(
        vocab, EOS, array("i", [0, 1, 2]), array("i", [5, EOS]), array("i", [1, 1]),
        array("i", [-1, -1]), array("i", [-1, -1]), array("I")), key=1)
    broken = bytearray(good)
    broken[0] ^= 0xFF  # the magic
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=1)
    dpu.submit(1, [5, 6, 7], params, Constraint(bytes(broken)))
    dpu.submit(2, [5, 6, 8], params, Constraint(good))
    got: dict[int, list[ResponseRecord]] = defaultdict(list)
    for _ in range(30):
        for r in poll(dpu, memory):
            got[r.request_id].append(r)
        tick(kernel, hub)
    assert got[1] == [ResponseRecord(1, (), FinishReason.ERROR)]
    assert got[2] and got[2][-1].final
    assert HostMailbox(kernel.mailbox, 0).counters()["bad_records"] == 1
    assert eng.stats.constrained == 1


def test_the_peer_loop_with_gpu_records_cancels_and_reattaches() -> None:
    """The model peer's loop with ``RingSource`` channels (the writer's Python twin in
    place of the kernel), a daemon's channel on the other side: requests in, records
    out, a cancel, a refused prompt, and a reattach at a new epoch."""
    eng = engine(True, max_seqs=8)
    hub = EngineHub(eng, lambda memory, lay: RingRecords(
        HostRecordBackend(lay, memory, 8, tuple(eng.eos)), lay, memory, 8))
    kernel = ReferenceKernel(PeerConfig(transport="verbs"), [], (),
                             sources=lambda c, space: RingSource(hub, c), between_steps=hub.step,
                             stats=hub.stats, opened=hub.opened, closing=hub.closed)
    layout = Geometry(channels=2, req_slots=16, arena_bytes=8192, resp_slots=64,
                      max_sequences=32).plan(instance=5)
    kernel.open(layout, VerbsRegion(RdmaConfig()))  # an anonymous mapping: no file, no NIC
    memory, mailbox = kernel._region, HostMailbox(kernel.mailbox, 0)
    assert memory is not None

    def attach(epoch: int) -> DpuChannel:
        seq = mailbox.post(Command.ATTACH, epoch)
        tick(kernel, hub)
        assert mailbox.acked(seq) == Ack(ChannelState.ATTACHED, MailboxError.OK)
        return DpuChannel(layout.channels[0], epoch)

    dpu = attach(7)
    short = SamplingParams(max_tokens=6, ignore_eos=True, seed=1)
    dpu.submit(1, [5, 6, 7], short)
    dpu.submit(2, [5, 6, 8], SamplingParams(max_tokens=500, ignore_eos=True, seed=2))
    dpu.submit(3, [eng.config.vocab_size + 5], short)  # the engine refuses this prompt
    got: dict[int, list[ResponseRecord]] = defaultdict(list)
    for i in range(40):
        if i == 20:
            dpu.cancel(2)
        for r in poll(dpu, memory):
            got[r.request_id].append(r)
        tick(kernel, hub)
    want = expected([[5, 6, 7]], [short], True)[0]
    assert [t for r in got[1] for t in r.tokens] == want.tokens
    assert got[1][-1].finish is FinishReason.LENGTH
    assert got[2][-1] == ResponseRecord(2, (), FinishReason.CANCELLED)
    assert 10 < sum(len(r.tokens) for r in got[2]) < 40
    assert got[3] == [ResponseRecord(3, (), FinishReason.ERROR)]
    counters = HostMailbox(kernel.mailbox, 0).counters()
    assert counters["completed"] == 2 and counters["cancelled"] == 1
    assert counters["tokens"] == sum(len(r.tokens) for rs in got.values() for r in rs)

    dpu.submit(4, [9], SamplingParams(max_tokens=200, ignore_eos=True, seed=4))
    for _ in range(3):
        poll(dpu, memory)
        tick(kernel, hub)
    dpu = attach(8)  # the daemon came back: request 4 is dropped without a record
    dpu.submit(5, [5, 6, 7], short)
    after: list[ResponseRecord] = []
    for _ in range(20):
        after += poll(dpu, memory)  # every record checked against epoch 8
        tick(kernel, hub)
    assert [r.request_id for r in after] == [5] * 6 and after[-1].finish is FinishReason.LENGTH
    assert [t for r in after for t in r.tokens] == want.tokens
    asyncio.run(kernel.close())
