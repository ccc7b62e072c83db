"""Where structured output's automata live in GPU memory: the bookkeeping of the pool.

A constrained sequence walks its automaton on the GPU (``layers.constrain``), so the
automaton must stay in GPU memory while the sequence runs. Requests of one constraint
bring the same automaton (one digest): the pool keeps one copy of it, counted by the
sequences that use it. A copy nobody uses stays until its room is needed (the next
request of the constraint finds it there), the least recently used first.

Pure Python: the engine decides here, at admission, where each automaton goes; the
runner copies it there (``layers.constrain.DeviceAutomata``). Everything runs on the
runner's one stream, so a copy written over an evicted automaton lands after every
step that walked it.
"""

from __future__ import annotations

from bisect import insort
from collections import OrderedDict
from dataclasses import dataclass

from dpu_frontend.ring.automaton import CheckedAutomaton

#: Placements are rounded up to this many 32-bit words (128 bytes).
ALIGN_WORDS = 32


def pool_words(automaton: CheckedAutomaton) -> int:
    """The words an automaton takes in the pool: its six arrays, aligned."""
    words = automaton.automaton.nbytes // 4
    return -(-words // ALIGN_WORDS) * ALIGN_WORDS


@dataclass(eq=False, slots=True)
class PoolEntry:
    """One automaton's place in the pool: words ``base`` .. ``base + words``."""

    checked: CheckedAutomaton
    base: int
    words: int
    users: int = 0
    #: The runner copied it there (the first sequence to use it does).
    resident: bool = False


class AutomatonPool:
    """``capacity`` words of GPU memory for automata (module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("the automaton pool's capacity must be >= 0")
        self.capacity = capacity
        self._entries: dict[bytes, PoolEntry] = {}
        #: Entries nobody uses, least recently released first.
        self._idle: OrderedDict[bytes, PoolEntry] = OrderedDict()
        #: Placed (base, end) spans, by base.
        self._spans: list[tuple[int, int]] = []
        self.evictions = 0

    def fits(self, automaton: CheckedAutomaton) -> bool:
        """Could the pool hold ``automaton`` at all (with nothing else in it)?"""
        return pool_words(automaton) <= self.capacity

    def acquire(self, automaton: CheckedAutomaton) -> PoolEntry | None:
        """``automaton``'s entry, one more user counted: its copy where the pool holds
        one, else a new place, evicting unused copies as needed. None: the copies in use
        leave no room now (the sequence waits for some to finish)."""
        entry = self._entries.get(automaton.digest)
        if entry is None:
            words = pool_words(automaton)
            if words > self.capacity:
                raise ValueError(f"an automaton of {4 * words} bytes does not fit the "
                                 f"{4 * self.capacity}-byte automaton pool")
            base = self._place(words)
            if base is None and self._place(words, in_use=True) is None:
                return None  # evicting every unused copy would not make room: keep them
            while base is None:
                self._evict()
                base = self._place(words)
            entry = self._entries[automaton.digest] = PoolEntry(automaton, base, words)
            insort(self._spans, (base, base + words))
        self._idle.pop(automaton.digest, None)
        entry.users += 1
        return entry

    def release(self, entry: PoolEntry) -> None:
        """One user less; the copy stays, unused, until its room is needed."""
        if entry.users <= 0 or self._entries.get(entry.checked.digest) is not entry:
            raise ValueError("released an automaton the pool does not count as used")
        entry.users -= 1
        if entry.users == 0:
            self._idle[entry.checked.digest] = entry

    @property
    def used_words(self) -> int:
        return sum(end - base for base, end in self._spans)

    @property
    def entries(self) -> int:
        return len(self._entries)

    def _place(self, words: int, *, in_use: bool = False) -> int | None:
        """The lowest base of a free run of ``words`` words; ``in_use``: as if every
        unused copy were gone."""
        idle = {(e.base, e.base + e.words) for e in self._idle.values()} if in_use else set()
        at = 0
        for base, end in self._spans:
            if (base, end) in idle:
                continue
            if base - at >= words:
                return at
            at = end
        return at if self.capacity - at >= words else None

    def _evict(self) -> None:
        digest, entry = self._idle.popitem(last=False)
        del self._entries[digest]
        self._spans.remove((entry.base, entry.base + entry.words))
        self.evictions += 1
