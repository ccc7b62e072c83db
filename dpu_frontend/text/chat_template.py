"""Chat templates rendered the way Hugging Face renders them.

A real template engine (jinja2, sandboxed and immutable), configured as
``transformers`` configures it: ``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text,
``raise_exception`` and ``strftime_now``, and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) in the context. The template is compiled
once at start-up; a template that raises for a request is that request's
400.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dpu_frontend.errors import RequestError, StartupError
from dpu_frontend.text.tokenizer import Vocabulary

#: What ``render`` passes the template itself, from the request: ``chat_template_kwargs``
#: may not name them (HF's ``apply_chat_template`` passes the same four).
RENDER_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt")

#: The deepest nesting of arrays and objects (lists and dicts) a request may hold: the
#: whole JSON body, and each value ``render`` hands the template. OpenAI requests are
#: shallow (messages, tools and their JSON schemas, ``response_format`` schemas: a few
#: dozen levels at most); the bound keeps ``json``, pydantic and ``tojson`` well inside
#: every interpreter's recursion limits, which differ between Python 3.11, 3.12 and 3.13
#: (issue 10, defect 1).
MAX_NESTING = 128


def nesting_exceeds(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` deep (``[[]]`` is 2).

    Level by level, without recursion: the cost is one type test per value, and
    nothing here can raise RecursionError, whatever the interpreter.
    """
    level = [value]
    for _ in range(limit + 1):
        containers = [v for v in level if type(v) is list or type(v) is dict]
        if not containers:
            return False
        level = []
        for container in containers:
            level.extend(container.values() if type(container) is dict else container)
    return True


def reserved_kwarg(kwargs: dict[str, Any] | None) -> str | None:
    """The first key of ``kwargs`` that ``render`` passes itself, if any."""
    return next((key for key in RENDER_ARGUMENTS if key in (kwargs or {})), None)


class TemplateRaised(RequestError):
    """The template refused the conversation (``raise_exception``) or failed on it."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, Any], origin: str) -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = special_tokens
        # OpenAI's "developer" role is the system message of its newer models. A template
        # that never names it would drop such a message without a word: it gets "system".
        self.developer_as_system = "developer" not in source
        try:
            self._template = environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise StartupError(f"chat template {origin}: line {exc.lineno}: {exc.message}") from exc

    @classmethod
    def from_file(cls, path: Path, special_tokens: dict[str, Any]) -> ChatTemplate:
        try:
            return cls(path.read_text(encoding="utf-8"), special_tokens, str(path))
        except OSError as exc:
            raise StartupError(f"cannot read chat template {path}: {exc}") from exc

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt for ``messages``; ``tools``: the request's, in OpenAI's shape
        (``{"type": "function", "function": {...}}``), as transformers hands them to the
        template."""
        if (key := reserved_kwarg(kwargs)) is not None:
            raise RequestError(f"chat_template_kwargs may not set '{key}': the template gets "
                               "it from the request", param="chat_template_kwargs")
        if nesting_exceeds(messages) or nesting_exceeds(kwargs) or nesting_exceeds(tools):
            raise TemplateRaised(f"chat template input is nested too deeply (more than "
                                 f"{MAX_NESTING} levels of arrays and objects)",
                                 param="messages", code="chat_template_error")
        if self.developer_as_system:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m
                        for m in messages]
        final = messages[-1].get("content") if messages else None
        opening = continue_final_message and not (isinstance(final, str) and final.strip())
        if opening:
            # Nothing to continue: the model writes the final message from its start. The
            # template renders a marker in its place, and the prompt ends before it.
            messages = [*messages[:-1], {**messages[-1], "content": _OPENING}]
        context = {**self.special_tokens, **(kwargs or {})}
        try:
            rendered = self._template.render(messages=messages, tools=tools or None,
                                             documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **context)
        except jinja2.TemplateError as exc:
            raise TemplateRaised(f"chat template error: {exc}", param="messages",
                                 code="chat_template_error") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError,
                RecursionError) as exc:  # RecursionError: a template that recurses itself
            raise TemplateRaised(f"chat template failed on these messages: {exc}",
                                 param="messages", code="chat_template_error") from exc
        if opening:
            at = str(rendered).rfind(_OPENING)
            if at == -1:
                raise TemplateRaised("continue_final_message: the template does not render "
                                     "the final message", param="messages",
                                     code="chat_template_error")
            return str(rendered)[:at]
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, str(final))
        return str(rendered)


#: Stands for the text of a final message that has none (continue_final_message).
_OPENING = "\x00dpu-frontend:final-message\x00"


def _cut_after_final_message(rendered: str, final: str) -> str:
    """End the prompt right after the last message's text, so the model continues it."""
    stripped = final.strip()
    at = rendered.rfind(stripped)
    if at == -1:
        raise TemplateRaised("continue_final_message: the template does not render the final "
                             "message's content", param="messages", code="chat_template_error")
    if rendered[at:at + len(final.lstrip())] == final.lstrip():
        return rendered[:at + len(final.lstrip())]
    return rendered[:at + len(stripped)]


def load_chat_template(vocab: Vocabulary, override: Path | None) -> ChatTemplate | None:
    """The template to serve chat with: ``override`` (a .jinja file), else the tokenizer's."""
    if override is not None:
        return ChatTemplate.from_file(override, vocab.special_tokens)
    if vocab.chat_template is None:
        return None
    return ChatTemplate(vocab.chat_template, vocab.special_tokens,
                        f"{vocab.source.parent}/tokenizer_config.json")
