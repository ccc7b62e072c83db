"""The host-driven engine loop: schedule, run, retire.

``ModelEngine.step`` is the whole loop body: the scheduler picks the batch,
the runner runs it on the GPU, and the drawn tokens are judged against each
sequence's stop conditions (the ring protocol's rules, docs/protocol.md
section 9: an EOS or stop id ends the sequence and is not emitted, unless
``ignore_eos`` makes EOS an ordinary token; ``max_tokens`` and the context
end it with ``length``).

With ``publish_to`` the engine also feeds the GPU's record writer
(``dpu_frontend.model.publish``): each step's tokens go from the sampler to
the ring on the GPU, judged there by the same rules; the host's own
judgement only retires sequences. A sequence samples only while its
channel's ring has room for its record.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from dpu_frontend.model.automata import AutomatonPool, PoolEntry
from dpu_frontend.model.blocks import BlockPool
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.events import EngineStats, TokenEvent
from dpu_frontend.model.options import EngineOptions
from dpu_frontend.model.scheduler import Batch, Scheduler, Sequence
from dpu_frontend.ring.automaton import CheckedAutomaton
from dpu_frontend.ring.records import MAX_STOP_TOKEN_IDS, FinishReason, SamplingParams

if TYPE_CHECKING:  # torch: the engine's logic runs (and is tested) without it
    from dpu_frontend.model.layers.sampler import Drawn
    from dpu_frontend.model.publish import RingRecords, Target
    from dpu_frontend.model.runner import ModelRunner


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish: FinishReason = FinishReason.NONE


@dataclass
class _Launched:
    """A batch on its way through the GPU: its sampling sequences, each one's length
    with this step's token, the alternatives each asked for, the tokens (unread)."""

    sampled: list[Sequence]
    totals: list[int]
    wanted: list[int]
    drawn: Drawn


