"""Tool calls and reasoning through a real daemon (shm), with the official openai SDK and
its own helpers (``chat.completions.create`` streamed and not, ``chat.completions.stream``),
and forced calls (``tool_choice`` required or named), decoded within the calls' syntax.

The peer echoes its prompt, and the daemon's chat template here renders the last
message's text as it is: so the "model" answers with exactly the text a test sends,
and each test says what a model's answer looks like (Qwen3's <think> block, Hermes'
<tool_call> blocks) and checks what the SDK makes of it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.stack import MODEL, Stack, running_stack

#: The answer is the last message's text: the echo peer sends it back.
VERBATIM = "{{ messages[-1]['content'] }}"
TOOLS: Any = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
THINKING = "<think>\nThe user wants the weather.\n</think>\n\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    template = tmp_path_factory.mktemp("template") / "verbatim.jinja"
    template.write_text(VERBATIM)
    # The compile bound under the test's own (120 s): tool_choice="required" (every
    # function's calls in one automaton) passed the default 20 s in the clean-clone CI
    # of 2026-12-01 on a 2-core machine, a 400 where the test wants calls.
    with running_stack("shm", mode="echo", timeout=120, serve_args=(
            "--chat-template", str(template), "--reasoning-parser", "qwen3",
            "--tool-call-parser", "hermes", "--constraint-compile-timeout", "100")) as s:
        yield s


@pytest.fixture
def client(stack: Stack) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def ask(text: str) -> Any:
    return [{"role": "user", "content": text}]


def test_a_tool_call_with_reasoning(client: OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=ask(THINKING + CALL),
                                          tools=TOOLS)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content is None
    assert (message.model_extra or {})["reasoning_content"] == "The user wants the weather.\n"
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_calls_add_up_to_the_unstreamed_answer(client: OpenAI) -> None:
    """Deltas carry each call's index, id and name once, then its arguments; the SDK's
    stream helper assembles the same message as the unstreamed answer."""
    text = THINKING + "Let me look.\n" + CALL + "\n" + TIME_CALL
    full = client.chat.completions.create(model=MODEL, messages=ask(text), tools=TOOLS)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask(text), tools=TOOLS,
                                                 stream=True))
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict[str, str]] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                assert not entry["id"], "a call's id comes once"
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
    message = full.choices[0].message
    assert reasoning == (message.model_extra or {})["reasoning_content"]
    assert content == message.content == "Let me look.\n"
    assert message.tool_calls is not None
    assert [(calls[k]["name"], json.loads(calls[k]["arguments"])) for k in sorted(calls)] == [
        (t.function.name, json.loads(t.function.arguments))  # type: ignore[union-attr]
        for t in message.tool_calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    with client.chat.completions.stream(model=MODEL, messages=ask(text), tools=TOOLS) as stream:
        final = stream.get_final_completion()
    assembled = final.choices[0].message
    assert assembled.tool_calls is not None
    assert [(t.function.name, t.function.arguments) for t in assembled.tool_calls] == [
        (t.function.name, t.function.arguments)  # type: ignore[union-attr]
        for t in message.tool_calls]
    assert final.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_returns_the_first(client: OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=ask(CALL + TIME_CALL),
                                          tools=TOOLS, parallel_tool_calls=False)
    calls = full.choices[0].message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]


def test_malformed_calls_are_content_and_no_tools_no_parsing(client: OpenAI) -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=ask(broken), tools=TOOLS, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        else:
            full = client.chat.completions.create(model=MODEL, messages=ask(broken),
                                                  tools=TOOLS)
            text, finish = full.choices[0].message.content or "", full.choices[0].finish_reason
            assert full.choices[0].message.tool_calls is None
        assert (text, finish) == (broken, "stop")
    # Without tools (or with tool_choice none), a call's syntax is just text.
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        full = client.chat.completions.create(model=MODEL, messages=ask(CALL), **extra)
        assert full.choices[0].message.content == CALL
        assert full.choices[0].finish_reason == "stop"


def test_reasoning_alone_streamed_and_not(client: OpenAI) -> None:
    text = THINKING + "It is sunny."
    full = client.chat.completions.create(model=MODEL, messages=ask(text))
    message = full.choices[0].message
    assert message.content == "It is sunny."
    assert (message.model_extra or {})["reasoning_content"] == "The user wants the weather.\n"
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask(text), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It is sunny."
    assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                   for c in chunks if c.choices) == "The user wants the weather.\n"
    # No <think>: all content, and reasoning_content null.
    plain = client.chat.completions.create(model=MODEL, messages=ask("Just the answer."))
    assert plain.choices[0].message.content == "Just the answer."
    assert (plain.choices[0].message.model_extra or {})["reasoning_content"] is None


def test_tool_turns_go_back_into_the_template(client: OpenAI) -> None:
    """An assistant turn with tool calls and the tool's answer are messages the
    template takes (here it answers with the last one's text)."""
    messages: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert full.choices[0].message.content == "18 degrees"


def test_a_forced_call_is_decoded_within_its_function(client: OpenAI) -> None:
    """tool_choice named or required: the answer is constrained to the calls' syntax and
    the functions' parameters (the peer walks the automaton whatever its source says), so
    it comes back as calls, streamed as not."""
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    full = client.chat.completions.create(model=MODEL, messages=ask("anything"), tools=TOOLS,
                                          tool_choice=named, max_tokens=60)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    with client.chat.completions.stream(model=MODEL, messages=ask("anything"), tools=TOOLS,
                                        tool_choice=named, max_tokens=60) as stream:
        streamed = stream.get_final_completion().choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments)
            for c in streamed] == [(call.function.name, call.function.arguments)]
    one = client.chat.completions.create(model=MODEL, messages=ask("anything"), tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=60)
    calls = one.choices[0].message.tool_calls or []
    assert one.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].type == "function" and calls[0].function.name in ("get_weather", "get_time")


