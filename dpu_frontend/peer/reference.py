"""The reference kernel: the GPU half of every channel as a Python loop of token generators.

It behaves as the CUDA kernel does, step by step: between two steps it runs
mailbox commands (ATTACH resets a channel to a new epoch, DETACH drops its
sequences); in a step it drains every committed request record into its own
store (so a cancel never waits behind generates), advances every running
sequence by one record, publishes what the response ring has room for and
keeps the rest buffered; and it beats the heartbeat every tick, whatever a
step did. Its region is host memory, where the transport's provider puts it
(``peer/region.py``: the shm file, or an anonymous mapping a NIC registers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dpu_frontend.config import PeerConfig
from dpu_frontend.errors import ProtocolError
from dpu_frontend.peer.generator import GeneratorStats, StepBatch, TokenGenerator
from dpu_frontend.peer.kernel import PeerKernel
from dpu_frontend.peer.region import Region, RegionAddress
from dpu_frontend.ring import (
    CancelRecord,
    FinishReason,
    GenerateRecord,
    GpuChannel,
    Layout,
    ResponseRecord,
)
from dpu_frontend.ring.automaton import CheckedAutomaton, decode_automaton
from dpu_frontend.ring.mailbox import (
    ChannelState,
    Command,
    KernelMailbox,
    MailboxError,
    mailbox_area_size,
)
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.text.constraints import Lru

log = logging.getLogger("dpu_frontend.peer")
#: Checked automata kept (by their identity: key and size) for the requests that bring them again.
AUTOMATA_CACHED = 16


class SequenceSource(Protocol):
    """Where a channel's sequences get their tokens: ``TokenGenerator`` (replay, echo)
    or the model engine (``dpu_frontend.model.source``)."""

    stats: GeneratorStats

    @property
    def active(self) -> int: ...
    @property
    def active_ids(self) -> list[int]: ...
    def has(self, request_id: int) -> bool: ...
    def admit(self, record: GenerateRecord, prompt: tuple[int, ...], now: float,
              automaton: CheckedAutomaton | None = None) -> None: ...
    def cancel(self, request_id: int) -> ResponseRecord | None: ...
    def drop_all(self) -> None: ...
    def step(self, now: float, budget: int) -> list[ResponseRecord]: ...


@runtime_checkable
class PublishingSource(Protocol):
    """A source whose records something else writes (the model's GPU record writer):
    the loop publishes nothing for it, tells it when its ring restarts, and takes
    the publishing counters from it."""

    def reset(self, epoch: int) -> None: ...
    def counters(self) -> dict[str, int]: ...
    def fail(self, request_id: int) -> None:
        """End a request the loop refused with an error record (written where this
        source's records are)."""


@dataclass(frozen=True, slots=True)
class RecordSpace:
    """Tokens a source puts in one record of a channel: plain ids, and tokens with
    their log probabilities (0 when the channel offers none)."""

    tokens: int
    logprob_tokens: int


#: A channel's source, from the channel's index and what its records hold.
SourceFactory = Callable[[int, RecordSpace], SequenceSource]


@dataclass(slots=True)
class _Channel:
    index: int
    ring: GpuChannel
    generator: SequenceSource
    mailbox: KernelMailbox
    attached: bool = False
    outbox: list[ResponseRecord] = field(default_factory=list)  # generated, not yet published


class ReferenceKernel(PeerKernel):
    """``sources`` makes each channel's sequence source (default: token generators
    over ``corpus``); ``between_steps`` runs once per tick before the channels are
    stepped (the model engine's batch step), and says whether it did work: the
    next tick then follows at once instead of after ``tick_s`` (a busy engine's
    steps run back to back; an idle one is polled every tick). ``stats``: the
    counters of what runs between the steps (``kernel_stats``). ``opened`` is told
    of the region once it exists (before the sources are made), ``closing`` before
    it goes."""

    def __init__(self, config: PeerConfig, corpus: list[list[int]],
                 eos_token_ids: tuple[int, ...], *, vocab_size: int = 0,
                 sources: SourceFactory | None = None,
                 between_steps: Callable[[], Awaitable[bool]] | None = None,
                 stats: Callable[[], dict[str, Any]] | None = None,
                 opened: Callable[[AtomicMemory, Layout], None] | None = None,
                 closing: Callable[[], None] | None = None) -> None:
        self.config = config
        self._corpus = corpus
        self._eos = eos_token_ids
        #: Structured output: automata are over this vocabulary (the tokenizer's).
        self._vocab_size = vocab_size
        self._automata: Lru[CheckedAutomaton] = Lru(AUTOMATA_CACHED, sys.maxsize,
                                                    lambda c: c.automaton.nbytes)
        self._sources = sources or self._generator
        self._between_steps = between_steps
        self._stats = stats
        #: GPU-like steps, one batch over every channel (``--step-ms``, ``--batch``).
        self.steps = StepBatch(config.step_s, config.batch) if config.step_s else None
        self._opened = opened
        self._closing = closing
        self._map: mmap.mmap | None = None
        self._region: AtomicMemory | None = None
        self._mailbox: AtomicMemory | None = None
        self._channels: list[_Channel] = []
        self._task: asyncio.Task[None] | None = None
        self._heart: asyncio.Task[None] | None = None
        self._failure: str | None = None

    def open(self, layout: Layout, region: Region) -> RegionAddress:
        cfg = self.config
        self._map = region.host_memory(layout.region_size)
        memory = self._region = AtomicMemory(self._map)
        memory.write(0, layout.encode())
        self._mailbox = AtomicMemory(bytearray(mailbox_area_size(len(layout.channels))))
        if self._opened is not None:
            self._opened(memory, layout)
        for i, ch in enumerate(layout.channels):
            per_step = cfg.tokens_per_step or ch.tokens_per_response
            space = RecordSpace(
                min(per_step, ch.tokens_per_response),
                min(per_step, ch.logprob_tokens_per_response) if ch.logprobs else 0)
            self._channels.append(_Channel(i, GpuChannel(memory, ch), self._sources(i, space),
                                           KernelMailbox(self._mailbox, i)))
        return RegionAddress(host_address=memory.address)

    def _generator(self, channel: int, space: RecordSpace) -> SequenceSource:
        cfg = self.config
        return TokenGenerator(mode=cfg.mode, corpus_ids=self._corpus, eos_token_ids=self._eos,
                              tokens_per_s=cfg.tokens_per_s, tokens_per_step=space.tokens,
                              logprob_tokens_per_step=space.logprob_tokens, steps=self.steps)

    @property
    def mailbox(self) -> AtomicMemory:
        if self._mailbox is None:
            raise RuntimeError("kernel not opened")
        return self._mailbox

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reference-kernel")
        self._heart = asyncio.create_task(self._heartbeat(), name="reference-heartbeat")

    async def _heartbeat(self) -> None:
        """Every channel's heartbeat on its own clock, as the CUDA peer's heartbeat warp:
        a long step (a model's first prefill, a big chunk) never fails the link. It
        stops when the kernel loop dies, so that the daemon sees the failure."""
        while self._failure is None:
            for channel in self._channels:
                channel.ring.beat()
            await asyncio.sleep(self.config.heartbeat_s)

    def failure(self) -> str | None:
        return self._failure

    async def _run(self) -> None:
        tick = self.config.tick_s
        try:
            while True:
                now = time.monotonic()
                for channel in self._channels:
                    self._obey(channel)
                    if channel.attached:
                        self._intake(channel, now)
                busy = self._between_steps is not None and await self._between_steps()
                for channel in self._channels:
                    if channel.attached:
                        self._publish(channel, now)
                    channel.mailbox.publish_counters(self._counters(channel))
                # Busy: yield to the control plane and the heartbeat, then step again.
                await asyncio.sleep(0 if busy else tick)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the kernel died: the control plane refuses from now on
            log.exception("reference kernel failed")
            self._failure = f"reference kernel failed: {exc!r}"

    def _obey(self, channel: _Channel) -> None:
        """Run a pending mailbox command: between two steps, as the CUDA kernel does."""
        command = channel.mailbox.pending()
        if command is None:
            return
        seq, what, epoch = command
        error = MailboxError.OK
        if what == Command.ATTACH:
            if epoch <= channel.ring.epoch:
                error = MailboxError.BAD_EPOCH
            else:
                channel.generator.drop_all()
                channel.outbox = []
                channel.ring.reset(epoch)
                if isinstance(channel.generator, PublishingSource):
                    channel.generator.reset(epoch)
                channel.attached = True
        elif what == Command.DETACH:
            channel.generator.drop_all()
            channel.outbox = []
            if isinstance(channel.generator, PublishingSource):
                channel.generator.reset(channel.ring.epoch)
            channel.attached = False
        else:
            error = MailboxError.BAD_COMMAND
        state = ChannelState.ATTACHED if channel.attached else ChannelState.DETACHED
        channel.mailbox.ack(seq, state, error)

    def _intake(self, channel: _Channel, now: float) -> None:
        ring, generator = channel.ring, channel.generator
        outbox = channel.outbox
        for taken in ring.poll_requests(self._cached):
            record, prompt = taken.record, taken.prompt
            if isinstance(record, CancelRecord):
                final = generator.cancel(record.request_id)
                if final is not None:
                    # As the kernel does: what the target generated and could not publish
                    # yet is discarded; its final record carries no token.
                    outbox[:] = [r for r in outbox if r.request_id != record.request_id]
                    outbox.append(final)
            elif (generator.has(record.request_id)
                  or generator.active >= ring.layout.max_sequences
                  or not ring.layout.offers_logprobs(record.params.logprobs)):
                # A duplicate id, a DPU that broke its sequence window, or one asking for
                # log probabilities this channel does not offer.
                ring.refuse()
            elif taken.identity or taken.automaton:
                checked = taken.checked or self._checked(taken.identity, taken.automaton)
                if checked is None:
                    # An automaton that fails its checks: refused, and answered at once,
                    # so that its stream ends with an error instead of waiting.
                    ring.refuse()
                    if isinstance(generator, PublishingSource):
                        generator.fail(record.request_id)
                    else:
                        outbox.append(ResponseRecord(record.request_id, (), FinishReason.ERROR))
                else:
                    generator.admit(record, prompt, now, checked)
            else:
                generator.admit(record, prompt, now)

    def _cached(self, identity: bytes) -> CheckedAutomaton | None:
        """The checked automaton kept under ``identity`` (one key, one automaton)."""
        return self._automata.get(identity.hex())

    def _checked(self, identity: bytes, encoded: bytes) -> CheckedAutomaton | None:
        """``encoded`` checked, and kept under its ``identity`` for the requests that bring
        it again (their bytes are then not read: ``GpuChannel.poll_requests``); None,
        logged, if it fails a check (and nothing is kept)."""
        cached = self._automata.get(identity.hex()) if identity else None
        if cached is not None:
            return cached
        try:
            checked = CheckedAutomaton(decode_automaton(encoded, self._vocab_size), identity)
        except ProtocolError as exc:
            log.warning("constrained request refused: %s", exc)
            return None
        return self._automata.put(identity.hex(), checked)

    def _publish(self, channel: _Channel, now: float) -> None:
        ring, generator, outbox = channel.ring, channel.generator, channel.outbox
        if isinstance(generator, PublishingSource):
            return  # its records are written elsewhere
        # Generate only what the response ring can take soon: the outbox is bounded.
        budget = max(0, ring.layout.resp_slots - len(outbox))
        outbox += generator.step(now, budget)
        del outbox[:ring.publish(outbox)]

    @staticmethod
    def _counters(channel: _Channel) -> dict[str, int]:
        ring, stats = channel.ring.counters, channel.generator.stats
        counters = {"records": ring.records, "admitted": stats.admitted,
                    "completed": stats.completed, "cancelled": stats.cancelled,
                    "bad_records": ring.bad_records, "tokens": stats.tokens,
                    "published": ring.published, "ring_full_waits": ring.ring_full_waits}
        if isinstance(channel.generator, PublishingSource):
            counters |= channel.generator.counters()
        return counters

    def kernel_stats(self) -> dict[str, Any]:
        return self._stats() if self._stats is not None else {}

    def channel_stats(self, channel: int) -> dict[str, Any]:
        c = self._channels[channel]
        return {"active": c.generator.active_ids, "cancelled_ids": c.generator.stats.cancelled_ids[-64:],
                "request_records": c.ring.consumed}

    async def close(self) -> None:
        for task in (self._task, self._heart):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._heart = None
        if self._closing is not None and self._region is not None:
            self._closing()
        self._channels.clear()
        for memory in (self._region, self._mailbox):
            if memory is not None:
                memory.release()
        self._region = self._mailbox = None
        if self._map is not None:
            self._map.close()  # the provider removes what is left (the shm file)
            self._map = None