class ModelEngine:
    def __init__(self, config: ModelConfig, runner: ModelRunner, options: EngineOptions) -> None:
        self.config = config
        self.runner = runner
        self.options = options
        ro = runner.options
        self.scheduler = Scheduler(BlockPool(runner.num_blocks, ro.block_size),
                                   max_seqs=ro.max_seqs,
                                   max_batched_tokens=options.max_batched_tokens,
                                   max_model_len=ro.max_model_len)
        self.eos = frozenset(config.eos_token_ids)
        self._prompts: dict[int, list[int]] = {}
        self._seqs: dict[int, Sequence] = {}
        self._inflight: _Launched | None = None
        self.stats = EngineStats()
        self.records: RingRecords | None = None
        self._targets: dict[int, Target] = {}
        #: Structured output: the automata of constrained sequences in GPU memory,
        #: those waiting for admission, and the pool entries of those admitted.
        self.automata = AutomatonPool(ro.automaton_pool_bytes // 4)
        self._constraints: dict[int, CheckedAutomaton] = {}
        self._entries: dict[int, PoolEntry] = {}

    def publish_to(self, records: RingRecords) -> None:
        """From now on the GPU writes each step's records (``RingRecords``)."""
        self.records = records

    def add(self, seq_id: int, prompt: list[int], params: SamplingParams,
            target: Target | None = None, automaton: CheckedAutomaton | None = None) -> None:
        """``target``: where the GPU publishes the sequence's records (with
        ``publish_to``). ``automaton``: what the sequence may generate (structured
        output), walked on the GPU."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already running")
        if any(not 0 <= t < self.config.vocab_size for t in prompt):
            raise ValueError("a prompt token id is outside the vocabulary")
        if automaton is not None:
            params = self._constrained(params, automaton)
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self._seqs[seq_id] = self.scheduler.add(seq_id, len(prompt), params, seed)
        self._prompts[seq_id] = prompt
        if target is not None:
            self._targets[seq_id] = target
        if automaton is not None:
            self._constraints[seq_id] = automaton

    def _constrained(self, params: SamplingParams, checked: CheckedAutomaton) -> SamplingParams:
        """A constrained sequence's parameters: drawing its automaton's end token ends
        it with STOP, whatever ``ignore_eos`` says (protocol section 5.4), on the host's
        judgement and the GPU record writer's alike."""
        a = checked.automaton
        if a.vocab_size > self.config.vocab_size:
            raise ValueError(f"an automaton over {a.vocab_size} token ids, the model has "
                             f"{self.config.vocab_size}")
        if not self.automata.fits(checked):
            raise ValueError(f"an automaton of {a.nbytes} bytes does not fit the "
                             f"{4 * self.automata.capacity}-byte automaton pool "
                             "(--automaton-pool-bytes)")
        if a.eos in self.eos:
            return replace(params, ignore_eos=False)
        if a.eos in params.stop_token_ids:
            return params
        if len(params.stop_token_ids) >= MAX_STOP_TOKEN_IDS:
            raise ValueError(f"a constrained request with {MAX_STOP_TOKEN_IDS} stop token ids "
                             f"leaves no room for its automaton's end token {a.eos}")
        return replace(params, stop_token_ids=(*params.stop_token_ids, a.eos))

    def cancel(self, seq_id: int, *, final: bool = True) -> None:
        """Stop a sequence. With a target, the GPU ends its request with a
        ``cancelled`` record, unless ``final`` is False (its channel is being reset)
        or its own last record came first."""
        seq = self._seqs.pop(seq_id, None)
        target = self._targets.pop(seq_id, None)
        if seq is None:
            return
        self._prompts.pop(seq_id, None)
        if final and target is not None and self.records is not None:
            self.records.final(seq.slot, target, FinishReason.CANCELLED)
        self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        """The scheduler retires ``seq``; its automaton has one user less."""
        self.scheduler.finish(seq)
        self._constraints.pop(seq.seq_id, None)
        entry = self._entries.pop(seq.seq_id, None)
        if entry is not None:
            self.automata.release(entry)

    def _admit(self, seq: Sequence) -> bool:
        """The scheduler's last question before ``seq`` gets a slot: its automaton, if
        it has one, has a place in the pool (acquired now)."""
        checked = self._constraints.get(seq.seq_id)
        if checked is None or seq.seq_id in self._entries:
            return True
        entry = self.automata.acquire(checked)
        if entry is None:
            return False
        self._entries[seq.seq_id] = entry
        return True

    @property
    def idle(self) -> bool:
        """Nothing to schedule, no record operation waiting for a launch, and no
        batch on its way holds a live sequence (one whose every sequence was
        cancelled or stopped is landed by the next step, whenever that comes, and
        gives nothing)."""
        inflight = self._inflight
        return (self.scheduler.idle and (self.records is None or not self.records.pending)
                and (inflight is None or not any(
                    self._seqs.get(seq.seq_id) is seq for seq in inflight.sampled)))

    def step(self) -> list[TokenEvent]:
        """Launch the next batch; return the events of a batch that ran.

        With ``overlap`` that is the *previous* batch (without, this one's): the GPU runs
        this step's batch while the host reads the previous one's tokens, judges
        them and builds the next step, so the host's time hides behind the GPU's.
        The next batch is scheduled before the previous one's tokens are known:
        a sequence stopped by one of them (an EOS or stop id) runs one step more,
        whose token is dropped. Lengths are known without the tokens, so nothing
        runs past ``max_tokens`` or the context. Token values stay on the GPU
        between the two (the runner's token buffer); the batches' results are
        the same either way (batch-invariant kernels, seeded draws by index).
        """
        launched = self._launch()
        if not self.options.overlap:
            return self._land(launched) if launched is not None else []
        previous, self._inflight = self._inflight, launched
        return self._land(previous) if previous is not None else []

    def _launch(self) -> _Launched | None:
        began = time.perf_counter()
        try:
            return self._schedule_and_run()
        finally:
            self.stats.launch_s += time.perf_counter() - began

    def _schedule_and_run(self) -> _Launched | None:
        records = self.records
        batch = self.scheduler.schedule(self._room() if records is not None else None,
                                        self._admit if self._constraints else None)
        for seq in batch.admitted:
            entry = self._entries.get(seq.seq_id)
            if entry is not None:
                self.stats.constrained += 1
                self.stats.automata_copied += not entry.resident
            self.runner.load_prompt(seq, self._prompts.pop(seq.seq_id), entry)
        self.stats.automata_evicted = self.automata.evictions
        sampled = [w.seq for w in batch.works if w.sample]
        wanted = [self._top_logprobs(seq) for seq in sampled]
        publish = self._publisher(batch, sampled) if records is not None else None
        drawn = self.runner.step(batch, max(wanted, default=-1), publish)
        if records is not None and drawn is None:
            records.flush()  # this step drew nothing: its operations go alone
        self.scheduler.commit(batch)
        if batch.works:
            self.stats.steps += 1
            self.stats.scheduled_tokens += batch.tokens
            self.stats.context_tokens += sum(w.start + w.count for w in batch.works)
            self.stats.sum_running += len(self.scheduler.running)
            self.stats.sum_waiting += len(self.scheduler.waiting)
        if drawn is None:
            return None
        totals = [seq.total for seq in sampled]  # with this step's token
        for seq, total in zip(sampled, totals, strict=True):
            if total >= seq.limit:
                # Its last token is on its way: it takes no further step, its blocks,
                # slot and automaton's room go to the next ones (the GPU runs steps in
                # order).
                self._retire(seq)
        return _Launched(sampled, totals, wanted, drawn)

    def _land(self, launched: _Launched) -> list[TokenEvent]:
        """Wait for a launched batch's tokens; judge each against its stop rules."""
        drawn = launched.drawn
        began = time.perf_counter()
        tokens, chosen, top_ids, top_lps = drawn.lists()
        arrived = time.perf_counter()
        self.stats.wait_s += arrived - began
        self.stats.gpu_s += drawn.gpu_seconds()
        self.stats.tokens += len(tokens)
        events = []
        for i, seq in enumerate(launched.sampled):
            if self._seqs.get(seq.seq_id) is not seq:
                continue  # stopped by an earlier token, or cancelled: nobody wants this one
            token = tokens[i]
            finish = self._finish(seq, token, launched.totals[i])
            emitted = finish is not FinishReason.STOP
            k = launched.wanted[i]
            logprob = chosen[i] if chosen is not None and emitted and k >= 0 else None
            top = (tuple(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
                   if top_ids is not None and top_lps is not None and logprob is not None
                   else ())
            events.append(TokenEvent(seq.seq_id, token if emitted else None, finish,
                                     logprob, top))
            if finish is not FinishReason.NONE:
                self._seqs.pop(seq.seq_id, None)
                self._targets.pop(seq.seq_id, None)
                self._retire(seq)
        self.stats.judge_s += time.perf_counter() - arrived
        return events

    def _room(self) -> Callable[[Sequence], bool]:
        """The scheduler's test before a sequence samples: its channel's ring has a
        free slot for the record, counting what this step already gave out."""
        assert self.records is not None
        records, targets = self.records, self._targets
        left = records.room()
        held: set[int] = set()

        def room(seq: Sequence) -> bool:
            target = targets.get(seq.seq_id)
            if target is None:
                return True
            c = target.channel
            if left[c] <= 0:
                if c not in held:
                    held.add(c)
                    records.held(c)
                return False
            left[c] -= 1
            return True

        return room

    def _publisher(self, batch: Batch, sampled: list[Sequence]) -> Callable[[Drawn], None]:
        """Arm the admitted sequences' slots; return what the runner calls with the
        step's tokens on the GPU: the writer's launch, rows in the sampler's order."""
        records, targets = self.records, self._targets
        assert records is not None
        for seq in batch.admitted:
            target = targets.get(seq.seq_id)
            if target is not None:
                asked = seq.params.logprobs is not None
                records.arm(seq.slot, target, seq.limit, seq.params,
                            self._top_logprobs(seq) if asked else -1)
        # Each row's slot and the sequence's tokens with this step's (an untargeted
        # sequence's row goes to the sampler but no record: slot -1 is skipped).
        rows = np.array([(seq.slot if seq.seq_id in targets else -1, seq.total + 1)
                         for seq in sampled], np.int64).reshape(-1, 2)

        def publish(drawn: Drawn) -> None:
            records.launch(rows, drawn)

        return publish

    def _top_logprobs(self, seq: Sequence) -> int:
        """Alternatives ``seq`` gets with its log probabilities; -1: none. The request's
        own ``logprobs``, or the engine-wide ``top_logprobs`` (tests, benchmarks)."""
        asked = seq.params.logprobs
        return max(asked if asked is not None else -1, self.options.top_logprobs)

    def _finish(self, seq: Sequence, token: int, total: int) -> FinishReason:
        """``total``: the sequence's tokens with this one."""
        p = seq.params
        if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if total >= seq.limit:
            return FinishReason.LENGTH
        return FinishReason.NONE

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        """Run prompts to completion (tests and benchmarks)."""
        out = [Completion() for _ in prompts]
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            self.add(i, prompt, p)
        while not self.idle:
            for ev in self.step():
                c = out[ev.seq_id]
                if ev.token is not None:
                    c.tokens.append(ev.token)
                    if ev.logprob is not None:
                        c.logprobs.append(ev.logprob)
                        c.top.append(ev.top)
                c.finish = ev.finish
        return out
