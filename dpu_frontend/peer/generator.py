"""A deterministic token generator standing in for the persistent GPU kernel.

Two sources: ``replay`` walks a built-in corpus (documents separated by EOS,
so generations end with ``stop`` unless ``ignore_eos``), starting at the
document that ``replay_start`` picks from the prompt and the seed; ``echo``
returns the prompt. The CUDA peer's kernel implements the same sources with
the same rules, so that both peers give byte-identical streams
(docs/protocol.md, "The token source").

It works in steps, as a GPU does: each step gives every running sequence one
record of at most ``tokens_per_step`` tokens (``logprob_tokens_per_step`` for a
request that asked for log probabilities). Tokens come at ``tokens_per_s``
per sequence (0: as fast as the ring takes them), never more than
``max_tokens``, and stop at EOS or a stop token id, which is not emitted.
With ``StepBatch`` (the peer's ``--step-ms``/``--batch``) the pace is a GPU's
decode instead: every step period each running sequence gets one token, a
burst of one-token records, and at most ``batch`` sequences of all channels
run at once while the rest wait for a slot. Pure: the caller passes ``now``.

A constrained request (structured output: an automaton, ``ring.automaton``) walks its
automaton: the source's token is taken where the automaton allows it and the end can
still be reached within ``max_tokens``; otherwise the smallest token id that leads
nearest the end, or the end token where the text may end, which finishes the
sequence with STOP (``AutomatonWalk``). So every constrained answer that is not cut
by ``max_tokens`` is a text the constraint accepts.

Both sources are deterministic: the distribution each token is drawn from is
one-hot. Log probabilities say so: the token's is 0, and its only alternative
with any probability is itself (``top`` holds it when a request asks for one
or more alternatives; the zero-probability rest are not listed).
"""

from __future__ import annotations

import struct
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Generic, TypeVar

from dpu_frontend.ring import FinishReason, GenerateRecord, ResponseRecord, TokenLogprobs
from dpu_frontend.ring.automaton import CheckedAutomaton, shortest_token

DOCUMENT_SEPARATOR = "\n%%\n"
S = TypeVar("S")


def replay_start(prompt: Sequence[int], seed: int | None, documents: int) -> int:
    """The document a replay starts at: CRC-32 (zlib's) of the prompt's u32
    little-endian ids, the seed as a u64 (0 without one) and a byte 1/0 for
    whether there is a seed, modulo the number of documents."""
    data = struct.pack(f"<{len(prompt)}IQB", *prompt, seed or 0, seed is not None)
    return zlib.crc32(data) % documents


