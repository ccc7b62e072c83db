"""A deterministic token generator standing in for the persistent GPU kernel.

Two sources: ``replay`` walks a built-in corpus (documents separated by EOS,
so generations end with ``stop`` unless ``ignore_eos``), starting at a
document chosen from a hash of the prompt and the seed; ``echo`` returns
the prompt.
Tokens come at ``tokens_per_s`` per sequence (0: as fast as the ring takes
them), never more than ``max_tokens``, and stop at EOS or a stop token id,
which is not emitted. Pure: the caller passes ``now``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib.resources import files

from dpu_frontend.ring import FinishReason, GenerateRecord, ResponseRecord

DOCUMENT_SEPARATOR = "\n%%\n"


def default_corpus() -> list[str]:
    text = files("dpu_frontend.peer").joinpath("corpus/default.txt").read_text(encoding="utf-8")
    return [doc.strip() for doc in text.split(DOCUMENT_SEPARATOR) if doc.strip()]


@dataclass(slots=True)
class _Sequence:
    record: GenerateRecord
    source: Iterator[int]
    started: float
    emitted: int = 0
    done: bool = False


@dataclass(slots=True)
class EngineStats:
    admitted: int = 0
    completed: int = 0
    cancelled: int = 0
    tokens: int = 0
    cancelled_ids: list[int] = field(default_factory=list)


class Engine:
    def __init__(self, *, mode: str, corpus_ids: Sequence[Sequence[int]], eos_token_ids:
                 Sequence[int], tokens_per_s: float, tokens_per_record: int) -> None:
        if mode not in ("replay", "echo"):
            raise ValueError(f"mode must be replay or echo, got {mode!r}")
        if mode == "replay" and not any(corpus_ids):
            raise ValueError("replay needs a non-empty corpus")
        if tokens_per_s < 0:
            raise ValueError("tokens_per_s must be >= 0")
        self.mode = mode
        self._eos = frozenset(eos_token_ids)
        # Documents joined by EOS: the stream a replay walks through, cyclically.
        eos = eos_token_ids[0] if eos_token_ids else None
        self._stream: list[int] = []
        self._starts: list[int] = []
        for doc in corpus_ids:
            self._starts.append(len(self._stream))
            self._stream += list(doc) + ([eos] if eos is not None else [])
        self.tokens_per_s = tokens_per_s
        self.per_record = tokens_per_record
        self._active: dict[int, _Sequence] = {}
        self.stats = EngineStats()

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def active_ids(self) -> list[int]:
        return list(self._active)

    def admit(self, record: GenerateRecord, prompt: tuple[int, ...], now: float) -> None:
        source = self._source(prompt, record.params.seed)
        self._active[record.request_id] = _Sequence(record, source, now)
        self.stats.admitted += 1

    def _source(self, prompt: tuple[int, ...], seed: int | None) -> Iterator[int]:
        if self.mode == "echo":
            return iter(prompt)
        # The seed picks the document too, so that n > 1 choices with seeds differ.
        start = self._starts[zlib.crc32(repr((prompt, seed)).encode()) % len(self._starts)]
        stream = self._stream

        def walk() -> Iterator[int]:
            i = start
            while True:
                yield stream[i]
                i = (i + 1) % len(stream)

        return walk()

    def cancel(self, request_id: int) -> ResponseRecord | None:
        """Stop a sequence; its final record says CANCELLED. None if it already ended."""
        seq = self._active.pop(request_id, None)
        if seq is None:
            return None
        self.stats.cancelled += 1
        self.stats.cancelled_ids.append(request_id)
        return ResponseRecord(request_id, (), FinishReason.CANCELLED)

    def cancel_all(self) -> None:
        for request_id in list(self._active):
            self.cancel(request_id)

    def step(self, now: float, budget: int) -> list[ResponseRecord]:
        """Records for the tokens due by ``now``, at most ``budget`` records in all."""
        out: list[ResponseRecord] = []
        for request_id, seq in list(self._active.items()):
            if len(out) >= budget:
                break
            out += self._advance(seq, now, budget - len(out))
            if seq.done:
                del self._active[request_id]
                self.stats.completed += 1
        return out

    def _advance(self, seq: _Sequence, now: float, budget: int) -> list[ResponseRecord]:
        params = seq.record.params
        if self.tokens_per_s:
            due = int((now - seq.started) * self.tokens_per_s) + 1  # the first one at once
        else:
            due = seq.emitted + self.per_record * budget
        due = min(due, params.max_tokens, seq.emitted + self.per_record * budget)
        stops = self._eos.union(params.stop_token_ids)
        tokens: list[int] = []
        finish = FinishReason.NONE
        while seq.emitted + len(tokens) < due:
            token = next(seq.source, None)
            if token is None:  # echo ran out of prompt
                finish = FinishReason.STOP
                break
            if token in stops:
                if params.ignore_eos and token in self._eos:
                    continue
                finish = FinishReason.STOP
                break
            tokens.append(token)
        seq.emitted += len(tokens)
        self.stats.tokens += len(tokens)
        if finish == FinishReason.NONE and seq.emitted >= params.max_tokens:
            finish = FinishReason.LENGTH
        seq.done = finish != FinishReason.NONE
        chunks = [tuple(tokens[i:i + self.per_record])
                  for i in range(0, len(tokens), self.per_record)]
        if seq.done and not chunks:
            chunks = [()]
        return [
            ResponseRecord(seq.record.request_id, chunk,
                           finish if i == len(chunks) - 1 else FinishReason.NONE)
            for i, chunk in enumerate(chunks)
        ]
