"""Token automata of structured output, and their wire form in the prompt arena
(protocol v2.2, docs/protocol.md section 5.4).

A constraint (a JSON schema, a regex, a choice; ``text.constraints`` compiles it on
the DPU) is a deterministic automaton over the model's token ids, which the GPU side
walks: each step it masks the logits by the sequence's state, draws, and moves the
state by the drawn token, so nothing waits for the DPU per token.

- States are numbered 0..S-1 in breadth-first order from the start, state 0.
- A state holds a sorted list of (token, next state) pairs, and either nothing more
  (a *sparse* state: the list is every allowed token) or a bitmask over the
  vocabulary with a default next state (a *dense* state: the tokens of a JSON
  string's inside, most of the vocabulary, nearly all going to one state; the list
  then holds only the allowed tokens whose next state is not the default).
- Token ``t`` is allowed in state ``s`` if it is in the list or its bit is set; its
  next state is the list's where listed, else the default.
- The end token (one id) is allowed exactly where the constraint's text may end.
  Drawing it finishes the sequence with STOP.

On the wire the automaton is a 64-byte header (``dpuf_automaton``) and six arrays of
32-bit words, in this order: ``list_start`` [S + 1], ``list_tokens`` [L],
``list_next`` [L], ``default_next`` [S], ``mask_at`` [S], ``masks`` [D x W], where D
is the number of dense states and W = ceil(vocabulary / 32). It follows the prompt in
the arena, at the prompt's span plus its length rounded up to 128 bytes. Everything
in it is checked before a peer walks it (``decode_automaton``): a bad automaton is a
``ProtocolError``, never an index out of bounds on the GPU.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import compress, pairwise, repeat

from dpu_frontend.errors import ProtocolError
from dpu_frontend.ring.cstruct import CStruct
from dpu_frontend.ring.layout import AUTOMATON_HEADER_SIZE

#: No list entry: a sparse state's default, and the bitmask offset of a sparse state.
NONE = -1
AUTOMATON_MAGIC = b"DPUFAUT1"
AUTOMATON_STRUCT = CStruct("dpuf_automaton", (
    ("magic", "8s"), ("header_size", "I"), ("vocab_size", "I"), ("eos", "I"),
    ("states", "I"), ("list_len", "I"), ("mask_words", "I"), ("dense_states", "I"),
    ("total_bytes", "I"), ("key", "Q"),
), AUTOMATON_HEADER_SIZE)
#: A state's distance to the end where none can be reached (``distances``).
UNREACHABLE = 1 << 30


@dataclass(frozen=True, slots=True)
class TokenAutomaton:
    """A constraint's automaton over token ids (module docstring). Arrays of int32:
    ``list_start`` [S + 1] into ``list_tokens``/``list_next`` (each state's run sorted by
    token), ``default_next`` [S] and ``mask_at`` [S] (the word offset of a dense
    state's bitmask in ``masks``, else NONE); ``masks`` of uint32 words, one bitmask
    of ``mask_words`` words a dense state."""

    vocab_size: int
    eos: int
    list_start: array[int]
    list_tokens: array[int]
    list_next: array[int]
    default_next: array[int]
    mask_at: array[int]
    masks: array[int]

    @property
    def states(self) -> int:
        return len(self.default_next)

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    @property
    def nbytes(self) -> int:
        return sum(a.itemsize * len(a) for a in (self.list_start, self.list_tokens,
                                                  self.list_next, self.default_next,
                                                  self.mask_at, self.masks))

    def next_state(self, state: int, token: int) -> int | None:
        """Where ``token`` leads from ``state``; None where it is not allowed."""
        lo, hi = self.list_start[state], self.list_start[state + 1]
        while lo < hi:
            mid = (lo + hi) // 2
            if self.list_tokens[mid] < token:
                lo = mid + 1
            else:
                hi = mid
        if lo < self.list_start[state + 1] and self.list_tokens[lo] == token:
            return int(self.list_next[lo])
        at = self.mask_at[state]
        if at != NONE and 0 <= token < self.vocab_size and (
                self.masks[at + token // 32] >> (token % 32)) & 1:
            return int(self.default_next[state])
        return None

    def allowed(self, state: int) -> list[int]:
        """Every token allowed in ``state``, ascending."""
        listed = set(self.list_tokens[self.list_start[state]:self.list_start[state + 1]])
        return sorted(listed.union(self.masked(state)))

    def masked(self, state: int) -> Iterator[int]:
        """The tokens whose bits a dense state's bitmask sets, ascending (none for a
        sparse state)."""
        at = self.mask_at[state]
        if at == NONE:
            return
        for word in range(self.mask_words):
            bits = self.masks[at + word]
            while bits:
                low = bits & -bits
                yield word * 32 + low.bit_length() - 1
                bits ^= low

    def may_end(self, state: int) -> bool:
        return self.next_state(state, self.eos) is not None

    def walk(self, tokens: Iterable[int]) -> int | None:
        """The state after ``tokens`` from the start; None if one is not allowed."""
        state: int | None = 0
        for token in tokens:
            if state is None:
                return None
            state = self.next_state(state, token)
        return state


class CheckedAutomaton:
    """A request's automaton that passed ``decode_automaton``'s checks, and what names it
    (``digest``: its ``automaton_identity`` as it came off a ring): what every sequence
    of one constraint shares on a GPU side (the reference peers' walks, the engine's
    copy in GPU memory). Each state's distance to the end (``distances``, the reference
    walk's) is computed when first asked."""

    def __init__(self, automaton: TokenAutomaton, digest: bytes) -> None:
        self.automaton = automaton
        self.digest = digest

    @classmethod
    def of(cls, automaton: TokenAutomaton) -> CheckedAutomaton:
        """An automaton built here (tests, benchmarks), named by a digest of its arrays."""
        return cls(automaton, hashlib.blake2b(automaton_words(automaton),
                                              digest_size=16).digest())

    @cached_property
    def distance(self) -> array[int]:
        return distances(self.automaton)


