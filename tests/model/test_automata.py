"""Where structured output's automata live in GPU memory (``model.automata``): one copy
per constraint, counted by its sequences, unused copies evicted least recently used
first, and a sequence that finds no room waits for one."""

from __future__ import annotations

from array import array

import pytest

from dpu_frontend.model.automata import ALIGN_WORDS, AutomatonPool, pool_words
from dpu_frontend.ring.automaton import CheckedAutomaton, TokenAutomaton


def automaton(states: int, vocab: int = 64) -> CheckedAutomaton:
    """A chain of ``states`` sparse states over ``vocab`` ids: token s leads from state s
    to s + 1, and the last state may only end (token vocab - 1)."""
    eos = vocab - 1
    return CheckedAutomaton.of(TokenAutomaton(
        vocab, eos, array("i", range(states + 1)),
        array("i", [*range(states - 1), eos]), array("i", [*range(1, states), states - 1]),
        array("i", [-1] * states), array("i", [-1] * states), array("I")))


def test_the_words_an_automaton_takes_are_aligned() -> None:
    a = automaton(10)
    assert a.automaton.nbytes == 4 * (11 + 2 * 10 + 2 * 10)
    assert pool_words(a) == 2 * ALIGN_WORDS


def test_one_copy_per_constraint_counted_by_its_users() -> None:
    pool = AutomatonPool(10 * ALIGN_WORDS)
    a, b = automaton(10), automaton(12)
    first = pool.acquire(a)
    again = pool.acquire(CheckedAutomaton(a.automaton, a.digest))  # another request's copy
    assert first is again and first is not None and first.users == 2
    other = pool.acquire(b)
    assert other is not None and other.base == first.base + first.words
    assert pool.entries == 2 and pool.used_words == first.words + other.words
    pool.release(first)
    pool.release(first)
    assert first.users == 0 and pool.entries == 2  # unused, kept for the next request
    assert pool.acquire(a) is first and first.users == 1
    pool.release(other)
    with pytest.raises(ValueError, match="does not count as used"):
        pool.release(other)


def test_room_comes_from_the_least_recently_released_copies() -> None:
    pool = AutomatonPool(6 * ALIGN_WORDS)  # three automata of two blocks
    a, b, c, d = (automaton(7 + i) for i in range(4))
    ea, eb, ec = (pool.acquire(x) for x in (a, b, c))
    assert ea is not None and eb is not None and ec is not None
    assert pool.acquire(d) is None  # every copy in use: d waits
    pool.release(eb)
    pool.release(ea)
    ed = pool.acquire(d)  # b went first (released first), and d takes its place
    assert ed is not None and ed.base == eb.base and pool.evictions == 1
    assert pool.acquire(a) is ea  # a is still there
    e = automaton(12)
    assert pool.acquire(e) is None  # nothing unused left to evict
    pool.release(ed)
    assert pool.acquire(e) is not None and pool.evictions == 2


def test_a_gap_too_small_is_passed_over_and_evictions_make_one_run() -> None:
    pool = AutomatonPool(5 * ALIGN_WORDS)
    big = automaton(15)
    smalls = [automaton(n) for n in (3, 4, 5)]
    assert pool_words(big) == 3 * ALIGN_WORDS
    assert all(pool_words(x) == ALIGN_WORDS for x in smalls)
    s1, s2, s3 = (pool.acquire(x) for x in smalls)
    assert s1 is not None and s2 is not None and s3 is not None
    pool.release(s2)
    pool.release(s3)
    # 2 blocks free at the end; s2 goes first, leaving a gap of one before s3; then s3,
    # and the gap, s3's block and the end make one run of 4.
    entry = pool.acquire(big)
    assert entry is not None and entry.base == s2.base and pool.evictions == 2
    assert pool.acquire(automaton(6)) is not None  # the last free block, after big
    assert pool.acquire(automaton(2)) is None and pool.acquire(smalls[0]) is s1


def test_an_automaton_larger_than_the_pool_is_refused() -> None:
    pool = AutomatonPool(ALIGN_WORDS)
    assert not pool.fits(automaton(20)) and pool.fits(automaton(5))
    with pytest.raises(ValueError, match="does not fit"):
        pool.acquire(automaton(20))


def test_nothing_is_evicted_where_evicting_would_not_make_room() -> None:
    """The copies in use leave no run long enough even without the unused ones: the
    unused ones stay for the requests that bring them again."""
    pool = AutomatonPool(5 * ALIGN_WORDS)
    unused, used = pool.acquire(automaton(3)), pool.acquire(automaton(4))  # a block each
    assert unused is not None and used is not None and used.base == ALIGN_WORDS
    pool.release(unused)
    # 4 blocks: without `unused` the free runs are 1 block and 3, never 4.
    assert pool_words(automaton(20)) == 4 * ALIGN_WORDS
    assert pool.acquire(automaton(20)) is None
    assert pool.evictions == 0 and pool.acquire(automaton(3)) is unused
    pool.release(unused)
    assert pool.acquire(automaton(9)) is not None and pool.evictions == 0  # 2 blocks: free
