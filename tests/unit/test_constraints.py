"""Structured output's compiler (``text.constraints``): the automaton's form on
hand-written transitions, then real constraints against the bundled Qwen3 tokenizer,
walked at random (seeded) through the automaton's own allowed tokens; every text a walk
ends on must satisfy the constraint."""

from __future__ import annotations

import json
import os
import random
import re
import threading
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from dpu_frontend.ring.automaton import (
    NONE,
    TokenAutomaton,
    automaton_key,
    build_automaton,
    decode_automaton,
)
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.chat_output import ChatOutputs
from dpu_frontend.text.constraints import (
    CompilerProcess,
    ConstraintCompiler,
    ConstraintError,
    ConstraintSpec,
    ToolSyntax,
)
from dpu_frontend.text.token_bytes import TokenBytes
from tests.constraint_cases import PERSON


def test_states_are_numbered_from_the_start_and_dense_ones_keep_a_bitmask() -> None:
    # Vocabulary of 256 (8 mask words): state 7 allows 40 tokens (dense: 40 list pairs
    # would be 80 words), 30 of them to state 9, 10 to state 8; 9 and 8 are sparse.
    transitions = {7: {t: 9 for t in range(30)} | {t: 8 for t in range(30, 40)},
                   9: {255: 9, 50: 8}, 8: {255: 8}}
    a = build_automaton(transitions, 7, vocab_size=256, eos=255)
    assert a.states == 3 and a.default_next[1] == NONE  # 7 -> 0, 8 -> 1, 9 -> 2
    assert a.mask_at[0] == 0 and a.default_next[0] == 2 and a.mask_at[1] == NONE
    # Dense state: only the exceptions (to state 8) are listed.
    assert list(a.list_tokens[a.list_start[0]:a.list_start[1]]) == list(range(30, 40))
    assert a.next_state(0, 3) == 2 and a.next_state(0, 35) == 1 and a.next_state(0, 45) is None
    assert a.allowed(0) == list(range(40)) and a.allowed(2) == [50, 255]
    assert a.next_state(2, 50) == 1 and a.next_state(2, 49) is None
    assert not a.may_end(0) and a.may_end(1) and a.may_end(2)
    assert a.walk([5, 50]) == 1 and a.walk([5, 5]) is None
    assert a.nbytes == 4 * (4 + 13 + 13 + 3 + 3 + 8)