def build_automaton(transitions: dict[int, dict[int, int]], initial: int, vocab_size: int,
                    eos: int) -> TokenAutomaton:
    """``TokenAutomaton`` from outlines-core's ``Index.get_transitions()`` (state ->
    {token: next state}, states numbered sparsely), renumbered breadth-first from
    ``initial``; a state is dense where its bitmask is smaller than its list would be."""
    order = [initial]
    number = {initial: 0}
    for state in order:
        for target in sorted(set(transitions.get(state, {}).values())):
            if target not in number:
                number[target] = len(order)
                order.append(target)
    mask_words = (vocab_size + 31) // 32
    list_start, list_tokens, list_next = array("i", [0]), array("i"), array("i")
    default_next, mask_at, masks = array("i"), array("i"), array("I")
    for state in order:
        edges = transitions.get(state, {})
        dense = len(edges) * 2 > mask_words
        # Every pass over a state's edges runs in C (sorted, map, compress, Counter), none
        # in a Python loop: a dense state's are most of the vocabulary (9.8M in all for
        # an open JSON object over Qwen3's), and a bounded string's lists most of its.
        default = NONE
        listed: Iterable[int] = edges
        if dense:
            target = Counter(edges.values()).most_common(1)[0][0]
            default = number[target]
            mask_at.append(len(masks))
            masks.frombytes(_bitmask(edges, mask_words))
            listed = compress(edges, map(target.__ne__, edges.values()))
        else:
            mask_at.append(NONE)
        default_next.append(default)
        tokens = sorted(listed)
        list_tokens.extend(tokens)
        list_next.extend(map(number.__getitem__, map(edges.__getitem__, tokens)))
        list_start.append(len(list_tokens))
    if sys.byteorder != "little":
        masks.byteswap()
    return TokenAutomaton(vocab_size, eos, list_start, list_tokens, list_next, default_next,
                          mask_at, masks)


def _bitmask(tokens: Iterable[int], words: int) -> bytes:
    """The little-endian bitmask of ``words`` 32-bit words with ``tokens``' bits set: a
    flag byte per token (set in C), read as one binary number, lowest token last."""
    flags = bytearray(32 * words)
    deque(map(flags.__setitem__, tokens, repeat(1)), maxlen=0)
    bits = flags.translate(_ASCII_BITS)
    bits.reverse()
    return int(bits, 2).to_bytes(4 * words, "little")


