"""Structured output's constraints, compiled on the DPU into token automata.

A constraint (a JSON schema, any JSON object, a regular expression, a choice among
strings) becomes a regular expression (``outlines-core``'s JSON-schema translation),
then a deterministic automaton over the model's token ids (``outlines-core``'s
``Index``, built against the vocabulary's exact bytes). That automaton is what the
GPU walks: each step masks the logits by the sequence's state, draws, and moves the
state by the drawn token, so nothing waits for the DPU per token.

``TokenAutomaton`` is the walked form, compact enough to travel with a request:

- states are numbered 0..S-1 in breadth-first order from the start, state 0;
- a state holds a sorted list of (token, next state) pairs, and either nothing more
  (a *sparse* state: the list is every allowed token) or a bitmask over the
  vocabulary with a default next state (a *dense* state: the tokens of a JSON
  string's inside, most of the vocabulary, nearly all going to one state; the list
  then holds only the allowed tokens whose next state is not the default);
- token ``t`` is allowed in state ``s`` if it is in the list or its bit is set; its
  next state is the list's where listed, else the default;
- the end token (the model's, one id) is allowed exactly where the constraint's text
  may end, and leads back to the same state.

Compiled automata are cached by the constraint's hash, bounded by count and bytes;
a constraint that does not compile, or whose automaton is larger than allowed, is a
``ConstraintError`` naming the request field, which the HTTP layer answers with 400.
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokenizers import Tokenizer

from dpu_frontend.text.token_bytes import TokenBytes

Kind = Literal["json_object", "json_schema", "regex", "choice"]

#: No list entry: a sparse state's default, and the bitmask offset of a sparse state.
NONE = -1
#: JSON Schema keywords that constrain a value but that outlines-core's translation
#: ignores: refused, never served as if they held.
UNSUPPORTED_KEYWORDS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "uniqueItems", "contains", "minContains", "maxContains", "maxProperties",
    "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
    "unevaluatedProperties", "unevaluatedItems", "contentEncoding", "contentMediaType",
    "not", "if", "then", "else"})
#: Keywords whose value is a subschema, a list of them, or a map of names to them.
_SUBSCHEMA = frozenset({"items", "additionalProperties"})
_SUBSCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SUBSCHEMA_MAPS = frozenset({"properties", "$defs", "definitions"})
#: Characters with a meaning in a regular expression, escaped in a choice's strings.
_REGEX_META = frozenset("\\.+*?()|[]{}^$-&~#")


class ConstraintError(ValueError):
    """A constraint that cannot be served; ``param`` is the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """One request's constraint: its kind and its source text (a schema dumped as
    compact JSON, a regex, the choices as a JSON list), from ``param``."""

    kind: Kind
    source: str
    param: str

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> ConstraintSpec:
        if not isinstance(schema, dict):
            raise ConstraintError("a JSON schema must be an object", param)
        where = _unsupported(schema, "#")
        if where is not None:
            raise ConstraintError(f"the JSON schema keyword at {where} is not supported by "
                                  f"structured output", param)
        # Keys keep their order: an object's properties are written in the schema's.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> ConstraintSpec:
        return cls("json_object", '{"type":"object"}', param)

    @classmethod
    def regex(cls, pattern: str, param: str = "guided_regex") -> ConstraintSpec:
        if not pattern:
            raise ConstraintError("the regular expression is empty", param)
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: Sequence[str], param: str = "guided_choice") -> ConstraintSpec:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ConstraintError("a choice needs one or more non-empty strings", param)
        return cls("choice", json.dumps(list(choices)), param)

    def key(self, eos: int) -> str:
        """The cache's key: the kind, the source and the end token, hashed."""
        return hashlib.sha256(f"{self.kind}\0{eos}\0{self.source}".encode()).hexdigest()

    def pattern(self) -> str:
        """The regular expression the automaton is built from."""
        if self.kind == "regex":
            return self.source
        if self.kind == "choice":
            return "|".join(f"({_escape(c)})" for c in json.loads(self.source))
        from outlines_core.json_schema import build_regex_from_schema

        try:
            return str(build_regex_from_schema(self.source))
        except Exception as exc:  # outlines-core raises plain ValueError/TypeError
            raise ConstraintError(f"the JSON schema cannot be compiled: {exc}",
                                  self.param) from exc


