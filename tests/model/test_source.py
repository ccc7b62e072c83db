"""The model peer's sources over a stand-in engine: records packed from engine
events, cancels, errors, the ring's budget (no GPU)."""

from __future__ import annotations

import argparse
import asyncio
from array import array

import pytest

from dpu_frontend.cli import MODEL_OPTIONS
from dpu_frontend.config import PeerConfig
from dpu_frontend.model.events import EngineStats, TokenEvent
from dpu_frontend.model.options import ModelPeerOptions
from dpu_frontend.model.publish import RingRecords, Target
from dpu_frontend.model.source import EngineHub, ModelSource
from dpu_frontend.peer.reference import RecordSpace, ReferenceKernel
from dpu_frontend.ring import FinishReason, GenerateRecord, ResponseRecord, SamplingParams
from dpu_frontend.ring.automaton import CheckedAutomaton, TokenAutomaton


class ScriptedEngine:
    """Each sequence emits its scripted tokens, one a step, then its finish."""

    def __init__(self, scripts: dict[int, tuple[list[int], FinishReason]]) -> None:
        self.scripts = scripts  # by prompt's first token
        self.running: dict[int, tuple[list[int], FinishReason]] = {}
        self.cancelled: list[int] = []
        self.automata: dict[int, CheckedAutomaton | None] = {}
        self.stats = EngineStats()

    @property
    def idle(self) -> bool:
        return not self.running

    def add(self, seq_id: int, prompt: list[int], params: SamplingParams,
            target: Target | None = None, automaton: CheckedAutomaton | None = None) -> None:
        self.automata[seq_id] = automaton
        if prompt[0] < 0:
            raise ValueError("a prompt token id is outside the vocabulary")
        tokens, finish = self.scripts[prompt[0]]
        self.running[seq_id] = (list(tokens), finish)

    def cancel(self, seq_id: int, *, final: bool = True) -> None:
        self.running.pop(seq_id, None)
        self.cancelled.append(seq_id)

    def publish_to(self, records: RingRecords) -> None:
        raise AssertionError("the host publishes these sources' records")

    def step(self) -> list[TokenEvent]:
        events = []
        for seq_id, (tokens, finish) in list(self.running.items()):
            token = tokens.pop(0) if tokens else None
            done = finish if not tokens else FinishReason.NONE
            events.append(TokenEvent(seq_id, token, done))
            if done is not FinishReason.NONE:
                del self.running[seq_id]
        return events


def record(request_id: int) -> GenerateRecord:
    return GenerateRecord(request_id, 0, 1, SamplingParams(max_tokens=16))


def drive(hub: EngineHub, steps: int) -> None:
    for _ in range(steps):
        hub.deliver(hub.engine.step())


def test_tokens_are_packed_per_step_and_the_last_record_is_final() -> None:
    engine = ScriptedEngine({1: ([10, 11, 12, 13, 14], FinishReason.LENGTH),
                             2: ([20], FinishReason.STOP)})
    hub = EngineHub(engine)
    source = ModelSource(hub, RecordSpace(2, 1))
    source.admit(record(100), (1,), 0.0)
    source.admit(record(200), (2,), 0.0)
    drive(hub, 1)
    assert source.step(0.0, 10) == [ResponseRecord(100, (10,)), ResponseRecord(200, (20,), FinishReason.STOP)]
    drive(hub, 4)  # a slow reader: four steps' tokens wait, then go out two a record
    out = source.step(0.0, 10)
    assert out == [ResponseRecord(100, (11, 12)), ResponseRecord(100, (13, 14), FinishReason.LENGTH)]
    assert source.active == 0 and source.stats.completed == 2 and source.stats.tokens == 6


def test_the_budget_holds_records_back_without_loss() -> None:
    engine = ScriptedEngine({1: ([1, 2, 3], FinishReason.LENGTH)})
    hub = EngineHub(engine)
    source = ModelSource(hub, RecordSpace(1, 1))
    source.admit(record(7), (1,), 0.0)
    drive(hub, 3)
    assert source.step(0.0, 2) == [ResponseRecord(7, (1,)), ResponseRecord(7, (2,))]
    assert source.step(0.0, 2) == [ResponseRecord(7, (3,), FinishReason.LENGTH)]


def test_cancel_stops_the_engine_sequence_and_ends_with_cancelled() -> None:
    engine = ScriptedEngine({1: ([1, 2, 3], FinishReason.LENGTH)})
    hub = EngineHub(engine)
    source = ModelSource(hub, RecordSpace(4, 1))
    source.admit(record(7), (1,), 0.0)
    drive(hub, 1)
    assert source.cancel(7) == ResponseRecord(7, (), FinishReason.CANCELLED)
    assert engine.cancelled == [0] and engine.idle
    assert source.cancel(7) is None  # twice: nothing more
    drive(hub, 1)
    assert source.step(0.0, 10) == []


