"""Chat templates render exactly as Hugging Face's own renderer (transformers) renders them."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, cast

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from dpu_frontend.errors import RequestError, StartupError
from dpu_frontend.text.chat_template import (
    MAX_NESTING,
    ChatTemplate,
    TemplateRaised,
    load_chat_template,
    nesting_exceeds,
)
from dpu_frontend.text.tokenizer import Vocabulary
from tests.assets import tokenizer_dir

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why?"}],
    [{"role": "user", "content": "日本語で答えて 🚀"}, {"role": "assistant", "content": "はい。"},
     {"role": "user", "content": "Thanks, \"quoted\" and\nmulti-line."}],
    [{"role": "system", "content": "  spaces around  "}, {"role": "user", "content": ""}],
]

STRICT = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{{ bos_token }}[{{ m['role'] }}] {{ m['content'] | tojson }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


@functools.cache
def vocab(name: str) -> Vocabulary:
    return Vocabulary.load(tokenizer_dir(name))


def reference(source: str, v: Vocabulary, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    # transformers annotates this function "-> str" but returns (rendered, generation_indices).
    rendered, _ = cast(tuple[list[str], list[Any]],
                       render_jinja_template([messages], chat_template=source, **v.special_tokens,
                                             **kwargs))
    return rendered[0]


@pytest.mark.parametrize("name", ["qwen3", "llama3_1"])
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenizer_templates_match_hugging_face(name: str, messages: list[dict[str, Any]],
                                                add_generation_prompt: bool) -> None:
    v = vocab(name)
    template = load_chat_template(v, None)
    assert template is not None
    ours = template.render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == reference(template.source, v, messages,
                             add_generation_prompt=add_generation_prompt)


#: OpenAI's shape of a tool, as the request gives it and transformers passes it on.
WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}
#: A turn with a tool call (arguments as OpenAI sends them back: a JSON string), the
#: tool's answer, and the model's reasoning kept in the history.
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
]


@pytest.mark.parametrize("name", ["qwen3", "llama3_1"])
@pytest.mark.parametrize("messages", [TOOL_TURNS[:1], TOOL_TURNS], ids=["ask", "answered"])
def test_tools_and_tool_turns_render_as_hugging_face(name: str,
                                                     messages: list[dict[str, Any]]) -> None:
    """The request's tools reach the template (its tools block), and assistant turns with
    tool calls and tool results go back into it, as transformers renders them."""
    v = vocab(name)
    template = load_chat_template(v, None)
    assert template is not None
    ours = template.render(messages, tools=[WEATHER_TOOL])
    assert ours == reference(template.source, v, messages, tools=[WEATHER_TOOL],
                             add_generation_prompt=True)
    if "tools" in template.source:  # Qwen3's has a tools block; npm's Llama-3.1 copy none
        assert "get_weather" in ours
        assert template.render(messages[:1]) != template.render(messages[:1],
                                                                tools=[WEATHER_TOOL])


@pytest.mark.parametrize("name", ["qwen3", "llama3_1"])
def test_continue_final_message_matches_hugging_face(name: str) -> None:
    v = vocab(name)
    template = load_chat_template(v, None)
    assert template is not None
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2,"}]
    ours = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == reference(template.source, v, messages, continue_final_message=True)
    assert ours.endswith("1, 2,")


def test_continuing_a_final_message_without_text_starts_it() -> None:
    """Nothing to continue: the prompt ends where the message's text would begin."""
    template = load_chat_template(vocab("qwen3"), None)
    assert template is not None
    for final in ({"role": "assistant"}, {"role": "assistant", "content": ""}):
        ours = template.render([{"role": "user", "content": "Hi"}, final],
                               add_generation_prompt=False, continue_final_message=True)
        # Qwen3 gives the turn after the last user message an empty thinking block.
        assert ours.endswith("user\nHi<|im_end|>\n<|im_start|>assistant\n"
                             "<think>\n\n</think>\n\n")


