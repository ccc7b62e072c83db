"""The engine's loop without a GPU: a stand-in runner draws each token from the
sequence's seed and output index alone (as the real sampler's draws depend on
nothing else), so results must not depend on how steps are batched or overlapped."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.engine import Completion, ModelEngine
from dpu_frontend.model.options import EngineOptions, RunnerOptions
from dpu_frontend.model.scheduler import Batch, Sequence
from dpu_frontend.ring.records import FinishReason, SamplingParams

EOS = ModelConfig.default().eos_token_ids[0]


@dataclass
class FakeDrawn:
    tokens: np.ndarray
    logprob: np.ndarray | None
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None

    def lists(self) -> tuple[list[int], list[float] | None, list[list[int]] | None,
                             list[list[float]] | None]:
        return tuple(None if a is None else a.tolist()  # type: ignore[return-value]
                     for a in (self.tokens, self.logprob, self.top_ids, self.top_logprobs))

    def gpu_seconds(self) -> float:
        return 0.0


def draw(seq: Sequence) -> int:
    """A token from (seed, output index): EOS now and then."""
    h = hash((seq.seed, seq.generated)) & 0xFFFF
    return EOS if h % 17 == 0 else 100 + h % 900


class FakeRunner:
    def __init__(self, num_blocks: int, max_seqs: int, max_model_len: int) -> None:
        self.options = RunnerOptions(max_seqs=max_seqs, max_model_len=max_model_len,
                                     block_size=16)
        self.num_blocks = num_blocks
        self.slots: dict[int, int] = {}  # slot -> seq_id loaded there
        self.steps = 0

    def load_prompt(self, seq: Sequence, prompt: list[int]) -> None:
        self.slots[seq.slot] = seq.seq_id

    def step(self, batch: Batch, top_logprobs: int = -1,
             publish: Callable[[FakeDrawn], None] | None = None) -> FakeDrawn | None:
        self.steps += 1
        for w in batch.works:
            assert w.start + w.count <= w.seq.limit, "a step past the sequence's limit"
            assert self.slots[w.seq.slot] == w.seq.seq_id, "a slot given to two sequences"
            assert len(w.seq.table.blocks) * 16 >= w.start + w.count
        sampled = [w.seq for w in batch.works if w.sample]
        if not batch.works or not sampled:
            return None
        tokens = np.array([draw(s) for s in sampled])
        if top_logprobs < 0:
            drawn = FakeDrawn(tokens, None, None, None)
        else:
            lp = -np.array([(t % 5) / 4 for t in tokens], dtype=np.float32)
            top = (np.stack([tokens + j for j in range(top_logprobs)], axis=1)
                   if top_logprobs else None)
            drawn = FakeDrawn(tokens, lp, top, None if top is None
                              else np.repeat(lp[:, None], top_logprobs, axis=1))
        if publish is not None:
            publish(drawn)
        return drawn


def engine(overlap: bool, *, num_blocks: int = 64, max_seqs: int = 8,
           budget: int = 64) -> ModelEngine:
    config = ModelConfig.default()
    runner = FakeRunner(num_blocks, max_seqs, 512)
    return ModelEngine(config, runner,  # type: ignore[arg-type]
                       EngineOptions(max_batched_tokens=budget, overlap=overlap))


def runner_steps(eng: ModelEngine) -> int:
    runner = eng.runner
    assert isinstance(runner, FakeRunner)
    return runner.steps


def workload(rng: random.Random, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[1] * rng.randrange(1, 120) for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 60), seed=rng.randrange(1 << 32),
                             ignore_eos=rng.random() < 0.3,
                             stop_token_ids=(rng.randrange(100, 1000),),
                             logprobs=rng.choice([None, 0, 2]))
              for _ in range(n)]
    return prompts, params


def summary(out: list[Completion]) -> list[tuple[list[int], FinishReason, list[float]]]:
    return [(c.tokens, c.finish, c.logprobs) for c in out]


@pytest.mark.parametrize("seed", range(6))
def test_overlapped_steps_give_the_same_results(seed: int) -> None:
    """Small caches (preemption, waiting admission), stop ids, EOS, lengths."""
    rng = random.Random(seed)
    prompts, params = workload(rng, 24)
    results = []
    for overlap in (False, True):
        eng = engine(overlap, num_blocks=rng.choice([40, 64, 200]))
        out = eng.generate(prompts, params)
        results.append(summary(out))
        assert eng.idle and eng.scheduler.pool.free == eng.scheduler.pool.num_blocks
        # Every emitted token was drawn (and an overlapped engine draws a few it drops).
        stats = eng.stats
        assert stats.tokens >= sum(len(c.tokens) for c in out) > 0
        assert stats.scheduled_tokens >= sum(map(len, prompts)) and 0 < stats.steps <= runner_steps(eng)
    assert results[0] == results[1]
    assert any(f is FinishReason.STOP for _, f, _ in results[0])
    assert any(f is FinishReason.LENGTH for _, f, _ in results[0])


def test_nothing_follows_a_sequences_last_event() -> None:
    eng = engine(True)
    params = SamplingParams(max_tokens=50, seed=3)
    eng.add(0, [1, 2, 3], params)
    events = []
    while not eng.idle:
        events += eng.step()
    finals = [e for e in events if e.finish is not FinishReason.NONE]
    assert len(finals) == 1 and events[-1] is finals[0]
    assert all(e.token is not None for e in events[:-1])


def test_cancel_while_a_step_is_in_flight() -> None:
    rng = random.Random(9)
    eng = engine(True, num_blocks=48)
    prompts, params = workload(rng, 16)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add(i, p, SamplingParams(max_tokens=200, seed=sp.seed, ignore_eos=True))
    seen: dict[int, int] = {}
    cancelled: set[int] = set()
    for step in range(400):
        for ev in eng.step():
            assert ev.seq_id not in cancelled, "an event after the cancel"
            seen[ev.seq_id] = seen.get(ev.seq_id, 0) + 1
        if step % 7 == 3:
            victim = rng.randrange(16)
            eng.cancel(victim)
            cancelled.add(victim)
        if eng.idle:
            break
    assert eng.idle and eng.scheduler.pool.free == 48
    assert all(seen.get(i) == 200 for i in range(16) if i not in cancelled)


def test_an_engine_whose_sequences_are_all_cancelled_is_idle() -> None:
    eng = engine(True)
    for i in range(4):
        eng.add(i, [1] * 20, SamplingParams(max_tokens=100, seed=i, ignore_eos=True))
    for _ in range(5):
        eng.step()
    for i in range(4):
        eng.cancel(i)
    assert eng.idle and eng.scheduler.pool.free == eng.scheduler.pool.num_blocks
    assert eng.step() == [] and eng.idle  # the batch still on its way lands, empty
