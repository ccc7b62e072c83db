"""The model engine as the sequence source of the host-driven peer's channels.

Every channel of the peer gets a ``ModelSource``; all of them share one
``EngineHub``, whose ``step`` runs one batch step of the engine over the
sequences of every channel and hands each token to its channel. The peer's
loop (``dpu_frontend.peer.reference``) takes the records from the sources and
publishes them as it publishes the reference generators' records. This is the
host-driven path: the host reads the request ring and writes the response
ring.

``RingSource`` is the same with the records written by the GPU
(``dpu_frontend.model.publish``): the host still reads the request ring and
schedules, but a token goes from the sampler to the response ring without
the host (the peer's ``--records gpu``, its default). Its channel's loop
publishes nothing; the engine's events only retire the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dpu_frontend.model.events import StepEngine, TokenEvent
from dpu_frontend.model.publish import RingRecords, Target
from dpu_frontend.peer.generator import ActiveSequences, GeneratorStats
from dpu_frontend.peer.reference import RecordSpace
from dpu_frontend.ring import FinishReason, GenerateRecord, Layout, ResponseRecord, TokenLogprobs
from dpu_frontend.ring.automaton import CheckedAutomaton
from dpu_frontend.ring.memory import AtomicMemory

log = logging.getLogger("dpu_frontend.model")


@dataclass(slots=True)
class _Pending:
    seq_id: int
    logprobs: bool = False  # the request asked for them: every token has an entry
    tokens: deque[int] = field(default_factory=deque)
    entries: deque[TokenLogprobs] = field(default_factory=deque)
    finish: FinishReason = FinishReason.NONE


#: Makes the GPU's record writer once the region exists (``--records gpu``).
RecordsFactory = Callable[[AtomicMemory, Layout], RingRecords]


class EngineHub:
    """One engine for every channel: sequence ids are the hub's, not the DPU's.
    With ``records`` the GPU writes the response records (``RingSource``): the hub
    makes the writer when the peer opens its region (``opened``)."""

    def __init__(self, engine: StepEngine, records: RecordsFactory | None = None) -> None:
        self.engine = engine
        self._records_factory = records
        self.records: RingRecords | None = None
        self._owner: dict[int, tuple[ModelSource | RingSource, int]] = {}
        self._next_id = 0
        #: Wall time inside the engine's steps, and between two steps of a busy engine
        #: (the loop's share: the records in and out, the hand-offs to the thread).
        self.engine_s = 0.0
        self.loop_s = 0.0
        self._ended: float | None = None  # when the last step of a busy run ended

    def opened(self, memory: AtomicMemory, layout: Layout) -> None:
        """The peer's region exists: make the record writer on it."""
        if self._records_factory is not None:
            self.records = self._records_factory(memory, layout)
            self.engine.publish_to(self.records)

    def closed(self) -> None:
        """Before the region goes: every launch done, the writer released."""
        if self.records is not None:
            self.records.close()
            self.records = None

    def add(self, source: ModelSource | RingSource, request_id: int, prompt: tuple[int, ...],
            record: GenerateRecord, target: Target | None = None,
            automaton: CheckedAutomaton | None = None) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self.engine.add(seq_id, list(prompt), record.params, target, automaton)
        self._owner[seq_id] = (source, request_id)
        return seq_id

    def cancel(self, seq_id: int, *, final: bool = True) -> None:
        if self._owner.pop(seq_id, None) is not None:
            self.engine.cancel(seq_id, final=final)

    async def step(self) -> bool:
        """One engine step off the event loop (the control plane stays responsive);
        the peer's loop does not touch the engine while it runs. False: idle, no step."""
        if self.engine.idle:
            self._ended = None
            return False
        began = time.perf_counter()
        if self._ended is not None:
            self.loop_s += began - self._ended
        events = await asyncio.to_thread(self.engine.step)
        self._ended = time.perf_counter()
        self.engine_s += self._ended - began
        self.deliver(events)
        return True

    def stats(self) -> dict[str, Any]:
        """The engine's counters and the loop's (``peer-stats``, the benchmarks)."""
        return self.engine.stats.as_dict() | {"engine_s": self.engine_s, "loop_s": self.loop_s}

    def deliver(self, events: list[TokenEvent]) -> None:
        for ev in events:
            owner = self._owner.get(ev.seq_id)
            if owner is None:
                continue  # cancelled while the step ran
            source, request_id = owner
            source.receive(request_id, ev)
            if ev.finish is not FinishReason.NONE:
                del self._owner[ev.seq_id]


