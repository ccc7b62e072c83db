"""The chat answer's split into reasoning, content and tool calls (``text/chat_output``):
what each shape of answer gives, and the same result however the text is cut into
pieces (tags across pieces, at the first or last piece)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_frontend.text.chat_output import ChatOutputParser, ChatOutputs, ChatPiece, ToolCall

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'


def whole(text: str, **flags: bool) -> ChatPiece:
    parser = ChatOutputParser(**{"reasoning": True, "tools": True} | flags)
    out = parser.feed(text)
    out.extend(parser.flush())
    return out


def in_pieces(text: str, cuts: list[int], **flags: bool) -> ChatPiece:
    parser = ChatOutputParser(**{"reasoning": True, "tools": True} | flags)
    out = ChatPiece()
    last = 0
    for cut in [*sorted({c % (len(text) + 1) for c in cuts}), len(text)]:
        out.extend(parser.feed(text[last:cut]))
        last = cut
    out.extend(parser.flush())
    return out


CASES = [
    # Qwen3 thinking, then the answer.
    ("<think>\nThe user wants Paris.\n</think>\n\nThe capital is Paris.", {},
     ChatPiece("The user wants Paris.\n", "The capital is Paris.")),
    # Thinking off (the template wrote an empty block into the prompt): all content.
    ("The capital is Paris.", {}, ChatPiece("", "The capital is Paris.")),
    # The template opened the block: the answer starts inside it.
    ("Let me think.\n</think>\n\nParis.", {"thinking": True},
     ChatPiece("Let me think.\n", "Paris.")),
    # Cut short inside the block: all reasoning.
    ("<think>\nStill thinking", {}, ChatPiece("Still thinking", "")),
    # A </think> with no <think> before it is content.
    ("Paris </think> is it", {}, ChatPiece("", "Paris </think> is it")),
    # Tool calls after thinking, whitespace between and after dropped.
    (f"<think>\nI need the weather.\n</think>\n\n<tool_call>\n{WEATHER}\n</tool_call>\n"
     f"<tool_call>\n{TIME}\n</tool_call>\n", {},
     ChatPiece("I need the weather.\n", "", [
         ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
         ToolCall("get_time", '{"zone": "CET"}')])),
    # Text before a call stays content.
    (f"Let me check.\n<tool_call>{WEATHER}</tool_call>", {},
     ChatPiece("", "Let me check.\n", [
         ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')])),
    # Arguments given as a JSON string: the object it holds.
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\":1}"}</tool_call>', {},
     ChatPiece("", "", [ToolCall("f", '{"x": 1}')])),
    ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', {},
     ChatPiece("", '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>')),
    # Too deep to parse, or a lone surrogate: not a call.
    ("<tool_call>" + "[" * 5000 + "</tool_call>", {},
     ChatPiece("", "<tool_call>" + "[" * 5000 + "</tool_call>")),
    ('<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>', {},
     ChatPiece("", '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>')),
    # Text between calls keeps its inner spaces, never the trailing ones.
    (f"<tool_call>{TIME}</tool_call> mid <tool_call>{TIME}</tool_call>", {},
     ChatPiece("", " mid", [ToolCall("get_time", '{"zone": "CET"}')] * 2)),
    # Malformed: not JSON, no name, arguments a number, never closed: content.
    ("<tool_call>{not json}</tool_call>", {}, ChatPiece("", "<tool_call>{not json}</tool_call>")),
    ('<tool_call>{"arguments": {}}</tool_call>', {},
     ChatPiece("", '<tool_call>{"arguments": {}}</tool_call>')),
    ('<tool_call>{"name": "f", "arguments": 3}</tool_call>', {},
     ChatPiece("", '<tool_call>{"name": "f", "arguments": 3}</tool_call>')),
    (f"<tool_call>{WEATHER}", {}, ChatPiece("", f"<tool_call>{WEATHER}")),
    # Text after a call is content; a call then malformed text.
    (f"<tool_call>{TIME}</tool_call>\n\nDone.", {},
     ChatPiece("", "\n\nDone.", [ToolCall("get_time", '{"zone": "CET"}')])),
    # Tools off: the tags are text.
    (f"<tool_call>{TIME}</tool_call>", {"tools": False},
     ChatPiece("", f"<tool_call>{TIME}</tool_call>")),
    # Reasoning off: <think> is text.
    ("<think>x</think>y", {"reasoning": False}, ChatPiece("", "<think>x</think>y")),
    # Partial tags held at the end come out as what they are.
    ("Paris <tool_ca", {}, ChatPiece("", "Paris <tool_ca")),
    ("<thi", {}, ChatPiece("", "<thi")),
    ("<think>deep </thi", {}, ChatPiece("deep </thi", "")),
]


@pytest.mark.parametrize(("text", "flags", "expected"), CASES)
def test_each_shape_of_answer(text: str, flags: dict[str, bool], expected: ChatPiece) -> None:
    assert whole(text, **flags) == expected
    # One character at a time: every tag split across pieces.
    assert in_pieces(text, list(range(len(text))), **flags) == expected


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_cuts_give_the_whole_answer(case: tuple[str, dict[str, bool], ChatPiece],
                                        cuts: list[int]) -> None:
    text, flags, expected = case
    assert in_pieces(text, cuts, **flags) == expected


TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "x", "<", "</",
        "<tool_", WEATHER, "{", "}", '"name"', " mid ", f"<tool_call>{TIME}</tool_call>"]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(TAGS), max_size=12),
       cuts=st.lists(st.integers(0, 400), max_size=12), thinking=st.booleans())
def test_arbitrary_text_streams_as_it_parses_whole(parts: list[str], cuts: list[int],
                                                   thinking: bool) -> None:
    text = "".join(parts)
    expected = whole(text, thinking=thinking)
    assert in_pieces(text, cuts, thinking=thinking) == expected
    # Text with no tag that opens anything is content, every character of it.
    if not thinking and "<think>" not in text and "<tool_call>" not in text:
        assert expected == ChatPiece("", text)
    # Every call's arguments are JSON.
    for call in expected.tool_calls:
        json.loads(call.arguments)


def test_a_requests_choices_each_have_their_parser() -> None:
    """Choices are parsed apart; parallel_tool_calls false keeps a choice's first call;
    a choice that called ends with tool_calls; content with nothing to look for passes
    through."""
    outputs = ChatOutputs(reasoning=True, tools=True, thinking=False, parallel=False)
    calls = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    first = outputs.feed(0, calls[:30], final=False)
    assert first == ChatPiece()
    rest = outputs.feed(0, calls[30:], final=True)
    assert [c.name for c in rest.tool_calls] == ["get_weather"]
    assert outputs.finish_reason(0, "stop") == "tool_calls"
    assert outputs.finish_reason(0, "length") == "length"
    assert outputs.feed(1, "Plain answer.", final=True) == ChatPiece("", "Plain answer.")
    assert outputs.finish_reason(1, "stop") == "stop"
    plain = ChatOutputs(reasoning=True, tools=False, thinking=False)
    assert not plain.passthrough(0)  # nothing seen yet: a <think> may open it
    plain.feed(0, "<th", final=False)
    assert not plain.passthrough(0)
    plain.feed(0, "is is", final=False)
    assert plain.passthrough(0)
    assert not ChatOutputs(reasoning=True, tools=True, thinking=False).passthrough(0)


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize(("text", "expected"), [
    (LLAMA_CALL, ChatPiece("", "", [ToolCall("get_weather", '{"city": "Paris"}')])),
    (f"  {LLAMA_CALL}; {TIME}\n", ChatPiece("", "", [
        ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", '{"zone": "CET"}')])),
    # Not every part a call, or not JSON: the whole answer is content.
    (f"{LLAMA_CALL} and then", ChatPiece("", f"{LLAMA_CALL} and then")),
    ('{"answer": 42}', ChatPiece("", '{"answer": 42}')),
    ("{" * 5000, ChatPiece("", "{" * 5000)),
    # An answer that does not open with { passes as it comes.
    ("The weather is fine.", ChatPiece("", "The weather is fine.")),
    (f"Calling: {LLAMA_CALL}", ChatPiece("", f"Calling: {LLAMA_CALL}")),
])
def test_llama_3_1s_json_calls(text: str, expected: ChatPiece) -> None:
    for cuts in ([], list(range(len(text))), [3, 17]):
        outputs = ChatOutputs(reasoning=False, tools=True, thinking=False,
                              syntax="llama3_json")
        got = ChatPiece()
        last = 0
        for cut in [*sorted({c % (len(text) + 1) for c in cuts}), len(text)]:
            got.extend(outputs.feed(0, text[last:cut], final=cut == len(text)))
            last = cut
        assert got == expected
        assert outputs.finish_reason(0, "stop") == ("tool_calls" if expected.tool_calls
                                                   else "stop")
    # Plain text is known as such from its first character on: the fast path may take it.
    plain = ChatOutputs(reasoning=False, tools=True, thinking=False, syntax="llama3_json")
    plain.feed(0, "  The", final=False)
    assert plain.passthrough(0)