#: A flag byte (0 or 1) to its ASCII digit.
_ASCII_BITS = bytes(range(48, 50)).ljust(256, b"0")


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's structured output on its way to the ring: the encoded automaton (one
    bytes object shared by every request of the constraint) and the request field it
    came from, which an error about it names."""

    automaton: bytes
    param: str = "response_format"


def distances(automaton: TokenAutomaton) -> array[int]:
    """Each state's fewest tokens to a state that may end (0 there), ``UNREACHABLE``
    where none is reachable: the reference peers' walk steers by it."""
    a = automaton
    preds: list[set[int]] = [set() for _ in range(a.states)]
    ends: list[int] = []
    for s in range(a.states):
        successors = set(a.list_next[a.list_start[s]:a.list_start[s + 1]])
        if a.mask_at[s] != NONE:
            successors.add(a.default_next[s])
        for t in successors:
            preds[t].add(s)
        if a.may_end(s):
            ends.append(s)
    dist = array("i", [UNREACHABLE]) * a.states
    for s in ends:
        dist[s] = 0
    queue = deque(ends)
    while queue:
        s = queue.popleft()
        for p in preds[s]:
            if dist[p] == UNREACHABLE:
                dist[p] = dist[s] + 1
                queue.append(p)
    return dist


def shortest_token(automaton: TokenAutomaton, dist: Sequence[int], state: int) -> int | None:
    """The smallest token id, other than the end token, that leads from ``state`` to a
    successor nearest the end; None where no such token leads anywhere nearer than
    unreachable."""
    a = automaton
    best_d, best = UNREACHABLE, None

    def nearer(d: int, token: int) -> bool:
        return d < best_d or (d == best_d and best is not None and token < best)

    lo, hi = a.list_start[state], a.list_start[state + 1]
    listed = a.list_tokens[lo:hi]
    for token, nxt in zip(listed, a.list_next[lo:hi], strict=True):
        if token != a.eos and nearer(dist[nxt], token):
            best_d, best = dist[nxt], token
    if a.mask_at[state] != NONE:
        # The bitmask's smallest token that goes to the default: one not listed.
        skip = {*listed, a.eos}
        first = next((t for t in a.masked(state) if t not in skip), None)
        if first is not None and nearer(dist[a.default_next[state]], first):
            best_d, best = dist[a.default_next[state]], first
    return best if best_d < UNREACHABLE else None


def _words(values: array[int]) -> bytes:
    """An array of 32-bit words as little-endian bytes."""
    if sys.byteorder != "little":
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def automaton_words(automaton: TokenAutomaton) -> bytes:
    """The six arrays as they follow the header on the wire: what a GPU side walks."""
    a = automaton
    return b"".join(_words(x) for x in (a.list_start, a.list_tokens, a.list_next,
                                        a.default_next, a.mask_at, a.masks))


def encode_automaton(automaton: TokenAutomaton, key: int = 0) -> bytes:
    """The automaton's wire form: the header, then its six arrays. ``key`` is the
    constraint's identity (the daemon's cache key, its first 8 bytes): one key, one
    automaton, so a GPU side may keep one copy per key."""
    a = automaton
    dense = len(a.masks) // a.mask_words if a.mask_words else 0
    total = AUTOMATON_HEADER_SIZE + a.nbytes
    if total >= 1 << 32:
        raise ValueError(f"an automaton of {total} bytes does not fit the u32 total_bytes")
    head = AUTOMATON_STRUCT.pack(AUTOMATON_MAGIC, AUTOMATON_HEADER_SIZE, a.vocab_size, a.eos,
                                 a.states, len(a.list_tokens), a.mask_words, dense, total,
                                 key)
    return head + automaton_words(a)


def automaton_identity(header: bytes | memoryview, size: int) -> bytes:
    """What names an encoded automaton on a GPU side: its size as its request gives it
    (``automaton_bytes``) and its header's ``key`` (12 bytes), by the protocol's one key,
    one automaton. A side keeps one checked copy per identity; the bytes of a later
    request of it need not be read."""
    key = AUTOMATON_STRUCT.offset("key")
    return size.to_bytes(4, "little") + bytes(header[key:key + 8])


def automaton_key(data: bytes | memoryview) -> int:
    """The ``key`` of an encoded automaton (unchecked: ``decode_automaton`` checks)."""
    key = AUTOMATON_STRUCT.unpack_from(data, 0)[-1]
    assert isinstance(key, int)
    return key