class ModelSource(ActiveSequences[_Pending]):
    """A channel's sequences, generated by the shared engine. ``step`` packs each
    sequence's new tokens into records of at most what ``space`` allows."""

    def __init__(self, hub: EngineHub, space: RecordSpace) -> None:
        self.hub = hub
        self.space = space
        self.stats = GeneratorStats()
        #: Request ids with tokens or a finish to publish, in arrival order: a step
        #: visits these, not every active request (most wait for a slot at saturation).
        self._ready: dict[int, None] = {}
        super().__init__()

    def admit(self, record: GenerateRecord, prompt: tuple[int, ...], now: float,
              automaton: CheckedAutomaton | None = None) -> None:
        self.stats.admitted += 1
        try:
            seq_id = self.hub.add(self, record.request_id, prompt, record, automaton=automaton)
        except ValueError as exc:  # a prompt the model cannot take: the request fails alone
            log.warning("request %d refused by the engine: %s", record.request_id, exc)
            self._active[record.request_id] = _Pending(-1, finish=FinishReason.ERROR)
            self._ready[record.request_id] = None
            return
        self._active[record.request_id] = _Pending(seq_id, record.params.logprobs is not None)

    def receive(self, request_id: int, event: TokenEvent) -> None:
        pending = self._active.get(request_id)
        if pending is None:
            return
        if event.token is not None:
            pending.tokens.append(event.token)
            if pending.logprobs:
                if event.logprob is None:
                    raise RuntimeError(f"the engine gave token {event.token} of request "
                                       f"{request_id} no log probability")
                pending.entries.append(TokenLogprobs(event.logprob, event.top))
        pending.finish = event.finish
        self._ready[request_id] = None

    def cancel(self, request_id: int) -> ResponseRecord | None:
        pending = self._active.pop(request_id, None)
        if pending is None:
            return None
        self._ready.pop(request_id, None)
        self.hub.cancel(pending.seq_id)
        self.stats.cancelled += 1
        self.stats.cancelled_ids.append(request_id)
        return ResponseRecord(request_id, (), FinishReason.CANCELLED)

    def drop_all(self) -> None:
        for pending in self._active.values():
            self.hub.cancel(pending.seq_id)
        self._active.clear()
        self._ready.clear()

    def step(self, now: float, budget: int) -> list[ResponseRecord]:
        out: list[ResponseRecord] = []
        for request_id in list(self._ready):
            pending = self._active[request_id]
            while len(out) < budget and (pending.tokens or pending.finish is not FinishReason.NONE):
                room = self.space.logprob_tokens if pending.logprobs else self.space.tokens
                n = min(room, len(pending.tokens))
                tokens = tuple(pending.tokens.popleft() for _ in range(n))
                final = pending.finish if not pending.tokens else FinishReason.NONE
                entries = (tuple(pending.entries.popleft() for _ in range(n))
                           if pending.logprobs else None)
                out.append(ResponseRecord(request_id, tokens, final, entries))
                self.stats.tokens += n
                if final is not FinishReason.NONE:
                    del self._active[request_id]
                    self.stats.completed += 1
                    break
            finished = request_id not in self._active
            if finished or (not pending.tokens and pending.finish is FinishReason.NONE):
                del self._ready[request_id]  # all published
            if len(out) >= budget:
                break
        return out


class RingSource(ActiveSequences[int]):
    """A channel's sequences, whose records the GPU writes (``--records gpu``):
    request id -> the hub's sequence id. Nothing is published from here."""

    def __init__(self, hub: EngineHub, channel: int) -> None:
        self.hub = hub
        self.channel = channel
        self.stats = GeneratorStats()
        super().__init__()

    @property
    def records(self) -> RingRecords:
        if self.hub.records is None:
            raise RuntimeError("the record writer is not made before the region is open")
        return self.hub.records

    def admit(self, record: GenerateRecord, prompt: tuple[int, ...], now: float,
              automaton: CheckedAutomaton | None = None) -> None:
        self.stats.admitted += 1
        target = Target(self.channel, record.request_id)
        try:
            self._active[record.request_id] = self.hub.add(self, record.request_id, prompt,
                                                           record, target, automaton)
        except ValueError as exc:  # a prompt the model cannot take: the request fails alone
            log.warning("request %d refused by the engine: %s", record.request_id, exc)
            self.records.final(-1, target, FinishReason.ERROR)

    def receive(self, request_id: int, event: TokenEvent) -> None:
        if event.finish is not FinishReason.NONE:
            self._active.pop(request_id, None)

    def cancel(self, request_id: int) -> ResponseRecord | None:
        seq_id = self._active.pop(request_id, None)
        if seq_id is not None:
            self.hub.cancel(seq_id)  # the GPU ends it with a cancelled record
            self.stats.cancelled_ids.append(request_id)
        return None

    def drop_all(self) -> None:
        """The channel is being reset: its sequences end without records, and every
        launch is done before the host zeroes the ring."""
        for seq_id in self._active.values():
            self.hub.cancel(seq_id, final=False)
        self._active.clear()
        self.records.drain()

    def reset(self, epoch: int) -> None:
        """The ring restarted at ``epoch`` (ATTACH) or stays at it (DETACH)."""
        self.records.reset(self.channel, epoch)

    def fail(self, request_id: int) -> None:
        """A request the peer's loop refused (an automaton that fails its checks): the
        GPU's writer ends it with an error record."""
        self.records.final(-1, Target(self.channel, request_id), FinishReason.ERROR)

    def step(self, now: float, budget: int) -> list[ResponseRecord]:
        return []

    def counters(self) -> dict[str, int]:
        """The mailbox's counters that the GPU keeps."""
        tally = self.records.tally(self.channel)
        return {"completed": tally.completed, "cancelled": tally.cancelled,
                "tokens": tally.tokens, "published": tally.published,
                "ring_full_waits": self.records.ring_full_waits[self.channel]}
