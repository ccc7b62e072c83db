"""Structured output walked on the GPU (``model.layers.constrain``, protocol 5.4): the
masking and state kernels against ``TokenAutomaton``'s own walk, the sampler against
the NumPy reference with the same mask, and the engine: a constrained sequence
generates only what its automaton accepts, ends with STOP at its end, and draws the
same tokens alone and inside a batch of others, constrained or not (docs/gpu.md)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from dpu_frontend.model.automata import AutomatonPool, PoolEntry
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.model.layers.constrain import DeviceAutomata
from dpu_frontend.model.layers.sampler import batch_params
from dpu_frontend.model.metadata import SamplingRows
from dpu_frontend.model.sampling import sample as reference_sample
from dpu_frontend.ring.automaton import CheckedAutomaton, TokenAutomaton, build_automaton
from dpu_frontend.ring.records import FinishReason
from tests.gpu.test_model import MIXED, SEED, engine, prompts

pytestmark = pytest.mark.gpu

VOCAB = ModelConfig.default().vocab_size
#: The automata's vocabulary: the tokenizer's, below the model's padded one.
TOKENIZER_VOCAB = 151_669
EOS = ModelConfig.default().eos_token_ids[0]


def random_automaton(rng: random.Random, states: int) -> TokenAutomaton:
    """Dense states (most of the vocabulary, to a few targets) and sparse ones (a few
    dozen tokens), every state allowing something, the end token in some."""
    transitions: dict[int, dict[int, int]] = {}
    for s in range(states):
        if rng.random() < 0.3:
            allowed = rng.sample(range(TOKENIZER_VOCAB), rng.randrange(80_000, 150_000))
            targets = [rng.randrange(states) for _ in range(3)]
            transitions[s] = {t: targets[0] if rng.random() < 0.95 else rng.choice(targets)
                              for t in allowed}
        else:
            allowed = rng.sample(range(TOKENIZER_VOCAB), rng.randrange(1, 60))
            transitions[s] = {t: rng.randrange(states) for t in allowed}
        if rng.random() < 0.3:
            transitions[s][EOS] = s
    return build_automaton(transitions, 0, TOKENIZER_VOCAB, EOS)


@pytest.fixture(scope="module")
def automata() -> list[CheckedAutomaton]:
    rng = random.Random(SEED)
    return [CheckedAutomaton.of(random_automaton(rng, 12)) for _ in range(3)]


def attached(device: DeviceAutomata, pool: AutomatonPool, slot: int,
             checked: CheckedAutomaton | None) -> PoolEntry | None:
    entry = pool.acquire(checked) if checked is not None else None
    device.attach(slot, entry)
    return entry


_ALLOWED: dict[tuple[int, int], np.ndarray] = {}


def allowed_of(a: TokenAutomaton, state: int) -> np.ndarray:
    """What ``state`` allows, over the model's ids (-1: the end token alone)."""
    key = (id(a), state)
    if key not in _ALLOWED:
        mask = np.zeros(VOCAB, np.bool_)
        mask[a.allowed(state) if state >= 0 else [a.eos]] = True
        _ALLOWED[key] = mask
    return _ALLOWED[key]


