"""Structured output's constraints, compiled on the DPU into token automata.

A constraint (a JSON schema, any JSON object, a regular expression, a choice among
strings) becomes a regular expression (``outlines-core``'s JSON-schema translation),
then a deterministic automaton over the model's token ids (``outlines-core``'s
``Index``, built against the vocabulary's exact bytes). That automaton is what the
GPU walks: each step masks the logits by the sequence's state, draws, and moves the
state by the drawn token, so nothing waits for the DPU per token.

The automaton and its wire form are ``ring.automaton``'s.

Compiled automata are cached by the constraint's hash, bounded by count and bytes;
a constraint that does not compile, or whose automaton is larger than allowed, is a
``ConstraintError`` naming the request field, which the HTTP layer answers with 400.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from tokenizers import Tokenizer

from dpu_frontend.ring.automaton import TokenAutomaton, build_automaton, encode_automaton
from dpu_frontend.ring.layout import AUTOMATON_HEADER_SIZE
from dpu_frontend.text.token_bytes import TokenBytes

Kind = Literal["json_object", "json_schema", "regex", "choice", "tool_calls"]
#: A tool call's syntax, as the chat output's parser reads it (``chat_output``).
ToolSyntax = Literal["hermes", "llama3_json"]
#: No parameters: the function takes none (OpenAI's rule), an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

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

    @classmethod
    def tool_calls(cls, syntax: ToolSyntax, tools: Sequence[tuple[str, dict[str, Any] | None]],
                   parallel: bool, param: str = "tool_choice") -> ConstraintSpec:
        """An answer that is one or more calls (one where not ``parallel``) of ``tools``
        ((name, parameters' schema) pairs), in ``syntax``: hermes' ``<tool_call>`` blocks
        with ``arguments``, or Llama 3.1's JSON objects with ``parameters``, separated by
        ``;``. The schemas are checked as ``json_schema``'s, naming ``tools``."""
        if not tools:
            raise ConstraintError("a forced tool call needs tools", param)
        for name, schema in tools:
            where = None if schema is None else _unsupported(schema, "#")
            if where is not None:
                raise ConstraintError(f"tool {name}'s parameters use the JSON schema keyword "
                                      f"at {where}, which structured output does not "
                                      "support", "tools")
        return cls("tool_calls", json.dumps({"syntax": syntax, "parallel": parallel,
                                            "tools": [list(t) for t in tools]},
                                           separators=(",", ":")), param)

    def key(self, eos: int) -> str:
        """The cache's key: the kind, the source and the end token, hashed."""
        return hashlib.sha256(f"{self.kind}\0{eos}\0{self.source}".encode()).hexdigest()

    def pattern(self) -> str:
        """The regular expression the automaton is built from. A regex matches the whole
        answer: a ``^`` at its start and a ``$`` at its end say nothing more, and
        outlines-core refuses anchors, so they go."""
        if self.kind == "regex":
            return _unanchored(self.source)
        if self.kind == "choice":
            return "|".join(f"({_escape(c)})" for c in json.loads(self.source))
        if self.kind == "tool_calls":
            return self._calls_pattern()
        return _schema_regex(self.source, self.param)

    def _calls_pattern(self) -> str:
        """One call of any of the tools, each call's text as the chat output's parser
        reads it (the name as written, the arguments within their schema); then, where
        parallel, more after the syntax's separator."""
        spec = json.loads(self.source)
        hermes = spec["syntax"] == "hermes"
        calls = []
        for name, schema in spec["tools"]:
            arguments = _schema_regex(json.dumps(NO_PARAMETERS if schema is None else schema),
                                      "tools")
            head = (f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ' if hermes
                    else f'{{"name": {json.dumps(name)}, "parameters": ')
            tail = "}\n</tool_call>" if hermes else "}"
            calls.append(f"{_escape(head)}({arguments}){_escape(tail)}")
        one = "(" + "|".join(f"({c})" for c in calls) + ")"
        if not spec["parallel"]:
            return one
        return f"{one}({_escape(chr(10) if hermes else '; ')}{one})*"


def _schema_regex(schema: str, param: str) -> str:
    """outlines-core's regular expression for a JSON schema (its text)."""
    from outlines_core.json_schema import build_regex_from_schema

    try:
        return str(build_regex_from_schema(schema))
    except Exception as exc:  # outlines-core raises plain ValueError/TypeError
        raise ConstraintError(f"the JSON schema cannot be compiled: {exc}", param) from exc


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


def _unanchored(pattern: str) -> str:
    """``pattern`` less one leading ``^`` and one trailing unescaped ``$``."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$"):
        body = pattern[:-1]
        if (len(body) - len(body.rstrip("\\"))) % 2 == 0:  # not an escaped "\$"
            pattern = body
    return pattern


def _escape(text: str) -> str:
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)


def key_bits(key: str) -> int:
    """A constraint's cache key as the automaton's 64-bit ``key`` (its first 16 digits)."""
    return int(key[:16], 16)


V = TypeVar("V")


class Lru(Generic[V]):
    """At most ``max_entries`` values and ``max_bytes`` of them (``size`` says a value's),
    the least recently used going first. Thread-safe."""

    def __init__(self, max_entries: int, max_bytes: int, size: Callable[[V], int]) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._size = size
        self._items: OrderedDict[str, V] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: str, value: V) -> V:
        """Keep ``value`` (unless one came meanwhile: that one stays, and is returned)."""
        with self._lock:
            kept = self._items.get(key)
            if kept is not None:
                return kept
            self._items[key] = value
            self._bytes += self._size(value)
            while self._items and (len(self._items) > self.max_entries
                                   or self._bytes > self.max_bytes):
                _, dropped = self._items.popitem(last=False)
                self._bytes -= self._size(dropped)
            return value

    def usage(self) -> tuple[int, int]:
        """(values, bytes) kept."""
        with self._lock:
            return len(self._items), self._bytes


class Compiled(NamedTuple):
    """A compiled constraint: its automaton, and that automaton's wire form."""

    automaton: TokenAutomaton
    encoded: bytes

    def size(self) -> int:
        return self.automaton.nbytes + len(self.encoded)


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
        self.max_automaton_bytes = max_automaton_bytes
        self._vocabulary: Any = None
        self._cache: Lru[Compiled] = Lru(max_entries, max_cached_bytes, Compiled.size)

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
        """The constraint's automaton (compiled once, then from the cache)."""
        return self._compiled(spec).automaton

    def encoded(self, spec: ConstraintSpec) -> bytes:
        """The automaton's wire form (``ring.automaton``), keyed by the constraint: one
        bytes object that every request of that constraint shares while it is cached."""
        return self._compiled(spec).encoded

    def _compiled(self, spec: ConstraintSpec) -> Compiled:
        key = spec.key(self.eos)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        automaton = self._build(spec)
        return self._cache.put(key, Compiled(automaton, encode_automaton(automaton,
                                                                         key_bits(key))))

    def cached(self) -> tuple[int, int]:
        """(automata, bytes) in the cache: each automaton's arrays and its wire form."""
        return self._cache.usage()

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
        # Measured as it travels (its header too), as the peers' bound is.
        wire_bytes = AUTOMATON_HEADER_SIZE + automaton.nbytes
        if wire_bytes > self.max_automaton_bytes:
            raise ConstraintError(
                f"the constraint's automaton takes {wire_bytes} bytes, more than "
                f"the {self.max_automaton_bytes} allowed ({automaton.states} states)",
                spec.param)
        return automaton


#: Seconds the compiler's process gets to start and build its vocabulary.
COMPILER_START_S = 120.0
#: How often a wait on the child looks whether ``close`` was called meanwhile: a daemon
#: that stops while its compiler starts or compiles does not wait for either.
CLOSE_POLL_S = 0.05


class CompilerProcess:
    """The daemon's compiler: a ``ConstraintCompiler`` in a child process of its own, one
    compile at a time, each bounded by ``timeout_s``. A constraint that takes longer (a
    pathological regex, an open-ended schema over a large vocabulary) is a
    ``ConstraintError``, and the child is killed and started again on the next one:
    no compile can hold the daemon's CPU or memory for long. The encoded automata are
    cached here, in the daemon, by the constraint's hash within ``max_entries`` and
    ``max_cached_bytes``. Thread-safe; each call blocks: run it off the event loop.
    ``close`` kills the child at once, also while a start or a compile waits on it (that
    call is then a ``ConstraintError``), and no child starts after it."""

    def __init__(self, tokenizer_file: Path, eos: int, *, vocab_size: int,
                 max_entries: int = 64, max_cached_bytes: int = 512 << 20,
                 max_automaton_bytes: int = 32 << 20, timeout_s: float = 20.0) -> None:
        self.tokenizer_file = tokenizer_file
        self.eos = eos
        self.vocab_size = vocab_size
        self.max_automaton_bytes = max_automaton_bytes
        self.timeout_s = timeout_s
        self.compiles = 0  # constraints compiled (cache misses that succeeded)
        self.kills = 0  # children killed for taking too long
        self._cache: Lru[bytes] = Lru(max_entries, max_cached_bytes, len)
        self._lock = threading.Lock()  # one compile at a time, in the one child
        self._child: Any = None  # multiprocessing's Process
        self._conn: Any = None  # its end of the pipe
        self._closed = threading.Event()  # set by close(), seen by every wait

    def encoded(self, spec: ConstraintSpec) -> bytes:
        """The constraint's automaton in its wire form, from the cache or compiled."""
        key = spec.key(self.eos)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                return cached
            conn = self._started(spec.param)
            conn.send((spec.kind, spec.source, spec.param))
            if not self._answered(conn, self.timeout_s, spec.param):
                self.kills += 1
                self._stop()
                raise ConstraintError(f"the constraint did not compile within "
                                      f"{self.timeout_s:g} s", spec.param)
            try:
                ok, payload = conn.recv()
            except (EOFError, OSError) as exc:  # the child died (out of memory, a crash)
                self._stop()
                raise ConstraintError("the constraint compiler stopped while compiling it",
                                      spec.param) from exc
        if not ok:
            raise ConstraintError(str(payload), spec.param)
        self.compiles += 1
        return self._cache.put(key, payload)

    def cached(self) -> tuple[int, int]:
        """(automata, bytes) in the cache."""
        return self._cache.usage()

    def start(self) -> None:
        """Start the child now, with its vocabulary, rather than on the first compile;
        a ``ConstraintError`` if it cannot be."""
        with self._lock:
            self._started("response_format")

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def running(self) -> bool:
        return self._child is not None and self._child.is_alive()

    def _started(self, param: str) -> Any:
        if self.running:
            return self._conn
        self._stop()
        if self._closed.is_set():
            raise ConstraintError("the constraint compiler is closed: the daemon is stopping",
                                  param)
        context = multiprocessing.get_context("spawn")  # no fork of a threaded daemon
        ours, theirs = context.Pipe()
        child = context.Process(target=_compile_loop, name="dpu-frontend-constraints",
                                args=(theirs, str(self.tokenizer_file), self.eos,
                                      self.vocab_size, self.max_automaton_bytes), daemon=True)
        child.start()
        theirs.close()
        self._child, self._conn = child, ours
        if not self._answered(ours, COMPILER_START_S, param):
            self._stop()
            raise ConstraintError("the constraint compiler did not start", param)
        try:
            ours.recv()  # ready: its vocabulary is built
        except (EOFError, OSError) as exc:
            self._stop()
            raise ConstraintError("the constraint compiler failed to start", param) from exc
        return ours

    def _answered(self, conn: Any, seconds: float, param: str) -> bool:
        """Whether the child has answered on ``conn`` within ``seconds``. Waits in slices
        of ``CLOSE_POLL_S``: once ``close`` is called, the child is stopped and the wait
        ends in a ``ConstraintError``."""
        deadline = time.monotonic() + seconds
        while not self._closed.is_set():
            left = deadline - time.monotonic()
            if conn.poll(max(0.0, min(CLOSE_POLL_S, left))):
                return True
            if left <= 0:
                return False
        self._stop()
        raise ConstraintError("the constraint compiler was closed: the daemon is stopping",
                              param)

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join()
            self._conn.close()
        self._child = self._conn = None

    def close(self) -> None:
        # The flag first: a start or a compile that holds the lock sees it within
        # CLOSE_POLL_S, stops the child and lets go.
        self._closed.set()
        with self._lock:
            self._stop()


def _compile_loop(conn: Any, tokenizer_file: str, eos: int, vocab_size: int,
                  max_automaton_bytes: int) -> None:
    """The compiler process: build the vocabulary, say so, then answer each constraint
    with (True, its encoded automaton) or (False, why it does not compile)."""
    compiler = ConstraintCompiler(Tokenizer.from_file(tokenizer_file), eos,
                                  vocab_size=vocab_size, max_entries=0, max_cached_bytes=0,
                                  max_automaton_bytes=max_automaton_bytes)
    compiler.vocabulary()
    conn.send(True)
    while True:
        try:
            kind, source, param = conn.recv()
        except (EOFError, OSError):
            return  # the daemon went away
        try:
            conn.send((True, compiler.encoded(ConstraintSpec(kind, source, param))))
        except ConstraintError as exc:
            conn.send((False, str(exc)))
        except Exception as exc:  # anything else outlines-core raises on odd input
            conn.send((False, f"the constraint cannot be compiled: {exc}"))