def test_a_prompt_the_engine_refuses_fails_alone() -> None:
    engine = ScriptedEngine({1: ([5], FinishReason.LENGTH)})
    hub = EngineHub(engine)
    source = ModelSource(hub, RecordSpace(4, 1))
    source.admit(record(1), (-1,), 0.0)
    source.admit(record(2), (1,), 0.0)
    drive(hub, 1)
    assert source.step(0.0, 10) == [ResponseRecord(1, (), FinishReason.ERROR),
                                    ResponseRecord(2, (5,), FinishReason.LENGTH)]


def test_a_constrained_request_brings_its_automaton_to_the_engine() -> None:
    engine = ScriptedEngine({1: ([5], FinishReason.STOP)})
    hub = EngineHub(engine)
    checked = CheckedAutomaton.of(TokenAutomaton(
        8, 7, array("i", [0, 1]), array("i", [7]), array("i", [0]), array("i", [-1]),
        array("i", [-1]), array("I")))
    ModelSource(hub, RecordSpace(4, 1)).admit(record(1), (1,), 0.0, checked)
    ModelSource(hub, RecordSpace(4, 1)).admit(record(2), (1,), 0.0)
    assert engine.automata == {0: checked, 1: None}


def test_channels_share_one_engine_and_a_reset_drops_only_its_own() -> None:
    engine = ScriptedEngine({1: ([1, 2], FinishReason.LENGTH), 2: ([3, 4], FinishReason.LENGTH)})
    hub = EngineHub(engine)
    a, b = ModelSource(hub, RecordSpace(4, 1)), ModelSource(hub, RecordSpace(4, 1))
    a.admit(record(5), (1,), 0.0)
    b.admit(record(5), (2,), 0.0)  # the same request id on another channel
    drive(hub, 1)
    a.drop_all()
    drive(hub, 1)
    assert a.step(0.0, 10) == []
    assert b.step(0.0, 10) == [ResponseRecord(5, (3, 4), FinishReason.LENGTH)]


def test_a_busy_engine_steps_back_to_back_and_an_idle_one_every_tick(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer's loop sleeps a tick only when the engine had nothing to run: a busy
    engine's steps follow each other with a bare yield to the control plane."""
    engine = ScriptedEngine({1: ([1, 2, 3], FinishReason.LENGTH)})
    hub = EngineHub(engine)
    ModelSource(hub, RecordSpace(4, 1)).admit(record(7), (1,), 0.0)
    kernel = ReferenceKernel(PeerConfig(tick_s=0.5), [], (), between_steps=hub.step,
                             stats=hub.stats)
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        if len(sleeps) == 5:
            raise RuntimeError("enough ticks")  # ends the loop as a failure would
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)  # the module the peer loop calls
    asyncio.run(kernel._run())
    assert sleeps == [0, 0, 0, 0.5, 0.5]  # three steps, then idle
    stats = kernel.kernel_stats()  # the hub's, through the kernel (peer-stats)
    assert stats["engine_s"] > 0 and stats["loop_s"] > 0
    assert set(EngineStats().as_dict()) <= set(stats)
    failure = kernel.failure()
    assert failure is not None and "enough ticks" in failure


def model_options(*argv: str) -> ModelPeerOptions:
    """What ``model-peer``'s own flags build from ``argv``."""
    parser = argparse.ArgumentParser()
    MODEL_OPTIONS.add_to(parser)
    return MODEL_OPTIONS.build(parser.parse_args(list(argv)))


def test_model_peer_flags() -> None:
    options = model_options("--dtype", "float32", "--kv-blocks", "100",
                            "--max-batched-tokens", "512", "--no-cuda-graphs")
    assert options.runner.dtype == "float32" and options.runner.num_blocks == 100
    assert not options.runner.cuda_graphs and options.engine.max_batched_tokens == 512
    assert options.engine.overlap and not model_options("--no-overlap").engine.overlap
    with pytest.raises(ValueError, match="memory_fraction"):
        model_options("--memory-fraction", "0.01")
    with pytest.raises(ValueError, match="max_batched_tokens"):
        model_options("--max-batched-tokens", "0")


def test_scheduler_flags() -> None:
    """``--scheduler gpu`` and what it cannot go with, refused before a GPU is touched."""
    assert model_options().scheduler == "host"
    options = model_options("--scheduler", "gpu", "--scheduler-library", "/x.so")
    assert options.scheduler == "gpu" and str(options.scheduler_library) == "/x.so"
    for flags, why in ((("--no-cuda-graphs",), "captured steps"),
                       (("--records", "host"), "records on the GPU"),
                       (("--max-seqs", "1025"), "1024 sequences")):
        with pytest.raises(ValueError, match=why):
            model_options("--scheduler", "gpu", *flags)
