"""A chat answer's text split into what OpenAI's API returns apart: the reasoning
(``reasoning_content``, Qwen3's ``<think>`` block), the content, and tool calls
(Qwen3's and Hermes' ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, or
Llama 3.1's answer of JSON calls: ``JsonCallParser``).

One pass over the detokenized text, after the stop strings, fed in pieces as they
arrive: text that could still become a tag is held back (as the stop matcher holds
a stop string's start), so a tag split across tokens, or at the first or last token,
is found all the same, and the pieces of a streamed answer add up to the unstreamed
answer whatever the cuts. Pure: text in, pieces out.

- **Reasoning.** Where the template opened a ``<think>`` block at the end of the
  prompt, the answer starts inside it; otherwise a ``<think>`` at the very start
  opens it. Up to ``</think>`` is reasoning, the rest content (as vLLM's ``qwen3``
  reasoning parser and DeepSeek's API split it). Newlines right after either tag are
  dropped. An answer cut short inside the block is all reasoning.
- **Tool calls.** Each ``<tool_call>`` block's JSON object is a call once its
  ``</tool_call>`` arrives; a block whose JSON is not a call (not JSON, no string
  ``name``, ``arguments`` neither an object nor a string holding one), or is never
  closed, is returned as content, tags included. Arguments are returned as the JSON
  text of their object. Whitespace between and after calls is dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
#: Llama 3.1's template writes it before a call (the detokenizer drops it as special).
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    #: The arguments as a JSON text (OpenAI's ``function.arguments``).
    arguments: str


@dataclass(slots=True)
class ChatPiece:
    """What a piece of an answer's text turned into."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: ChatPiece) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class _State(Enum):
    START = "start"  # nothing yet: a <think> may open the answer
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL = "tool"  # inside <tool_call>: held until it closes


def _partial(buffer: str, tag: str) -> int:
    """The length of the longest end of ``buffer`` that begins ``tag`` (and is shorter)."""
    for k in range(min(len(buffer), len(tag) - 1), 0, -1):
        if tag.startswith(buffer[-k:]):
            return k
    return 0


def parse_tool_call(body: str) -> ToolCall | None:
    """A ``<tool_call>`` block's text as a call, or None where it is not one: not a JSON
    object (nested too deeply to parse counts), no string ``name``, ``arguments`` (or
    ``parameters``) neither an object nor a string holding one, or a string no UTF-8
    can carry (a lone surrogate escape)."""
    try:
        value = json.loads(body)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            return None
        call = ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
        (call.name + call.arguments).encode()
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return call


class ChatOutputParser:
    """One answer's text, in pieces. ``reasoning``: split off Qwen3's ``<think>`` block,
    ``thinking``: the prompt ends inside one; ``tools``: parse tool calls."""

    def __init__(self, *, reasoning: bool, tools: bool, thinking: bool = False) -> None:
        self.reasoning = reasoning
        self.tools = tools
        if reasoning and thinking:
            self._state = _State.REASONING
        else:
            self._state = _State.START if reasoning else _State.CONTENT
        self._held = ""  # text that may still be a tag's beginning (or a call's body)
        self._trim = reasoning and thinking  # drop newlines before the next text
        self._calls = 0
        self._spaces = ""  # whitespace after a call, dropped unless text follows

    @property
    def passthrough(self) -> bool:
        """Whether the rest of the text is content as it comes (no reasoning to split,
        no calls to look for, nothing held): the caller may skip ``feed``."""
        return (self._state is _State.CONTENT and not self.tools and not self._held
                and not self._trim)

    def feed(self, text: str) -> ChatPiece:
        out = ChatPiece()
        buffer, self._held = self._held + text, ""
        while buffer:
            buffer = self._step(buffer, out)
        return out

    def flush(self) -> ChatPiece:
        """The end of the answer: what was held back goes where its state says."""
        out = ChatPiece()
        held, self._held = self._held, ""
        if self._state is _State.START:
            self._state = _State.CONTENT
        if self._state is _State.REASONING:
            self._emit_reasoning(held, out)
        elif self._state is _State.TOOL:
            self._emit_content(TOOL_START + held, out)  # never closed: not a call
        else:
            self._emit_content(held, out)
        self._spaces = ""
        return out

    def _step(self, buffer: str, out: ChatPiece) -> str:
        """Consume the start of ``buffer``; return what is left to consume (holding back
        what cannot be placed yet sets ``_held`` and returns "")."""
        state = self._state
        if state is _State.START:
            if buffer.startswith(THINK_START):
                self._state, self._trim = _State.REASONING, True
                return buffer[len(THINK_START):]
            if THINK_START.startswith(buffer):
                self._held = buffer
                return ""
            self._state = _State.CONTENT
            return buffer
        if state is _State.REASONING:
            at = buffer.find(THINK_END)
            if at != -1:
                self._emit_reasoning(buffer[:at], out)
                self._state, self._trim = _State.CONTENT, True
                return buffer[at + len(THINK_END):]
            keep = _partial(buffer, THINK_END)
            self._emit_reasoning(buffer[:len(buffer) - keep], out)
            self._held = buffer[len(buffer) - keep:]
            return ""
        if state is _State.TOOL:
            at = buffer.find(TOOL_END)
            if at == -1:
                self._held = buffer
                return ""
            body = buffer[:at]
            call = parse_tool_call(body)
            if call is None:
                self._emit_content(TOOL_START + body + TOOL_END, out)
            else:
                out.tool_calls.append(call)
                self._calls += 1
                self._spaces = ""
            self._state = _State.CONTENT
            return buffer[at + len(TOOL_END):]
        # Content.
        if not self.tools:
            self._emit_content(buffer, out)
            return ""
        at = buffer.find(TOOL_START)
        if at != -1:
            self._emit_content(buffer[:at], out)
            if self._calls:
                self._spaces = ""  # whitespace between two calls
            self._state = _State.TOOL
            return buffer[at + len(TOOL_START):]
        keep = _partial(buffer, TOOL_START)
        self._emit_content(buffer[:len(buffer) - keep], out)
        self._held = buffer[len(buffer) - keep:]
        return ""

    def _emit_reasoning(self, text: str, out: ChatPiece) -> None:
        if self._trim:
            text = text.lstrip("\n")
            self._trim = not text
        out.reasoning += text

    def _emit_content(self, text: str, out: ChatPiece) -> None:
        if self._trim:
            text = text.lstrip("\n")
            self._trim = not text
        if self._calls:
            # After a call, trailing whitespace waits for text to follow it (dropped
            # before the next call and at the end), however the text is cut.
            text = self._spaces + text
            kept = text.rstrip()
            self._spaces = text[len(kept):]
            text = kept
        out.content += text