def test_the_mask_and_the_moves_are_the_automatons(automata: list[CheckedAutomaton]) -> None:
    """64 rows in random slots and states (state -1: only the end), every third row
    unconstrained; tokens drawn inside and outside what each state allows."""
    rng = random.Random(SEED + 1)
    pool = AutomatonPool(64 << 20)
    device = DeviceAutomata(pool.capacity, 65, 65, VOCAB, torch.device("cuda"))
    walked: dict[int, tuple[TokenAutomaton, int] | None] = {}
    for slot in range(64):
        checked = None if slot % 3 == 2 else automata[slot % 3]
        attached(device, pool, slot, checked)
        if checked is None:
            walked[slot] = None
            continue
        state = rng.randrange(-1, checked.automaton.states)
        device.state[slot] = state
        walked[slot] = (checked.automaton, state)
    order = list(range(64))
    rng.shuffle(order)
    slots = torch.tensor(order, dtype=torch.int64, device="cuda")
    logits = torch.randn((64, VOCAB), device="cuda")
    masked = device.mask(logits, slots).cpu().numpy()
    host = logits.cpu().numpy()
    tokens = []
    for row, slot in enumerate(order):
        w = walked[slot]
        if w is None:
            assert np.array_equal(masked[row], host[row])
            tokens.append(rng.randrange(VOCAB))
            continue
        allowed = allowed_of(*w)
        assert np.array_equal(np.isfinite(masked[row]), allowed), f"slot {slot}"
        assert np.array_equal(masked[row][allowed], host[row][allowed])
        inside = np.flatnonzero(allowed)
        tokens.append(int(rng.choice(inside)) if rng.random() < 0.8 else rng.randrange(VOCAB))
    assert not device._keep.any(), "the listed tokens' marks outlived the step"
    device.advance(torch.tensor(tokens, device="cuda"), slots)
    states = device.state.tolist()
    moved = 0
    for row, slot in enumerate(order):
        w = walked[slot]
        if w is None:
            continue
        a, state = w
        expected = a.next_state(state, tokens[row]) if state >= 0 else None
        assert states[slot] == (-1 if expected is None else expected), f"slot {slot}"
        moved += expected is not None
    print(f"mask and moves of 64 rows over {VOCAB} ids equal the automata's walk "
          f"({moved} allowed moves, the rest to -1)")


