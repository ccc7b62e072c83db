"""The reference walk of a structured-output automaton in C (``gpu/automaton_walk.h``, the
CUDA peer's for its replay modes), built for the host, against the Python walk
(``AutomatonWalk``, ``distances``, ``shortest_token``): the same distances, however the
relaxation's sweeps are cut and ordered (as threads would run them), and the same token
and state at every step of every walk."""

from __future__ import annotations

import random
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_frontend.gpu.automaton_walk import HostWalk
from dpu_frontend.peer.generator import AutomatonWalk
from dpu_frontend.ring.automaton import (
    UNREACHABLE,
    CheckedAutomaton,
    TokenAutomaton,
    build_automaton,
    distances,
)
from tests.unit.test_automaton import chain


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("walk")


def random_automaton(rng: random.Random, states: int, vocab: int) -> TokenAutomaton:
    """Dense states (most of the vocabulary, to a few targets) and sparse ones, some
    allowing the end token, some leading only where no end is reachable."""
    eos = rng.randrange(vocab)
    transitions: dict[int, dict[int, int]] = {}
    for s in range(states):
        if rng.random() < 0.3:
            allowed = rng.sample(range(vocab), rng.randrange(vocab // 2, vocab))
            targets = [rng.randrange(states) for _ in range(3)]
            transitions[s] = {t: targets[0] if rng.random() < 0.9 else rng.choice(targets)
                              for t in allowed}
        else:
            allowed = rng.sample(range(vocab), rng.randrange(0, min(12, vocab)))
            transitions[s] = {t: rng.randrange(states) for t in allowed}
        transitions[s].pop(eos, None)
        if rng.random() < 0.25:
            transitions[s][eos] = s
    return build_automaton(transitions, 0, vocab, eos)


def automata(seed: int) -> list[TokenAutomaton]:
    rng = random.Random(seed)
    return [chain()] + [random_automaton(rng, rng.randint(1, 40), rng.choice([33, 64, 200, 1000]))
                        for _ in range(30)]


@pytest.mark.parametrize("seed", range(4))
def test_the_distances_are_the_breadth_first_ones(build_dir: Path, seed: int) -> None:
    for a in automata(seed):
        assert HostWalk.build(build_dir, a).distances() == distances(a)


@pytest.mark.parametrize("seed", range(4))
def test_sweeps_cut_and_ordered_as_threads_run_them_reach_the_same_distances(
        build_dir: Path, seed: int) -> None:
    """Each sweep a thread's share (a contiguous run of states), the shares run in a
    random order: the distances only fall, to the one fixed point."""
    rng = random.Random(seed)
    for a in automata(seed):
        walk = HostWalk.build(build_dir, a)
        dist = array("i", [UNREACHABLE] * a.states)
        shares = rng.randint(1, 9)
        fell = True
        while fell:
            order = list(range(shares))
            rng.shuffle(order)
            fell = any([walk.relax(dist, share, shares) for share in order])
        assert dist == distances(a)


def test_a_chain_of_states_takes_a_sweep_a_share(build_dir: Path) -> None:
    """A run of states each leading to the next, the end at the last (how a compiled
    automaton numbers a long constraint's states): swept downwards, one sweep a share
    carries the distances down, where an upward sweep needed one a state."""


def walk_both(walk: HostWalk, rng: random.Random, steps: int) -> int:
    """One sequence walked by both, candidate by candidate (the source's tokens: in the
    vocabulary, allowed or not, and at times none): the same token and state each time.
    Returns the tokens emitted."""
    a = walk.automaton
    python = AutomatonWalk(CheckedAutomaton.of(a))
    dist = walk.distances()
    state, left = 0, rng.randint(1, steps)
    emitted = 0
    while left > 0:
        if rng.random() < 0.1:
            candidate = None
        elif rng.random() < 0.5:
            candidate = rng.choice(a.allowed(state) or [0])
        else:
            candidate = rng.randrange(a.vocab_size)
        want = python.choose(candidate, left)
        got, state = walk.choose(dist, state, candidate, left)
        assert (got, state) == (want, python.state), (candidate, left)
        if got is None or got == a.eos:
            break
        emitted += 1
        left -= 1
    return emitted


@pytest.mark.parametrize("seed", range(4))
def test_a_walk_emits_the_python_walks_tokens(build_dir: Path, seed: int) -> None:
    rng = random.Random(100 + seed)
    emitted = 0
    for a in automata(seed):
        walk = HostWalk.build(build_dir, a)
        for _ in range(20):
            emitted += walk_both(walk, rng, 60)
    assert emitted > 1000


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), states=st.integers(1, 25),
       vocab=st.sampled_from([2, 31, 32, 33, 97]))
def test_hypothesis_walks(build_dir: Path, seed: int, states: int, vocab: int) -> None:
    rng = random.Random(seed)
    a = random_automaton(rng, states, vocab)
    walk = HostWalk.build(build_dir, a)
    assert walk.distances() == distances(a)
    for _ in range(5):
        walk_both(walk, rng, 30)
    states, vocab = 200, 50
    transitions = {s: {1 + s % 7: s + 1} for s in range(states - 1)}
    transitions[states - 1] = {49: states - 1}
    a = build_automaton(transitions, 0, vocab, 49)
    walk = HostWalk.build(build_dir, a)
    for shares in (1, 4, 16):
        dist = array("i", [UNREACHABLE] * a.states)
        sweeps = 1
        while any([walk.relax(dist, share, shares) for share in range(shares)]):
            sweeps += 1
        assert dist == distances(a) == array("i", range(states - 1, -1, -1))
        assert sweeps <= shares + 1, (shares, sweeps)
