"""Structured output through a real daemon and the reference peer (shm), with the
official openai SDK and its own helpers: ``chat.completions.parse`` with a pydantic
model, ``chat.completions.stream``, ``response_format`` (json_schema, json_object) and
vLLM's ``guided_regex`` and ``guided_choice``.

The daemon compiles each constraint into a token automaton (in its compiler process),
which travels with the request through the ring's arena (protocol v2.2); the peer
walks it: its replay's tokens where the automaton allows them and the end stays in
reach, else the tokens nearest the end. So every answer, streamed or not, is a text
the constraint accepts, and each is checked against it here. Then what is refused, each
with a 400 naming the field: two constraints at once, a schema
keyword that would not be enforced, a regex that does not compile, an automaton
larger than allowed, a compile that takes too long, and a peer whose ring takes no
automaton."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, Literal

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.constraint_cases import ORDER, PERSON, satisfies_order, satisfies_person
from tests.integration.scenarios import check_constrained_equals_the_reference
from tests.stack import MODEL, Stack, running_stack

ASK: Any = [{"role": "user", "content": "Describe someone."}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int
    role: Literal["admin", "user"]
    tags: list[str] = Field(max_length=2)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    # A compile bound far above any of these constraints' (json_object's is the longest).
    with running_stack("shm", timeout=120, serve_args=(
            "--constraint-compile-timeout", "300", "--reasoning-parser", "qwen3")) as s:
        yield s


@pytest.fixture
def client(stack: Stack) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def schema_format(name: str, schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def test_parse_gives_the_pydantic_model(client: OpenAI) -> None:
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=200,
                                               response_format=Person)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_the_stream_helper_parses_the_same_answer(client: OpenAI) -> None:
    with client.chat.completions.stream(model=MODEL, messages=ASK, max_tokens=200,
                                        response_format=Person) as stream:
        final = stream.get_final_completion()
    whole = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=200,
                                          response_format=Person)
    assert final.choices[0].message.parsed == whole.choices[0].message.parsed


@pytest.mark.parametrize(("name", "schema", "satisfied"), [
    ("person", PERSON, satisfies_person), ("order", ORDER, satisfies_order)])
def test_a_json_schema_streamed_and_not(client: OpenAI, name: str, schema: dict[str, Any],
                                        satisfied: Callable[[Any], bool]) -> None:
    """Nested objects, enums, bounded strings and arrays, a string pattern, anyOf."""
    fmt = schema_format(name, schema)
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300,
                                           response_format=fmt)
    text = whole.choices[0].message.content or ""
    assert whole.choices[0].finish_reason == "stop" and satisfied(json.loads(text)), text
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_any_json_object(client: OpenAI) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100,
                                                response_format={"type": "json_object"})
    assert isinstance(json.loads(completion.choices[0].message.content or ""), dict)


async def test_a_constrained_answer_through_the_async_sdk(stack: Stack) -> None:
    """The scenario the soft-RoCE suite runs too (tests/rdma)."""
    await check_constrained_equals_the_reference(stack)


def test_a_regex_and_a_choice(client: OpenAI) -> None:
    regex = client.completions.create(model=MODEL, prompt="An id:", max_tokens=20,
                                      extra_body={"guided_regex": "[A-Z]{2}-[0-9]{4}"})
    assert regex.choices[0].finish_reason == "stop"
    assert len(regex.choices[0].text) == 7 and regex.choices[0].text[2] == "-"
    colours = ["red", "green", "blue"]
    chosen = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20,
                                            extra_body={"guided_choice": colours})
    assert chosen.choices[0].message.content in colours
    # ignore_eos does not keep a constrained answer going: it ends where the text does.
    ended = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20,
                                           extra_body={"guided_choice": colours,
                                                       "ignore_eos": True})
    assert ended.choices[0].message.content in colours
    assert ended.choices[0].finish_reason == "stop"


REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "one constraint at a time"),
    ({"response_format": schema_format("n", {"type": "integer", "minimum": 3})},
     "response_format", "#/minimum is not supported"),
    ({"guided_json": {"properties": {"a": {"not": {}}}}}, "guided_json",
     "#/properties/a/not"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "cannot be compiled"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
]


@pytest.mark.parametrize(("extra", "param", "message"), REFUSED,
                         ids=[r[1] + "-" + r[2].split()[0] for r in REFUSED])
def test_what_cannot_be_served_is_a_400_naming_its_field(
        client: OpenAI, extra: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20,
                                       extra_body=extra)
    body: Any = refused.value.body
    assert body["param"] == param and message in body["message"], body


def test_limits_on_the_automaton_and_the_compile() -> None:
    """An automaton over the daemon's bound, and a compile over its time (the compiler's
    process is then killed, and the next constraint gets a new one). The small regex
    compiles in 0.1 s to 460 KB; the long one, 20,000 states, would take minutes (Qwen3's
    vocabulary: 1.8 s for 200 states on a development machine): a bound of 3 s tells them
    apart on a loaded machine and on a fast one. (With 1 s, [a-z]{1,30}, 0.4 s alone,
    missed it in the clean-clone CI of 2026-12-01; ORDER, 9 s on a CI core, compiled
    within 3 s on a quiet development machine on 2026-12-02.)"""
    with running_stack("shm", timeout=120, serve_args=(
            "--max-automaton-bytes", "100000", "--constraint-compile-timeout", "3")) as s, \
            OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="more than the 100000 allowed"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                      extra_body={"guided_regex": "[a-z]{1,8}"})
        with pytest.raises(openai.BadRequestError, match="did not compile within 3 s"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                      extra_body={"guided_regex": "[a-z]{1,20000}"})
        yes = client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                        extra_body={"guided_choice": ["yes"]})
        assert yes.choices[0].text == "yes"


def test_a_peer_whose_ring_takes_no_automaton() -> None:
    with running_stack("shm", timeout=120, peer_args=("--max-automaton-bytes", "0")) as s, \
            OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                           response_format={"type": "json_object"})
        body: Any = refused.value.body
        assert body["param"] == "response_format" and body["code"] == "unsupported_parameter"
        assert "does not decode structured output" in body["message"] or (
            "do not decode structured output" in body["message"])
        plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5)
        assert plain.choices[0].message.content


def test_the_wait_for_each_automaton_is_a_metric(client: OpenAI, stack: Stack) -> None:
    client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                              extra_body={"guided_choice": ["yes", "no"]})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                  extra_body={"guided_regex": "(unclosed"})
    with urllib.request.urlopen(f"{stack.base_url}/metrics") as response:
        text = response.read().decode()
    for param, outcome in (("guided_choice", "ready"), ("guided_regex", "refused")):
        count = re.search(rf'dpu_frontend_constraint_seconds_count\{{outcome="{outcome}",'
                          rf'param="{param}"\}} (\S+)', text)
        assert count is not None and float(count.group(1)) >= 1, (param, outcome)
