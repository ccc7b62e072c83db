"""Structured output's automata on the wire (``ring.automaton``, protocol v2.2): the
encoding round-trips, every check of ``decode_automaton`` refuses what it should (a
GPU side never walks an index out of bounds), and the reference peers' walk steers by
each state's distance to the end (``distances``, ``shortest_token``,
``AutomatonWalk``)."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable

import pytest

from dpu_frontend.config import PeerConfig
from dpu_frontend.errors import ProtocolError
from dpu_frontend.peer.generator import AutomatonWalk, TokenGenerator
from dpu_frontend.peer.reference import ReferenceKernel
from dpu_frontend.ring import FinishReason, GenerateRecord, ResponseRecord, SamplingParams
from dpu_frontend.ring.automaton import (
    AUTOMATON_STRUCT,
    NONE,
    UNREACHABLE,
    CheckedAutomaton,
    TokenAutomaton,
    automaton_identity,
    automaton_key,
    decode_automaton,
    distances,
    encode_automaton,
    shortest_token,
)

VOCAB, EOS = 40, 39


def chain() -> TokenAutomaton:
    """Over 40 tokens, end token 39: state 0 (dense) takes 0-37 to state 1 and 38 to
    state 2; state 1 takes 5 to state 2 and 6 to state 0; state 2 may end (39), or
    take 7 back to state 0; a dead end, state 3, reached from nowhere, only loops on
    itself by 8."""
    return TokenAutomaton(
        vocab_size=VOCAB, eos=EOS,
        list_start=array("i", [0, 1, 3, 5, 6]),
        list_tokens=array("i", [38, 5, 6, 7, EOS, 8]),
        list_next=array("i", [2, 2, 0, 0, 2, 3]),
        default_next=array("i", [1, NONE, NONE, NONE]),
        mask_at=array("i", [0, NONE, NONE, NONE]),
        masks=array("I", [0xFFFF_FFFF, 0x7F]))


def test_the_encoding_round_trips_and_carries_its_key() -> None:
    a = chain()
    data = encode_automaton(a, key=0xDEAD_BEEF_0123_4567)
    assert len(data) == AUTOMATON_STRUCT.size + a.nbytes
    assert decode_automaton(data, VOCAB) == a
    assert automaton_key(data) == 0xDEAD_BEEF_0123_4567


def _patched(offset: int, fmt: str, value: int) -> bytes:
    data = bytearray(encode_automaton(chain()))
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


def _word(index: int, value: int) -> bytes:
    """The encoding with word ``index`` of the arrays (after the header) replaced."""
    return _patched(AUTOMATON_STRUCT.size + 4 * index, "<i", value)


def _without_state_3s_token() -> TokenAutomaton:
    a = chain()
    return TokenAutomaton(a.vocab_size, a.eos, array("i", [0, 1, 3, 5, 5]), a.list_tokens[:5],
                          a.list_next[:5], a.default_next, a.mask_at, a.masks)


# The arrays' words: list_start 0-4, list_tokens 5-10, list_next 11-16, default_next
# 17-20, mask_at 21-24, masks 25-26.
BROKEN: list[tuple[str, Callable[[], bytes], str]] = [
    ("truncated", lambda: encode_automaton(chain())[:40], "shorter than its header"),
    ("magic", lambda: b"DPUFAUT2" + encode_automaton(chain())[8:], "magic"),
    ("vocabulary", lambda: _patched(AUTOMATON_STRUCT.offset("vocab_size"), "<I", 41),
     "vocabulary of 41"),
    ("end token", lambda: _patched(AUTOMATON_STRUCT.offset("eos"), "<I", 40), "end token 40"),
    ("total", lambda: _patched(AUTOMATON_STRUCT.offset("total_bytes"), "<I", 200),
     "declares 200"),
    ("cut short", lambda: encode_automaton(chain())[:-4], "bytes declares"),
    ("list cover", lambda: _word(4, 4), "do not cover"),
    ("list order", lambda: _word(2, 0), "ends before it starts"),
    ("tokens ascending", lambda: _word(6, 9), "not ascending"),
    ("token past vocabulary", lambda: _word(8, 40), "not ascending ids below 40"),
    ("next state", lambda: _word(12, 4), "next state is out of range"),
    ("sparse default", lambda: _word(18, 0), "sparse state 1 has a default"),
    ("dense default", lambda: _word(17, 7), "default 7 is out of range"),
    ("mask offset", lambda: _word(21, 1), "not its own"),
    ("shared mask", lambda: _word(22, 0), "not its own"),
    ("bits past vocabulary", lambda: _word(26, 0x1FF), "past the vocabulary"),
    ("a state allowing nothing", lambda: encode_automaton(_without_state_3s_token()),
     "state 3 allows no token"),
    ("a dense state allowing nothing", lambda: encode_automaton(TokenAutomaton(
        VOCAB, EOS, array("i", [0, 0]), array("i"), array("i"), array("i", [0]),
        array("i", [0]), array("I", [0, 0]))), "state 0 allows no token"),
]


@pytest.mark.parametrize(("what", "make", "message"), BROKEN, ids=[b[0] for b in BROKEN])
def test_every_check_refuses_a_broken_automaton(what: str, make: Callable[[], bytes],
                                                message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_automaton(make(), VOCAB)


def test_distances_and_the_shortest_token() -> None:
    a = chain()
    d = distances(a)
    assert list(d) == [1, 1, 0, UNREACHABLE]
    assert shortest_token(a, d, 0) == 38  # the one token of state 0 straight to the end
    assert shortest_token(a, d, 1) == 5
    assert shortest_token(a, d, 2) == 7  # 7 leads on; the end token is never "shortest"
    assert shortest_token(a, d, 3) is None
    # A dense state that only loops on itself never reaches the end: no token either.
    loop = TokenAutomaton(vocab_size=VOCAB, eos=EOS, list_start=array("i", [0, 0]),
                          list_tokens=array("i"), list_next=array("i"),
                          default_next=array("i", [0]), mask_at=array("i", [0]),
                          masks=array("I", [0xFFFF_FFFF, 0x3F]))
    assert list(distances(loop)) == [UNREACHABLE] and shortest_token(loop, [UNREACHABLE], 0) is None


def test_the_walk_takes_the_source_where_it_may_and_steers_to_the_end() -> None:
    walked = CheckedAutomaton.of(chain())
    walk = AutomatonWalk(walked)
    assert walk.choose(3, left=10) == 3 and walk.state == 1  # allowed: taken
    assert walk.choose(30, left=10) == 5 and walk.state == 2  # not allowed: nearest the end
    assert walk.choose(EOS, left=10) == EOS  # the source's end token, where it may end
    walk = AutomatonWalk(walked)
    # One token left: 3 (to state 1, one more from the end) would leave no room for the
    # end, so the walk takes 38, straight to a state that may end, and then ends.
    assert walk.choose(3, left=1) == 38 and walk.state == 2
    assert walk.choose(7, left=0) == EOS
    walk = AutomatonWalk(walked, state=3)
    assert walk.choose(1, left=5) is None  # a dead end: no token reaches the end


def test_the_replay_generator_walks_a_constrained_request_to_its_end() -> None:
    generator = TokenGenerator(mode="replay", corpus_ids=[[3, 30, 31]], eos_token_ids=(EOS,),
                               tokens_per_s=0, tokens_per_step=8)
    params = SamplingParams(max_tokens=10)
    generator.admit(GenerateRecord(1, 0, 1, params, automaton_bytes=1), (1,), 0.0,
                    CheckedAutomaton.of(chain()))
    # 3 is allowed (to state 1); 30 is not: 5, nearest the end (state 2); 31 is not
    # allowed there, and state 2 may end: the end token, a STOP.
    assert generator.step(0.0, 10) == [ResponseRecord(1, (3, 5), FinishReason.STOP)]
    generator.admit(GenerateRecord(2, 0, 1, params, automaton_bytes=1), (1,), 0.0,
                    CheckedAutomaton.of(chain()))
    generator._active[2].walk = AutomatonWalk(CheckedAutomaton.of(chain()), state=3)
    assert generator.step(0.0, 10) == [ResponseRecord(2, (), FinishReason.ERROR)]


def test_the_reference_kernel_checks_each_automaton_once() -> None:
    """Kept by its identity (key and size): a later request of it is handed the checked
    copy; another key, or another size, is checked on its own."""
    kernel = ReferenceKernel(PeerConfig(), [[5, 6, 7]], (0,), vocab_size=VOCAB)
    encoded = encode_automaton(chain(), key=5)
    identity = automaton_identity(encoded, len(encoded))
    assert identity == (len(encoded)).to_bytes(4, "little") + (5).to_bytes(8, "little")
    assert kernel._cached(identity) is None
    first = kernel._checked(identity, encoded)
    assert first is not None and first.automaton == chain() and first.digest == identity
    assert kernel._cached(identity) is first and kernel._checked(identity, b"") is first
    cut = encoded[:-4]  # fails a check: refused (and logged), nothing kept
    assert kernel._checked(automaton_identity(cut, len(cut)), cut) is None
    assert kernel._cached(automaton_identity(cut, len(cut))) is None
    other = encode_automaton(chain(), key=6)
    assert kernel._checked(automaton_identity(other, len(other)), other) not in (None, first)
    assert ReferenceKernel(PeerConfig(), [[5]], (0,), vocab_size=41)._checked(
        identity, encoded) is None
