"""Continuous batching: which sequences run in the next step, and how far.

Pure Python, lengths only: token values stay on the device, in the runner's
per-slot token buffer. Each step the scheduler spends a token budget:

1. every running sequence whose prompt is done decodes one token; one that
   needs a new block and finds none preempts the youngest running sequence
   (its blocks are freed, it goes back to the head of the queue and is
   recomputed later: the sampler's draws depend only on the seed and the
   output index, so the recomputed tokens are the same);
2. running sequences still prefilling take chunks of what budget is left;
3. waiting sequences are admitted in arrival order while a slot is free, the
   budget lasts, the free blocks hold everything they know so far, and the
   engine has room for what else they need (a constraint's automaton). When
   the head of the queue does not fit, admission waits: nothing is evicted to
   make room for a newcomer.

A sequence samples in a step whose work reaches its last known token: its
final prefill chunk, or a decode.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dpu_frontend.model.blocks import BlockPool, BlockTable
from dpu_frontend.ring.records import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_len: int
    params: SamplingParams
    seed: int
    #: prompt + output may not pass this many tokens (the context, max_tokens).
    limit: int
    table: BlockTable
    slot: int = -1  # the runner's row for this sequence; -1 until admitted
    computed: int = 0  # positions whose K and V are in the cache
    generated: int = 0
    status: Status = Status.WAITING

    @property
    def total(self) -> int:
        """Tokens known: the prompt and every sampled token."""
        return self.prompt_len + self.generated


@dataclass(frozen=True, slots=True)
class Work:
    """``count`` tokens of ``seq`` from position ``start`` go through the model."""

    seq: Sequence
    start: int
    count: int
    sample: bool


@dataclass
class Batch:
    works: list[Work] = field(default_factory=list)
    #: Newly given a slot: the runner loads their prompts before the step.
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(w.count for w in self.works)


class Scheduler:
    def __init__(self, pool: BlockPool, *, max_seqs: int, max_batched_tokens: int,
                 max_model_len: int) -> None:
        if max_model_len > pool.num_blocks * pool.block_size:
            raise ValueError(f"a {max_model_len}-token context does not fit a KV cache of "
                             f"{pool.num_blocks * pool.block_size} tokens")
        if max_batched_tokens < 1 or max_seqs < 1:
            raise ValueError("max_batched_tokens and max_seqs must be positive")
        self.pool = pool
        self.max_seqs = max_seqs
        self.max_batched_tokens = max_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the youngest last
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self.preemptions = 0

    def add(self, seq_id: int, prompt_len: int, params: SamplingParams, seed: int) -> Sequence:
        if not 1 <= prompt_len < self.max_model_len:
            raise ValueError(f"a {prompt_len}-token prompt does not leave room for a token "
                             f"in a {self.max_model_len}-token context")
        limit = min(prompt_len + params.max_tokens, self.max_model_len)
        seq = Sequence(seq_id, prompt_len, params, seed, limit, BlockTable(self.pool))
        self.waiting.append(seq)
        return seq

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self, room: Callable[[Sequence], bool] | None = None,
                 admit: Callable[[Sequence], bool] | None = None) -> Batch:
        """The next step's batch. ``room``, asked before a sequence samples (a decode,
        or the chunk that ends its prompt): False holds the sequence out of this step
        (the ring its records go to is full; it keeps its slot and blocks). ``admit``,
        asked last before a waiting sequence gets a slot: False, and admission waits
        (what it needs besides blocks, its automaton's room, is not there yet)."""
        batch = Batch()
        budget = self.max_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.total - seq.computed != 1:
                continue
            if room is not None and not room(seq):
                continue
            while not seq.table.reserve(seq.computed + 1):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                batch.works.append(Work(seq, seq.computed, 1, True))
                budget -= 1
        for seq in self.running:
            if budget == 0:
                break
            if seq.total - seq.computed > 1:
                budget -= self._chunk(seq, budget, batch, room)
        held: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.slot < 0 and not self._free_slots:
                break
            if self.pool.free < self.pool.blocks_for(seq.total) - len(seq.table.blocks):
                break
            if room is not None and self._samples(seq, budget) and not room(seq):
                held.append(self.waiting.popleft())  # its ring is full: the next one may go
                continue
            if seq.slot < 0 and admit is not None and not admit(seq):
                break
            self.waiting.popleft()
            if seq.slot < 0:
                seq.slot = self._free_slots.pop()
                batch.admitted.append(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget -= self._chunk(seq, budget, batch, None)
        self.waiting.extendleft(reversed(held))  # in their order, ahead of the rest
        return batch

    def _samples(self, seq: Sequence, budget: int) -> bool:
        """Would ``seq``'s next chunk end its prompt (and draw a token)?"""
        return seq.total - seq.computed <= budget

    def _chunk(self, seq: Sequence, budget: int, batch: Batch,
               room: Callable[[Sequence], bool] | None) -> int:
        """Up to ``budget`` of a prefill, as far as blocks allow; tokens taken. A chunk
        that would end the prompt is held when ``room`` says so."""
        count = min(seq.total - seq.computed, budget)
        fits = seq.table.capacity + self.pool.free * self.pool.block_size - seq.computed
        count = min(count, fits)
        sample = seq.computed + count == seq.total
        if count <= 0 or (sample and room is not None and not room(seq)):
            return 0
        if not seq.table.reserve(seq.computed + count):
            return 0
        batch.works.append(Work(seq, seq.computed, count, sample))
        return count

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        self.running.remove(seq)
        seq.table.release()
        seq.computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.preemptions += 1

    def commit(self, batch: Batch) -> None:
        """The step ran: its KV is in the cache, each sampling sequence has one
        more token."""
        for work in batch.works:
            seq = work.seq
            if seq.status is not Status.RUNNING:
                continue  # finished or cancelled while the step ran
            seq.computed = work.start + work.count
            if work.sample:
                seq.generated += 1

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence (stopped, at its limit, or cancelled): its blocks and
        slot are free for the next step."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.table.release()
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
        seq.status = Status.FINISHED