class JsonCallParser:
    """Llama 3.1's tool calls (``llama3_json``): an answer that is, whole, one or more
    JSON objects ``{"name": ..., "parameters": {...}}`` (separated by ``;``, after the
    ``<|python_tag|>`` the detokenizer drops as special) is calls; any other is content.
    An answer whose first text (past whitespace) is ``{`` is held to its end to be told;
    others pass as they come."""

    def __init__(self) -> None:
        self._held = ""
        self._json: bool | None = None  # undecided until the first text

    @property
    def passthrough(self) -> bool:
        return self._json is False

    def feed(self, text: str) -> ChatPiece:
        if self._json is False:
            return ChatPiece(content=text)
        self._held += text
        start = self._held.lstrip()
        if self._json is None and start:
            self._json = start.startswith("{")
            if not self._json:
                held, self._held = self._held, ""
                return ChatPiece(content=held)
        return ChatPiece()

    def flush(self) -> ChatPiece:
        held, self._held = self._held, ""
        if not self._json:
            return ChatPiece(content=held)
        calls = parse_json_calls(held)
        return ChatPiece(tool_calls=calls) if calls else ChatPiece(content=held)


def parse_json_calls(text: str) -> list[ToolCall]:
    """Llama 3.1's calls in ``text``: JSON objects separated by ``;`` and whitespace,
    each a call (``parse_tool_call``); none if any part is not."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return calls
        try:
            _, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return []
        call = parse_tool_call(text[at:end])
        if call is None:
            return []
        calls.append(call)
        at = end


class ChatOutputs:
    """The parsers of one request's choices, made as each choice's first text arrives.
    ``parallel`` False: a choice returns its first call only (OpenAI's
    ``parallel_tool_calls: false``)."""

    def __init__(self, *, reasoning: bool, tools: bool, thinking: bool,
                 parallel: bool = True, syntax: str = "hermes") -> None:
        self.reasoning = reasoning
        self.tools = tools
        self._thinking = thinking
        self._parallel = parallel
        #: The calls' syntax: hermes (<tool_call> blocks) or llama3_json (a JSON answer).
        self._json = tools and syntax == "llama3_json"
        self._parsers: dict[int, ChatOutputParser | JsonCallParser] = {}
        #: Calls returned so far, by choice: the next call's ``index``.
        self.calls: dict[int, int] = {}

    def feed(self, index: int, text: str, *, final: bool) -> ChatPiece:
        """Choice ``index``'s next text; ``final``: its last (what was held comes out)."""
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = JsonCallParser() if self._json else (
                ChatOutputParser(reasoning=self.reasoning, tools=self.tools,
                                 thinking=self._thinking))
        piece = parser.feed(text)
        if final:
            piece.extend(parser.flush())
        if piece.tool_calls and not self._parallel:
            piece.tool_calls = piece.tool_calls[:max(0, 1 - self.calls.get(index, 0))]
        self.calls[index] = self.calls.get(index, 0) + len(piece.tool_calls)
        return piece

    def passthrough(self, index: int) -> bool:
        """Whether choice ``index``'s next text is content as it comes (its parser has
        seen the answer's start and has nothing to look for)."""
        parser = self._parsers.get(index)
        return parser is not None and parser.passthrough

    def finish_reason(self, index: int, reason: str) -> str:
        """``tool_calls`` for a choice that stopped after calling; else ``reason``."""
        return "tool_calls" if reason == "stop" and self.calls.get(index) else reason