def decode_automaton(data: bytes | memoryview, vocab_size: int) -> TokenAutomaton:
    """An encoded automaton, every field and word checked against the header and the
    model's ``vocab_size``; a ``ProtocolError`` names the first fault."""
    if len(data) < AUTOMATON_HEADER_SIZE:
        raise ProtocolError(f"automaton of {len(data)} bytes: shorter than its header")
    (magic, header_size, vocab, eos, states, list_len, mask_words, dense, total,
     _key) = AUTOMATON_STRUCT.unpack_from(data, 0)
    if magic != AUTOMATON_MAGIC or header_size != AUTOMATON_HEADER_SIZE:
        raise ProtocolError(f"automaton header: magic {magic!r}, size {header_size}")
    assert isinstance(vocab, int) and isinstance(eos, int) and isinstance(states, int)
    assert isinstance(list_len, int) and isinstance(mask_words, int) and isinstance(dense, int)
    if vocab != vocab_size or mask_words != (vocab + 31) // 32 or not 0 <= eos < vocab:
        raise ProtocolError(f"automaton over a vocabulary of {vocab} (end token {eos}, "
                            f"{mask_words} mask words); the model's has {vocab_size}")
    if states < 1 or dense > states:
        raise ProtocolError(f"automaton of {states} states, {dense} of them dense")
    words = (states + 1) + 2 * list_len + 2 * states + dense * mask_words
    if total != AUTOMATON_HEADER_SIZE + 4 * words or len(data) != total:
        raise ProtocolError(f"automaton of {len(data)} bytes declares {total}, its counts "
                            f"need {AUTOMATON_HEADER_SIZE + 4 * words}")
    body = array("i")
    body.frombytes(bytes(data[AUTOMATON_HEADER_SIZE:]))
    if sys.byteorder != "little":
        body.byteswap()
    parts = []
    at = 0
    for n in (states + 1, list_len, list_len, states, states):
        parts.append(body[at:at + n])
        at += n
    list_start, list_tokens, list_next, default_next, mask_at = parts
    masks = array("I")
    masks.frombytes(body[at:].tobytes())
    _check(vocab, states, list_len, mask_words, dense, list_start, list_tokens, list_next,
           default_next, mask_at, masks)
    return TokenAutomaton(vocab, eos, list_start, list_tokens, list_next, default_next,
                          mask_at, masks)


def _check(vocab: int, states: int, list_len: int, mask_words: int, dense: int,
           list_start: array[int], list_tokens: array[int], list_next: array[int],
           default_next: array[int], mask_at: array[int], masks: array[int]) -> None:
    """Every index within its array, every list sorted, every dense state with its
    own whole bitmask and a default, no bit past the vocabulary."""
    if list_start[0] != 0 or list_start[states] != list_len:
        raise ProtocolError("automaton: the state lists do not cover the list arrays")
    for s in range(states):
        lo, hi = list_start[s], list_start[s + 1]
        if hi < lo:
            raise ProtocolError(f"automaton: state {s}'s list ends before it starts")
        run = list_tokens[lo:hi]
        if run and (run[0] < 0 or run[-1] >= vocab
                    or any(a >= b for a, b in pairwise(run))):
            raise ProtocolError(f"automaton: state {s}'s tokens are not ascending ids "
                                f"below {vocab}")
    if list_len and (min(list_next) < 0 or max(list_next) >= states):
        raise ProtocolError("automaton: a listed next state is out of range")
    offsets = set()
    for s in range(states):
        at, default = mask_at[s], default_next[s]
        if at == NONE:
            if default != NONE:
                raise ProtocolError(f"automaton: sparse state {s} has a default")
            continue
        if at < 0 or at % mask_words or at // mask_words >= dense or at in offsets:
            raise ProtocolError(f"automaton: state {s}'s bitmask at word {at} is not its own")
        if not 0 <= default < states:
            raise ProtocolError(f"automaton: dense state {s}'s default {default} is out of "
                                "range")
        offsets.add(at)
    if len(offsets) != dense:
        raise ProtocolError(f"automaton: {dense} bitmasks, {len(offsets)} used")
    for s in range(states):
        # A state that allows nothing would leave a GPU side's masked logits all -inf.
        at = mask_at[s]
        if list_start[s] == list_start[s + 1] and (
                at == NONE or masks[at:at + mask_words].count(0) == mask_words):
            raise ProtocolError(f"automaton: state {s} allows no token")
    tail = vocab % 32
    if tail:
        spare = ~((1 << tail) - 1) & 0xFFFF_FFFF
        if any(masks[at + mask_words - 1] & spare for at in offsets):
            raise ProtocolError("automaton: a bitmask allows tokens past the vocabulary")