def test_a_developer_message_is_a_system_message_where_the_template_knows_no_developer() -> None:
    """Qwen3's template renders system, user, assistant and tool, and would drop a
    developer message without a word."""
    template = load_chat_template(vocab("qwen3"), None)
    assert template is not None and template.developer_as_system
    rendered = template.render([{"role": "developer", "content": "Be brief."},
                                {"role": "user", "content": "Hi"}])
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_template_file_with_raise_exception(tmp_path: Path) -> None:
    path = tmp_path / "strict.jinja"
    path.write_text(STRICT)
    v = vocab("llama3_1")
    template = ChatTemplate.from_file(path, v.special_tokens)
    good = [{"role": "user", "content": "é"}, {"role": "assistant", "content": "b"}]
    assert template.render(good) == reference(STRICT, v, good, add_generation_prompt=True)
    with pytest.raises(TemplateRaised, match="roles must alternate"):
        template.render([{"role": "assistant", "content": "x"}])


def test_a_broken_template_is_a_startup_error() -> None:
    with pytest.raises(StartupError, match="line 1"):
        ChatTemplate("{% for %}", {}, "inline")


def test_template_failure_on_odd_input_is_a_request_error() -> None:
    template = ChatTemplate("{{ messages[5]['content'] }}", {}, "inline")
    with pytest.raises(RequestError):
        template.render([{"role": "user", "content": "x"}])


def test_sandbox_refuses_unsafe_access() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {}, "inline")
    with pytest.raises(RequestError, match="chat template"):
        template.render([{"role": "user", "content": "x"}])


def test_tokenizer_without_template() -> None:
    assert load_chat_template(vocab("mistral"), None) is None


def test_a_deeply_nested_value_is_a_request_error() -> None:
    """Deep enough to parse, too deep for ``tojson`` (issue 10, defect 1)."""
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    template = ChatTemplate("{{ messages[0]['extra'] | tojson }}", {}, "inline")
    with pytest.raises(RequestError) as info:
        template.render([{"role": "user", "content": "x", "extra": deep}])
    assert info.value.code == "chat_template_error" and info.value.status == 400
    assert f"more than {MAX_NESTING} levels" in info.value.message


def nested(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_nesting_is_bounded_before_rendering_on_every_python() -> None:
    """Not RecursionError, whose depth differs from 3.11 to 3.13: the bound is explicit."""
    assert not nesting_exceeds(nested(MAX_NESTING)) and nesting_exceeds(nested(MAX_NESTING + 1))
    assert not nesting_exceeds({"a": [1, {"b": "[[["}], "c": None})
    assert nesting_exceeds({"a": [{"b": [[]]}]}, limit=4) and not nesting_exceeds([[[[]]]], 4)
    assert not nesting_exceeds("x", limit=0) and nesting_exceeds([], limit=0)
    template = ChatTemplate("{{ extra | tojson }}", {}, "inline")
    messages = [{"role": "user", "content": "x"}]
    assert template.render(messages, kwargs={"extra": nested(MAX_NESTING - 1)})
    with pytest.raises(TemplateRaised, match="nested too deeply"):
        template.render(messages, kwargs={"extra": nested(MAX_NESTING)})
    with pytest.raises(TemplateRaised, match="nested too deeply"):
        template.render([{"role": "user", "content": nested(MAX_NESTING)}])


@pytest.mark.parametrize("key", ["messages", "tools", "documents", "add_generation_prompt"])
def test_kwargs_that_name_a_render_argument_are_refused(key: str) -> None:
    template = ChatTemplate("{{ messages[0]['content'] }}{{ extra }}", {}, "inline")
    assert template.render([{"role": "user", "content": "x"}], kwargs={"extra": "!"}) == "x!"
    with pytest.raises(RequestError) as info:
        template.render([{"role": "user", "content": "x"}], kwargs={key: None})
    assert info.value.param == "chat_template_kwargs" and f"'{key}'" in info.value.message
