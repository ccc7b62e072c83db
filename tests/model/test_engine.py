"""The engine's loop without a GPU: a stand-in runner draws each token from the
sequence's seed and output index alone (as the real sampler's draws depend on
nothing else), so results must not depend on how steps are batched or overlapped."""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from dpu_frontend.model.automata import PoolEntry
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.engine import Completion, ModelEngine
from dpu_frontend.model.options import EngineOptions, RunnerOptions
from dpu_frontend.model.scheduler import Batch, Sequence
from dpu_frontend.ring.automaton import CheckedAutomaton, TokenAutomaton
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
    def __init__(self, num_blocks: int, max_seqs: int, max_model_len: int,
                 automaton_pool_bytes: int = 1 << 20) -> None:
        self.options = RunnerOptions(max_seqs=max_seqs, max_model_len=max_model_len,
                                     block_size=16, automaton_pool_bytes=automaton_pool_bytes)
        self.num_blocks = num_blocks
        self.slots: dict[int, int] = {}  # slot -> seq_id loaded there
        self.automata: dict[int, PoolEntry | None] = {}  # slot -> its automaton's entry
        self.steps = 0

    def load_prompt(self, seq: Sequence, prompt: list[int],
                    automaton: PoolEntry | None = None) -> None:
        self.slots[seq.slot] = seq.seq_id
        if automaton is not None:
            assert automaton.users > 0, "a slot given an automaton nobody counts"
            automaton.resident = True  # copied (DeviceAutomata.attach)
        self.automata[seq.slot] = automaton

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


def constraint(states: int, eos: int = EOS) -> CheckedAutomaton:
    """A chain of ``states`` sparse states over the model's ids; the last may only end."""
    vocab = ModelConfig.default().vocab_size
    return CheckedAutomaton.of(TokenAutomaton(
        vocab, eos, array("i", range(states + 1)), array("i", [*range(states - 1), eos]),
        array("i", [*range(1, states), states - 1]), array("i", [-1] * states),
        array("i", [-1] * states), array("I")))


def constrained_engine(pool_bytes: int) -> ModelEngine:
    runner = FakeRunner(64, 4, 512, automaton_pool_bytes=pool_bytes)
    return ModelEngine(ModelConfig.default(), runner,  # type: ignore[arg-type]
                       EngineOptions(max_batched_tokens=64))


def test_constrained_sequences_share_a_copy_and_wait_for_room() -> None:
    """Two constraints whose automata do not fit the pool together: the second one's
    sequence waits for admission until the first's are done; the first's share one
    copy; every copy is released at the end."""
    eng = constrained_engine(4 * 128)  # 4 blocks of 32 words: one 3-block automaton
    a, b = constraint(15), constraint(16)  # 76 and 81 words: 3 blocks each
    params = SamplingParams(max_tokens=6, seed=1, ignore_eos=True)
    eng.add(0, [1] * 4, params, automaton=a)
    eng.add(1, [1] * 4, params, automaton=CheckedAutomaton(a.automaton, a.digest))
    eng.add(2, [1] * 4, params, automaton=b)
    eng.add(3, [1] * 4, params)  # unconstrained: behind the waiting one, in order
    runner = eng.runner
    assert isinstance(runner, FakeRunner)
    eng.step()
    loaded = {runner.slots[slot]: entry for slot, entry in runner.automata.items()}
    assert set(loaded) == {0, 1}  # 2 waits for room, and 3 behind it
    assert loaded[0] is loaded[1] and loaded[0] is not None and loaded[0].users == 2
    while not eng.idle:
        eng.step()
    loaded = {runner.slots[slot]: entry for slot, entry in runner.automata.items()}
    assert set(loaded) == {2, 3} and loaded[3] is None  # in the slots 0 and 1 left
    entry = loaded[2]
    assert entry is not None and entry.users == 0 and eng.automata.evictions == 1
    assert eng.automata.entries == 1
    stats = eng.stats
    assert (stats.constrained, stats.automata_copied, stats.automata_evicted) == (3, 2, 1)


def test_a_constrained_sequence_ends_at_its_automatons_end_token() -> None:
    """Protocol 5.4: the end token finishes a constrained sequence with STOP, whatever
    ignore_eos says, on the host's judgement and the record writer's (its stop ids)."""
    eng = constrained_engine(1 << 20)
    eng.add(0, [1], SamplingParams(max_tokens=4, ignore_eos=True), automaton=constraint(3))
    assert not eng._seqs[0].params.ignore_eos  # EOS is the engine's: it stops as one
    eng.add(1, [1], SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=(9,)),
            automaton=constraint(3, eos=5))
    params = eng._seqs[1].params
    assert params.ignore_eos and params.stop_token_ids == (9, 5)
    with pytest.raises(ValueError, match="no room for its automaton's end token 5"):
        eng.add(2, [1], SamplingParams(max_tokens=4, stop_token_ids=tuple(range(10, 18))),
                automaton=constraint(3, eos=5))
    with pytest.raises(ValueError, match="does not fit the 128-byte automaton pool"):
        constrained_engine(128).add(3, [1], SamplingParams(max_tokens=4),
                                    automaton=constraint(15))
    eng.cancel(0)
    eng.cancel(1)
    assert eng.idle and eng.automata.used_words == 0  # never admitted: nothing held


def test_cancelled_and_finished_sequences_release_their_automaton() -> None:
    for overlap in (False, True):
        runner = FakeRunner(64, 4, 512)
        eng = ModelEngine(ModelConfig.default(), runner,  # type: ignore[arg-type]
                          EngineOptions(max_batched_tokens=64, overlap=overlap))
        a = constraint(4)
        for i in range(4):
            eng.add(i, [1] * 3, SamplingParams(max_tokens=3 + 20 * (i % 2), seed=i,
                                               ignore_eos=True), automaton=a)
        for _ in range(3):
            eng.step()
        eng.cancel(1)
        while not eng.idle:
            eng.step()
        entry = next(e for e in runner.automata.values() if e is not None)
        assert entry.users == 0 and eng.automata.entries == 1 and not eng._entries