def test_what_cannot_be_honoured_is_a_400(client: OpenAI) -> None:
    for extra, param, message in [
            ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
             "names 'nope'"),
            ({"tool_choice": "required", "response_format": {"type": "json_object"}},
             "response_format", "one constraint at a time")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ask("hi"), tools=TOOLS,
                                           extra_body=extra)
        assert info.value.body["param"] == param  # type: ignore[index]
        assert message in info.value.body["message"]  # type: ignore[index]


def test_a_template_without_tool_syntax_refuses_tools(tmp_path: Path) -> None:
    template = tmp_path / "plain.jinja"
    template.write_text(VERBATIM)
    with running_stack("shm", mode="echo", timeout=120,
                       serve_args=("--chat-template", str(template))) as s, \
            OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=MODEL, messages=ask("hi"), tools=TOOLS)
        assert info.value.body["param"] == "tools"  # type: ignore[index]
        assert "--tool-call-parser" in info.value.body["message"]  # type: ignore[index]
        # auto found no </think> either: a <think> block is content.
        full = c.chat.completions.create(model=MODEL, messages=ask(THINKING + "x"))
        assert full.choices[0].message.content == THINKING + "x"
        assert "reasoning_content" not in (full.choices[0].message.model_extra or {})


def test_llama_3_1s_json_calls_where_the_template_writes_its_tag(tmp_path: Path) -> None:
    """A template that writes <|python_tag|> (Llama 3.1's) gets llama3_json by auto: an
    answer of JSON calls is calls, streamed and not; any other answer is content."""
    template = tmp_path / "llama.jinja"
    template.write_text("{# a call follows <|python_tag|> #}" + VERBATIM)
    calls = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
             '{"name": "get_time", "parameters": {}}')
    with running_stack("shm", mode="echo", timeout=120,
                       serve_args=("--chat-template", str(template))) as s, \
            OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0) as c:
        full = c.chat.completions.create(model=MODEL, messages=ask(calls), tools=TOOLS)
        assert full.choices[0].finish_reason == "tool_calls"
        message = full.choices[0].message
        assert message.content is None and message.tool_calls is not None
        assert [(t.function.name, json.loads(t.function.arguments))  # type: ignore[union-attr]
                for t in message.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                 ("get_time", {})]
        with c.chat.completions.stream(model=MODEL, messages=ask(calls), tools=TOOLS) as stream:
            final = stream.get_final_completion()
        assert [t.function.name for t in final.choices[0].message.tool_calls or []] == [
            "get_weather", "get_time"]
        plain = c.chat.completions.create(model=MODEL, messages=ask("It is sunny."),
                                          tools=TOOLS)
        assert plain.choices[0].message.content == "It is sunny."
        assert plain.choices[0].finish_reason == "stop"
