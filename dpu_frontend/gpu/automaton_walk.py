"""The reference walk of a structured-output automaton in C (``automaton_walk.h``), the
CUDA peer's for its replay modes, built for the host and bound with ctypes: the tests
hold it to the Python walk (``peer.generator.AutomatonWalk``, ``ring.automaton``'s
``distances`` and ``shortest_token``)."""

from __future__ import annotations

import ctypes
from array import array
from pathlib import Path

from dpu_frontend.gpu.library import bind
from dpu_frontend.gpu.runtime import WALK_HOST, build_host
from dpu_frontend.ring.automaton import TokenAutomaton, automaton_words

#: automaton_walk.h's DPUF_WALK_NONE: no token, no state.
NONE = -1


class HostWalk:
    """One automaton, as its wire words, walked by ``automaton_walk.h`` on the host."""

    def __init__(self, library: Path, automaton: TokenAutomaton) -> None:
        i32, i64 = ctypes.c_int32, ctypes.c_int64
        p32 = ctypes.POINTER(ctypes.c_int32)
        shape = (ctypes.c_void_p, i32, i32, i32, i32, i32)
        self._lib = bind(library, {
            "dpuf_walk_host_distances": ((*shape, p32), None),
            "dpuf_walk_host_relax": ((*shape, p32, i32, i32), ctypes.c_int),
            "dpuf_walk_host_choose": ((*shape, p32, p32, i32, i64), i32),
        }, "the automaton walk's host build")
        a = automaton
        self.automaton = a
        self._words = ctypes.create_string_buffer(automaton_words(a))
        self._shape = (ctypes.cast(self._words, ctypes.c_void_p), a.vocab_size, a.eos, a.states,
                       len(a.list_tokens), a.mask_words)

    @classmethod
    def build(cls, build_dir: Path, automaton: TokenAutomaton) -> HostWalk:
        return cls(build_host(build_dir, WALK_HOST), automaton)

    def distances(self) -> array[int]:
        """Every state's fewest tokens to an end, by one thread's sweeps."""
        dist = (ctypes.c_int32 * self.automaton.states)()
        self._lib.dpuf_walk_host_distances(*self._shape, dist)
        return array("i", dist)

    def relax(self, dist: array[int], share: int, shares: int) -> bool:
        """One sweep over share ``share`` of ``shares`` of the states (contiguous, the
        last first) of ``dist``, in place: whether a distance fell."""
        buffer = (ctypes.c_int32 * len(dist)).from_buffer(dist)
        return bool(self._lib.dpuf_walk_host_relax(*self._shape, buffer, share, shares))

    def choose(self, dist: array[int], state: int, candidate: int | None,
               left: int) -> tuple[int | None, int]:
        """The token emitted from ``state`` (None: no end reachable) and the state it
        leads to, given the source's ``candidate`` and ``left`` tokens to emit."""
        buffer = (ctypes.c_int32 * len(dist)).from_buffer(dist)
        at = ctypes.c_int32(state)
        token = int(self._lib.dpuf_walk_host_choose(
            *self._shape, buffer, ctypes.byref(at), NONE if candidate is None else candidate,
            left))
        return (None if token == NONE else token), at.value
