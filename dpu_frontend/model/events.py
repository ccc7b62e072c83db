"""What an engine step reports for each sequence it advanced (no torch here: the
model peer's sources and their CI tests use it without a GPU)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dpu_frontend.ring.automaton import CheckedAutomaton
from dpu_frontend.ring.records import FinishReason, SamplingParams

if TYPE_CHECKING:
    from dpu_frontend.model.publish import RingRecords, Target


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One step's outcome for one sequence."""

    seq_id: int
    token: int | None  # None when the step ended the sequence without a token
    finish: FinishReason
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class EngineStats:
    """Where an engine's time goes, cumulative (an operator diffs two readings): the
    host's share of each step against its wait for the GPU's tokens."""

    steps: int = 0  # steps that ran a batch
    tokens: int = 0  # tokens drawn (sampling works)
    scheduled_tokens: int = 0  # prompt and decode tokens through the model
    #: KV positions the steps' attention read: each work's context with its own
    #: tokens (with ``steps``, what a step's bandwidth bound is made of).
    context_tokens: int = 0
    launch_s: float = 0.0  # host: schedule, the step's inputs, the launches
    wait_s: float = 0.0  # host waiting for a step's tokens to reach it
    gpu_s: float = 0.0  # the steps' GPU time (CUDA events around each step's work)
    judge_s: float = 0.0  # host: the stop rules, the events
    #: Structured output: constrained sequences admitted, the automata copied into GPU
    #: memory (one per constraint while it stays there), and those evicted for room.
    constrained: int = 0
    automata_copied: int = 0
    automata_evicted: int = 0
    #: After each step's schedule, the sequences running and those still waiting,
    #: summed over the steps (their means a step: these over ``steps``): a batch smaller
    #: than the pool allows while sequences wait is a scheduling gap, not the load's.
    sum_running: int = 0
    sum_waiting: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StepEngine(Protocol):
    """What the model peer needs of an engine (``ModelEngine``)."""

    @property
    def idle(self) -> bool: ...
    @property
    def stats(self) -> EngineStats: ...
    def add(self, seq_id: int, prompt: list[int], params: SamplingParams,
            target: Target | None = None, automaton: CheckedAutomaton | None = None) -> None: ...
    def cancel(self, seq_id: int, *, final: bool = True) -> None: ...
    def publish_to(self, records: RingRecords) -> None: ...
    def step(self) -> list[TokenEvent]: ...