def corpus_tokens(corpus_ids: Sequence[Sequence[int]],
                  eos_token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """The documents joined, each followed by the first EOS id: the tokens a replay
    walks through cyclically; and the index where each document starts."""
    eos = list(eos_token_ids[:1])
    tokens: list[int] = []
    starts: list[int] = []
    for doc in corpus_ids:
        starts.append(len(tokens))
        tokens += list(doc) + eos
    return tokens, starts


def default_corpus() -> list[str]:
    text = files("dpu_frontend.peer").joinpath("corpus/default.txt").read_text(encoding="utf-8")
    return [doc.strip() for doc in text.split(DOCUMENT_SEPARATOR) if doc.strip()]


@dataclass(slots=True)
class AutomatonWalk:
    """One sequence's place in its automaton."""

    walked: CheckedAutomaton
    state: int = 0

    def choose(self, candidate: int | None, left: int) -> int | None:
        """The token to emit, given the source's ``candidate`` (None: it ran out) and
        ``left`` tokens the sequence may still emit, this one included: the candidate
        where allowed and the end is still within reach, else the smallest token that
        leads nearest the end, or the end token where the text may end. None: no end
        is reachable from here (an automaton that cannot finish). The state moves by
        the token."""
        a, dist = self.walked.automaton, self.walked.distance
        if candidate is not None:
            nxt = a.next_state(self.state, candidate)
            if nxt is not None and (candidate == a.eos or dist[nxt] <= left - 1):
                self.state = nxt
                return candidate
        if dist[self.state] == 0:
            return a.eos
        token = shortest_token(a, dist, self.state)
        if token is not None:
            nxt = a.next_state(self.state, token)
            assert nxt is not None
            self.state = nxt
        return token


@dataclass(slots=True, eq=False)
class _Sequence:
    record: GenerateRecord
    source: Iterator[int]
    started: float
    emitted: int = 0
    last_step: int = 0  # with a StepBatch: the last step that gave it a token
    walk: AutomatonWalk | None = None  # a constrained request's


class StepBatch:
    """GPU-like decode steps shared by every channel of a peer: every ``period``
    seconds each running sequence gets one token; at most ``batch`` sequences
    (0: no limit) run at once, in admission order across channels, and the rest
    wait for a slot, as on a GPU whose batch is full. A sequence's first token
    comes at the step after it joined (its prefill runs in between)."""

    def __init__(self, period: float, batch: int = 0) -> None:
        if period <= 0 or batch < 0:
            raise ValueError("a step period > 0 and a batch >= 0 (0: no limit)")
        self.period = period
        self.batch = batch
        self._origin: float | None = None
        self._current = 0
        self._running: set[_Sequence] = set()
        self._waiting: deque[_Sequence] = deque()

    def step(self, now: float) -> int:
        """The number of the step ``now`` falls in."""
        if self._origin is None:
            self._origin = now
        self._current = max(self._current, int((now - self._origin) / self.period))
        return self._current

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def join(self, seq: _Sequence, now: float) -> None:
        seq.last_step = self.step(now)
        if self.batch and len(self._running) >= self.batch:
            self._waiting.append(seq)
        else:
            self._running.add(seq)

    def runs(self, seq: _Sequence) -> bool:
        return seq in self._running

    def leave(self, seq: _Sequence) -> None:
        """``seq`` ended: its slot goes to the longest waiting sequence, whose first
        token comes at the next step."""
        if seq in self._running:
            self._running.remove(seq)
            if self._waiting:
                promoted = self._waiting.popleft()
                promoted.last_step = self._current
                self._running.add(promoted)
        elif seq in self._waiting:
            self._waiting.remove(seq)


@dataclass(slots=True)
class GeneratorStats:
    admitted: int = 0
    completed: int = 0
    cancelled: int = 0
    tokens: int = 0
    cancelled_ids: list[int] = field(default_factory=list)


class ActiveSequences(Generic[S]):
    """The running sequences of a channel's source, by request id: what the peer's
    loop asks of every source (``TokenGenerator``, the model engine's)."""

    def __init__(self) -> None:
        self._active: dict[int, S] = {}

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def active_ids(self) -> list[int]:
        return list(self._active)

    def has(self, request_id: int) -> bool:
        return request_id in self._active


class TokenGenerator(ActiveSequences[_Sequence]):
    def __init__(self, *, mode: str, corpus_ids: Sequence[Sequence[int]], eos_token_ids:
                 Sequence[int], tokens_per_s: float, tokens_per_step: int,
                 logprob_tokens_per_step: int = 0, steps: StepBatch | None = None) -> None:
        if mode not in ("replay", "echo"):
            raise ValueError(f"mode must be replay or echo, got {mode!r}")
        if mode == "replay" and not any(corpus_ids):
            raise ValueError("replay needs a non-empty corpus")
        if tokens_per_s < 0:
            raise ValueError("tokens_per_s must be >= 0")
        if tokens_per_step < 1:
            raise ValueError("tokens_per_step must be >= 1")
        if logprob_tokens_per_step < 0:
            raise ValueError("logprob_tokens_per_step must be >= 0 (0: no log probabilities)")
        self.mode = mode
        self._eos = frozenset(eos_token_ids)
        self._corpus, self._starts = corpus_tokens(corpus_ids, eos_token_ids)
        self.tokens_per_s = tokens_per_s
        self.per_step = tokens_per_step
        self.logprob_per_step = logprob_tokens_per_step
        self.steps = steps
        super().__init__()
        self._turn = 0
        self.stats = GeneratorStats()

    def admit(self, record: GenerateRecord, prompt: tuple[int, ...], now: float,
              automaton: CheckedAutomaton | None = None) -> None:
        """Start a sequence; ``automaton`` constrains what it generates."""
        source = self._source(prompt, record.params.seed)
        walk = AutomatonWalk(automaton) if automaton is not None else None
        seq = self._active[record.request_id] = _Sequence(record, source, now, walk=walk)
        if self.steps is not None:
            self.steps.join(seq, now)
        self.stats.admitted += 1

    def _source(self, prompt: tuple[int, ...], seed: int | None) -> Iterator[int]:
        if self.mode == "echo":
            return iter(prompt)
        # The seed picks the document too, so that n > 1 choices with seeds differ.
        start = self._starts[replay_start(prompt, seed, len(self._starts))]
        tokens = self._corpus

        def walk() -> Iterator[int]:
            i = start
            while True:
                yield tokens[i]
                i = (i + 1) % len(tokens)

        return walk()

    def cancel(self, request_id: int) -> ResponseRecord | None:
        """Stop a sequence; its final record says CANCELLED. None if it already ended."""
        seq = self._active.pop(request_id, None)
        if seq is None:
            return None
        if self.steps is not None:
            self.steps.leave(seq)
        self.stats.cancelled += 1
        self.stats.cancelled_ids.append(request_id)
        return ResponseRecord(request_id, (), FinishReason.CANCELLED)

    def drop_all(self) -> None:
        """Forget every sequence without a record (a channel reset: nobody reads them);
        not counted as cancelled, as the kernel does not count them."""
        if self.steps is not None:
            for seq in self._active.values():
                self.steps.leave(seq)
        self._active.clear()

    def step(self, now: float, budget: int) -> list[ResponseRecord]:
        """Records for the tokens due by ``now``, at most ``budget`` records in all.

        Runs engine steps (one record per running sequence each) until nothing more
        is due or the budget is spent; a sequence the budget did not reach waits.
        """
        out: list[ResponseRecord] = []
        while len(out) < budget:
            produced = 0
            # Start each step one sequence further on, so that a small budget (a DPU
            # reading slowly) is shared by every sequence, not spent on the first ones.
            items = list(self._active.items())
            self._turn = (self._turn + 1) % max(1, len(items))
            for request_id, seq in items[self._turn:] + items[:self._turn]:
                if len(out) >= budget:
                    break
                record = self._advance(seq, now)
                if record is None:
                    continue
                out.append(record)
                produced += 1
                if record.final:
                    del self._active[request_id]
                    if self.steps is not None:
                        self.steps.leave(seq)
                    self.stats.completed += 1
            if not produced:
                break
        return out

    def _advance(self, seq: _Sequence, now: float) -> ResponseRecord | None:
        """One step of one sequence: up to ``tokens_per_step`` tokens, or its end."""
        params = seq.record.params
        limit = self.per_step if params.logprobs is None else self.logprob_per_step
        if self.steps is not None:
            # One token a step while it holds a slot; a step it missed is not made up.
            step = self.steps.step(now)
            if step <= seq.last_step or not self.steps.runs(seq):
                return None
            seq.last_step = step
            limit = 1
        elif self.tokens_per_s:
            due = int((now - seq.started) * self.tokens_per_s) + 1  # the first one at once
            limit = min(limit, due - seq.emitted)
            if limit <= 0:
                return None
        tokens: list[int] = []
        finish = FinishReason.NONE
        while len(tokens) < limit and seq.emitted + len(tokens) < params.max_tokens:
            token = next(seq.source, None)
            if seq.walk is not None:
                token = seq.walk.choose(token, params.max_tokens - seq.emitted - len(tokens))
                if token is None:
                    finish = FinishReason.ERROR
                    break
                if token == seq.walk.walked.automaton.eos:
                    finish = FinishReason.STOP
                    break
            if token is None:  # echo ran out of prompt
                finish = FinishReason.STOP
                break
            if token in self._eos and params.ignore_eos:
                continue
            if token in self._eos or token in params.stop_token_ids:
                finish = FinishReason.STOP
                break
            tokens.append(token)
        seq.emitted += len(tokens)
        self.stats.tokens += len(tokens)
        if finish == FinishReason.NONE and seq.emitted >= params.max_tokens:
            finish = FinishReason.LENGTH
        if params.logprobs is None:
            return ResponseRecord(seq.record.request_id, tuple(tokens), finish)
        # One-hot: probability 1 for the token, 0 for every other id.
        entries = tuple(TokenLogprobs(0.0, ((t, 0.0),) if params.logprobs else ())
                        for t in tokens)
        return ResponseRecord(seq.record.request_id, tuple(tokens), finish, entries)