@pytest.fixture(scope="module")
def compiler() -> ConstraintCompiler:
    tokenizer = Tokenizer.from_file(str(default_tokenizer_dir() / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|im_end|>")
    assert eos is not None
    return ConstraintCompiler(tokenizer, eos)


def walks(automaton: TokenAutomaton, compiler: ConstraintCompiler, count: int,
          seed: int, limit: int = 200) -> list[str]:
    """Texts of ``count`` random walks: each step draws among the allowed tokens, the
    end token with probability 1/2 where allowed; a walk past ``limit`` tokens is cut."""
    rng = random.Random(seed)
    token_bytes = TokenBytes(compiler.tokenizer)
    texts = []
    for _ in range(count):
        state, raw = 0, b""
        for _ in range(limit):
            if automaton.may_end(state) and rng.random() < 0.5:
                break
            options = [t for t in automaton.allowed(state) if t != automaton.eos]
            if not options:
                break
            token = rng.choice(options)
            next_state = automaton.next_state(state, token)
            assert next_state is not None
            known = token_bytes.get(token)
            assert known is not None
            state, raw = next_state, raw + known[1]
        else:
            continue
        assert automaton.may_end(state)
        texts.append(raw.decode())
    return texts


def test_a_json_schema_admits_only_valid_objects(compiler: ConstraintCompiler) -> None:
    automaton = compiler.compile(ConstraintSpec.json_schema(PERSON))
    texts = walks(automaton, compiler, 16, seed=1)
    assert len(texts) >= 8
    for text in texts:
        value = json.loads(text)
        assert set(value) >= {"name", "age", "role"} and set(value) <= set(PERSON["properties"])
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert isinstance(value["age"], int)
        assert value["role"] in ("admin", "user")
        assert len(value.get("tags", [])) <= 2
    # Nothing but the object's opening may start it.
    encoded = compiler.tokenizer.encode("hello", add_special_tokens=False).ids
    assert automaton.next_state(0, encoded[0]) is None
    assert automaton.walk(compiler.tokenizer.encode('{"name"', add_special_tokens=False).ids)


def test_a_regex_and_a_choice(compiler: ConstraintCompiler) -> None:
    pattern = r"[0-9]{3}-[a-z]{1,5}"
    automaton = compiler.compile(ConstraintSpec.regex(pattern))
    texts = walks(automaton, compiler, 30, seed=2)
    assert texts and all(re.fullmatch(pattern, t) for t in texts)
    choices = ["yes", "no", "maybe so (a+b)?"]
    automaton = compiler.compile(ConstraintSpec.choice(choices))
    texts = walks(automaton, compiler, 30, seed=3)
    assert set(texts) <= set(choices) and len(set(texts)) == 3


def test_bad_constraints_name_their_field(compiler: ConstraintCompiler) -> None:
    with pytest.raises(ConstraintError) as bad_regex:
        compiler.compile(ConstraintSpec.regex("(unclosed"))
    assert bad_regex.value.param == "guided_regex"
    with pytest.raises(ConstraintError) as bad_schema:
        compiler.compile(ConstraintSpec.json_schema({"type": "frobnicate"}))
    assert bad_schema.value.param == "response_format"
    with pytest.raises(ConstraintError):
        ConstraintSpec.json_schema(["not", "an", "object"])
    # Keywords the compiler would not enforce are refused, wherever they are; a property
    # named like one is a name.
    nested = {"type": "object", "properties": {"n": {"anyOf": [{"type": "integer",
                                                              "minimum": 0}]}}}
    with pytest.raises(ConstraintError, match="#/properties/n/anyOf/0/minimum"):
        ConstraintSpec.json_schema(nested)
    ConstraintSpec.json_schema({"type": "object", "properties": {"minimum": {"type": "integer"}}})
    with pytest.raises(ConstraintError):
        ConstraintSpec.choice([])
    small = ConstraintCompiler(compiler.tokenizer, compiler.eos, max_automaton_bytes=1000)
    small._vocabulary = compiler.vocabulary()
    with pytest.raises(ConstraintError, match="bytes, more than the 1000 allowed") as large:
        small.compile(ConstraintSpec.json_schema({"type": "string"}))
    assert large.value.param == "response_format"


def test_the_cache_keeps_the_most_recent_within_its_bounds(
        compiler: ConstraintCompiler) -> None:
    cache = ConstraintCompiler(compiler.tokenizer, compiler.eos, max_entries=2)
    cache._vocabulary = compiler.vocabulary()  # one build of the vocabulary suffices
    first = cache.compile(ConstraintSpec.regex("a+"))
    assert cache.compile(ConstraintSpec.regex("a+")) is first
    cache.compile(ConstraintSpec.regex("b+"))
    cache.compile(ConstraintSpec.regex("a+"))  # a+ is now the most recent
    cache.compile(ConstraintSpec.regex("c+"))  # b+ goes
    count, size = cache.cached()
    last = cache.compile(ConstraintSpec.regex("c+"))
    # Each entry holds the automaton's arrays and its wire form (a 64-byte header more).
    assert count == 2 and size == 2 * (first.nbytes + last.nbytes) + 2 * 64
    assert cache.encoded(ConstraintSpec.regex("c+")) is cache.encoded(ConstraintSpec.regex("c+"))
    assert cache.compile(ConstraintSpec.regex("a+")) is first
    # Properties are written in the schema's order: another order is another constraint.
    assert (ConstraintSpec.json_schema({"a": 1, "b": 2}).key(1)
            != ConstraintSpec.json_schema({"b": 2, "a": 1}).key(1))


def test_a_compiled_automaton_travels_whole(compiler: ConstraintCompiler) -> None:
    spec = ConstraintSpec.json_schema(PERSON)
    encoded = compiler.encoded(spec)
    assert decode_automaton(encoded, compiler.vocab_size) == compiler.compile(spec)
    assert automaton_key(encoded) == int(spec.key(compiler.eos)[:16], 16)


def test_the_compiler_process_bounds_each_compile_in_time() -> None:
    """The daemon's compiler: a child process, its automata cached in the daemon; one
    that takes too long is a ConstraintError, and the next compile gets a new child."""
    tokenizer = default_tokenizer_dir() / "tokenizer.json"
    loaded = Tokenizer.from_file(str(tokenizer))
    eos = loaded.token_to_id("<|im_end|>")
    assert eos is not None
    process = CompilerProcess(tokenizer, eos, vocab_size=loaded.get_vocab_size(), timeout_s=60)
    try:
        choice = ConstraintSpec.choice(["red", "green"])
        encoded = process.encoded(choice)
        assert process.encoded(choice) is encoded and process.compiles == 1
        assert decode_automaton(encoded, process.vocab_size).walk(
            loaded.encode("green").ids) is not None
        with pytest.raises(ConstraintError, match="cannot be compiled") as bad:
            process.encoded(ConstraintSpec.regex("(unclosed"))
        assert bad.value.param == "guided_regex"
        process.timeout_s = 0.001
        with pytest.raises(ConstraintError, match=r"did not compile within 0\.001 s"):
            process.encoded(ConstraintSpec.regex("[a-z]{1,30}"))
        assert process.kills == 1
        process.timeout_s = 60
        assert process.encoded(ConstraintSpec.regex("[0-9]{2}"))  # a new child
        assert process.cached()[0] == 2
    finally:
        process.close()


def test_closing_the_compiler_ends_a_start_that_waits_on_its_child(tmp_path: Path) -> None:
    """A daemon that stops while its compiler's child is still starting (a slow Arm core,
    the micro-VM) does not wait for the start: ``close`` kills the child and the start
    ends in a ConstraintError; nothing starts after. The child here never starts: its
    tokenizer file is a FIFO that nobody writes."""
    never = tmp_path / "tokenizer.json"
    os.mkfifo(never)
    process = CompilerProcess(never, 0, vocab_size=16)
    errors: list[Exception] = []

    def start() -> None:
        try:
            process.start()
        except Exception as exc:  # handed to the test's thread
            errors.append(exc)

    starting = threading.Thread(target=start)
    starting.start()
    for _ in range(3000):  # until the child is spawned and the start waits on it
        if process.running or not starting.is_alive():
            break
        starting.join(0.01)
    assert process.running, errors
    process.close()
    starting.join(30)
    assert not starting.is_alive() and not process.running
    [error] = errors
    assert isinstance(error, ConstraintError) and "closed" in str(error)
    with pytest.raises(ConstraintError, match="closed"):
        process.encoded(ConstraintSpec.choice(["red", "green"]))


@pytest.mark.parametrize("syntax", ["hermes", "llama3_json"])
def test_a_forced_tool_call_admits_only_calls_the_parser_reads(
        compiler: ConstraintCompiler, syntax: ToolSyntax) -> None:
    """tool_choice required over two tools, parallel: every walk is one call or more, in
    the syntax the chat output's parser reads, each of a given function with arguments
    within its schema (none for a function without parameters)."""
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
               "required": ["city"]}
    spec = ConstraintSpec.tool_calls(syntax, [("get_weather", weather), ("get_time", None)],
                                     parallel=True)
    texts = walks(compiler.compile(spec), compiler, 12, seed=4, limit=120)
    assert len(texts) >= 4
    for text in texts:
        outputs = ChatOutputs(reasoning=False, tools=True, thinking=False, syntax=syntax)
        piece = outputs.feed(0, text, final=True)
        assert piece.tool_calls and not piece.content.strip(), text
        for call in piece.tool_calls:
            arguments = json.loads(call.arguments)
            assert (call.name, set(arguments)) in (("get_weather", {"city"}),
                                                   ("get_time", set())), text
    with pytest.raises(ConstraintError, match="#/minimum") as refused:
        ConstraintSpec.tool_calls("hermes", [("f", {"type": "integer", "minimum": 0})], False)
    assert refused.value.param == "tools"
