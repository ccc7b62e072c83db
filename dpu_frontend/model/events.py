"""What an engine step reports for each sequence it advanced (no torch here: the
model peer's sources and their CI tests use it without a GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dpu_frontend.ring.records import FinishReason, SamplingParams


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One step's outcome for one sequence."""

    seq_id: int
    token: int | None  # None when the step ended the sequence without a token
    finish: FinishReason
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class StepEngine(Protocol):
    """What the model peer needs of an engine (``ModelEngine``)."""

    @property
    def idle(self) -> bool: ...
    def add(self, seq_id: int, prompt: list[int], params: SamplingParams) -> None: ...
    def cancel(self, seq_id: int) -> None: ...
    def step(self) -> list[TokenEvent]: ...