def test_constrained_draws_are_the_references(bf16_engine: ModelEngine,
                                              automata: list[CheckedAutomaton]) -> None:
    """The sampler's whole path for 60 rows over 8 steps (greedy, top-p, top-k and
    min-p), the state moving by each draw: the NumPy reference draws the same from the
    same logits masked by the same state."""
    runner = bf16_engine.runner
    pool = AutomatonPool(64 << 20)
    device = DeviceAutomata(pool.capacity, 61, 61, VOCAB, runner.device)
    n = 60
    params = [replace(MIXED[i % 3], presence_penalty=0.0, frequency_penalty=0.0,
                      repetition_penalty=1.0, seed=5000 + i) for i in range(n)]
    states = []
    for slot in range(n):
        attached(device, pool, slot, automata[slot % 3])
        states.append(0)
    slots = torch.arange(n, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    same = total = 0
    for step in range(8):
        logits = torch.randn((n, VOCAB), generator=gen, device="cuda") * 3
        rows = [(p, p.seed or 0, step) for p in params]
        sampling = SamplingRows.from_params(rows, VOCAB)
        sampling = replace(sampling, any_constrained=True)
        before = device.state.tolist()
        drawn = runner.sampler.step(logits.clone(), batch_params(sampling, runner.device), slots,
                                    torch.full((n,), 10 + step, device="cuda"), runner.slots, -1,
                                    device).tokens.tolist()
        host = logits.cpu().numpy()
        after = device.state.tolist()
        for i, p in enumerate(params):
            a = automata[i % 3].automaton
            allowed = allowed_of(a, before[i])
            token = reference_sample(host[i], p, p.seed or 0, step, allowed=allowed)
            same += drawn[i] == token
            total += 1
            assert allowed[drawn[i]], f"row {i} drew {drawn[i]}, which its state does not allow"
            nxt = a.next_state(before[i], drawn[i]) if before[i] >= 0 else None
            assert after[i] == (-1 if nxt is None else nxt)
    print(f"constrained GPU draws = NumPy reference on {same} of {total}")
    assert same >= total - 2  # a last-ulp log() difference may flip a near tie


@pytest.fixture(scope="module")
def bf16_engine() -> Iterator[ModelEngine]:
    yield engine("bfloat16", num_blocks=4096)
    torch.cuda.empty_cache()


CHOICES = [[1000, 2000, 3000], [1000, 2500], [4000, 4100, 4200, 4300, 4400]]


def choice_automaton(choices: list[list[int]]) -> CheckedAutomaton:
    """Exactly one of ``choices``, then the end."""
    transitions: dict[int, dict[int, int]] = {0: {}}
    count = 1
    ends = []
    for tokens in choices:
        state = 0
        for t in tokens:
            nxt = transitions[state].get(t)
            if nxt is None:
                nxt = transitions[state][t] = count
                transitions[count] = {}
                count += 1
            state = nxt
        ends.append(state)
    for state in ends:
        transitions[state][EOS] = state
    return CheckedAutomaton.of(build_automaton(transitions, 0, TOKENIZER_VOCAB, EOS))


def test_the_engine_generates_only_what_the_automaton_accepts(
        bf16_engine: ModelEngine, automata: list[CheckedAutomaton]) -> None:
    """Three constrained sequences (a choice, two random automata) alone and inside a
    batch of 64 with unconstrained ones and others of the same constraints: the same
    tokens; the choice ends with STOP on one of its choices; the unconstrained ones
    draw what they draw without constrained neighbours (ignore_eos is overridden by the
    automaton's end)."""
    eng = bf16_engine
    choice = choice_automaton(CHOICES)
    constraints: list[CheckedAutomaton | None] = [choice, automata[0], automata[1]]
    targets = prompts(3, SEED + 7)
    params = [replace(MIXED[i], max_tokens=24) for i in range(3)]
    alone = []
    for p, sp, c in zip(targets, params, constraints, strict=True):
        eng.add(0, p, sp, automaton=c)
        alone.append(_drain(eng)[0])
    crowd = prompts(61, SEED + 8)
    rng = random.Random(SEED + 9)
    crowd_params = [replace(rng.choice(MIXED), max_tokens=24, seed=rng.randrange(2**64))
                    for _ in crowd]
    crowd_constraints: list[CheckedAutomaton | None] = [
        rng.choice([None, None, choice, automata[2]]) for _ in crowd]
    free = [i for i, c in enumerate(crowd_constraints) if c is None]
    unconstrained = eng.generate([crowd[i] for i in free], [crowd_params[i] for i in free])
    for i, (p, sp, c) in enumerate(zip(targets + crowd, params + crowd_params,
                                       constraints + crowd_constraints, strict=True)):
        eng.add(i, p, sp, automaton=c)
    together = _drain(eng)
    for i in range(3):
        assert together[i] == alone[i], f"constrained sequence {i} changed inside a batch of 64"
    for j, i in enumerate(free):
        assert together[3 + i] == (unconstrained[j].tokens, unconstrained[j].finish)
    for i, c in enumerate(constraints + crowd_constraints):
        tokens, finish = together[i]
        if c is None:
            continue
        a = c.automaton
        state = a.walk(tokens)
        assert state is not None, f"sequence {i}'s tokens leave its automaton"
        if finish is FinishReason.STOP:
            assert a.may_end(state)
        if c is choice:
            assert finish is FinishReason.STOP and tokens in CHOICES, (tokens, finish)
    assert eng.automata.used_words and not eng._entries
    print("3 constrained sequences (a choice, two random automata): identical alone and in a "
          f"batch of 64 ({len(free)} unconstrained, unchanged by their neighbours); every "
          "constrained output walks its automaton")


def _drain(eng: ModelEngine) -> dict[int, tuple[list[int], FinishReason]]:
    out: dict[int, tuple[list[int], FinishReason]] = {}
    while not eng.idle:
        for ev in eng.step():
            tokens, _ = out.get(ev.seq_id, ([], FinishReason.NONE))
            if ev.token is not None:
                tokens.append(ev.token)
            out[ev.seq_id] = (tokens, ev.finish)
    return out