def _unsupported(schema: Any, path: str) -> str | None:
    """The path of the first keyword in ``schema`` that would not be enforced."""
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        at = f"{path}/{key}"
        if key in UNSUPPORTED_KEYWORDS:
            return at
        inner: list[tuple[str, Any]] = []
        if key in _SUBSCHEMA:
            inner = [(at, value)]
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            inner = [(f"{at}/{i}", sub) for i, sub in enumerate(value)]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            inner = [(f"{at}/{name}", sub) for name, sub in value.items()]
        for sub_path, sub in inner:
            found = _unsupported(sub, sub_path)
            if found is not None:
                return found
    return None


def _escape(text: str) -> str:
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)


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
        at = self.mask_at[state]
        if at != NONE:
            for word in range(self.mask_words):
                bits = self.masks[at + word]
                while bits:
                    low = bits & -bits
                    listed.add(word * 32 + low.bit_length() - 1)
                    bits ^= low
        return sorted(listed)

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
        default = NONE
        if dense:
            default = number[Counter(edges.values()).most_common(1)[0][0]]
            words = [0] * mask_words
            for token in edges:
                words[token // 32] |= 1 << (token % 32)
            mask_at.append(len(masks))
            masks.extend(words)
        else:
            mask_at.append(NONE)
        default_next.append(default)
        for token in sorted(edges):
            target = number[edges[token]]
            if not dense or target != default:
                list_tokens.append(token)
                list_next.append(target)
        list_start.append(len(list_tokens))
    return TokenAutomaton(vocab_size, eos, list_start, list_tokens, list_next, default_next,
                          mask_at, masks)


class ConstraintCompiler:
    """Compiles constraints against one tokenizer, and caches the automata: at most
    ``max_entries`` and ``max_cached_bytes`` in all (least recently used go first); an
    automaton over ``max_automaton_bytes`` is refused. Thread-safe: compiling is slow
    (up to seconds for an open-ended schema) and belongs off the event loop."""

    def __init__(self, tokenizer: Tokenizer, eos: int, *, vocab_size: int | None = None,
                 max_entries: int = 64, max_cached_bytes: int = 256 << 20,
                 max_automaton_bytes: int = 32 << 20) -> None:
        self.tokenizer = tokenizer
        self.eos = eos
        self.vocab_size = vocab_size or tokenizer.get_vocab_size()
        self.max_entries = max_entries
        self.max_cached_bytes = max_cached_bytes
        self.max_automaton_bytes = max_automaton_bytes
        self._vocabulary: Any = None
        self._cache: OrderedDict[str, TokenAutomaton] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def vocabulary(self) -> Any:
        """outlines-core's ``Vocabulary``: every token's exact bytes, the special
        (added) tokens left out, the end token apart. Built once."""
        if self._vocabulary is None:
            from outlines_core import Vocabulary

            token_bytes = TokenBytes(self.tokenizer)
            added = set(self.tokenizer.get_added_tokens_decoder())
            by_bytes: dict[bytes, list[int]] = {}
            for token in range(self.vocab_size):
                known = None if token in added else token_bytes.get(token)
                if known is not None and known[1]:
                    by_bytes.setdefault(known[1], []).append(token)
            self._vocabulary = Vocabulary(self.eos, by_bytes)
        return self._vocabulary

    def compile(self, spec: ConstraintSpec) -> TokenAutomaton:
        key = spec.key(self.eos)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        automaton = self._build(spec)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = automaton
                self._cached_bytes += automaton.nbytes
                while self._cache and (len(self._cache) > self.max_entries
                                       or self._cached_bytes > self.max_cached_bytes):
                    _, dropped = self._cache.popitem(last=False)
                    self._cached_bytes -= dropped.nbytes
        return automaton

    def cached(self) -> tuple[int, int]:
        """(automata, bytes) in the cache."""
        with self._lock:
            return len(self._cache), self._cached_bytes

    def _build(self, spec: ConstraintSpec) -> TokenAutomaton:
        from outlines_core import Index

        pattern = spec.pattern()
        try:
            index = Index(pattern, self.vocabulary())
        except Exception as exc:  # outlines-core raises plain ValueError
            raise ConstraintError(f"the constraint cannot be compiled: {exc}",
                                  spec.param) from exc
        automaton = build_automaton(index.get_transitions(), index.get_initial_state(),
                                    self.vocab_size, self.eos)
        if automaton.nbytes > self.max_automaton_bytes:
            raise ConstraintError(
                f"the constraint's automaton takes {automaton.nbytes} bytes, more than "
                f"the {self.max_automaton_bytes} allowed ({automaton.states} states)",
                spec.param)
        return automaton
