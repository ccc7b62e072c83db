"""POST /v1/chat/completions: messages rendered with the model's own chat template."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from dpu_frontend.engine.service import Delta, TokenLogprob
from dpu_frontend.errors import RequestError
from dpu_frontend.http.errors import random_hex
from dpu_frontend.http.generation import GenerationHandler, Job, envelope
from dpu_frontend.http.logprobs import chat_logprobs
from dpu_frontend.http.schemas import ChatCompletionRequest, ChatMessage
from dpu_frontend.text.chat_output import (
    PYTHON_TAG,
    THINK_END,
    THINK_START,
    TOOL_START,
    ChatOutputs,
)
from dpu_frontend.text.chat_template import ChatTemplate
from dpu_frontend.text.constraints import ConstraintError, ConstraintSpec


class ChatCompletionsHandler(GenerationHandler[ChatCompletionRequest]):
    model_type = ChatCompletionRequest
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    chunk_object = "chat.completion.chunk"

    # Whether answers are split: by the daemon's flags, or (auto) by what the chat
    # template writes for the assistant's turns.

    @functools.cached_property
    def reasoning(self) -> bool:
        """Qwen3's <think> block goes to reasoning_content."""
        flag = self.service.config.reasoning_parser
        return flag == "qwen3" or (flag == "auto" and THINK_END in self._template_source)

    @functools.cached_property
    def tool_syntax(self) -> str | None:
        """How requests with tools get their calls parsed: hermes (<tool_call> blocks),
        llama3_json (an answer of JSON calls), or None (not at all)."""
        flag = self.service.config.tool_call_parser
        if flag != "auto":
            return None if flag == "none" else flag
        source = self._template_source
        if TOOL_START in source:
            return "hermes"
        return "llama3_json" if PYTHON_TAG in source else None

    @property
    def tool_calls(self) -> bool:
        return self.tool_syntax is not None

    @property
    def _template_source(self) -> str:
        template = self.service.chat_template
        return template.source if template is not None else ""

    async def prompts(self, req: ChatCompletionRequest) -> list[list[int]]:
        if req.tools_on and not self.tool_calls:
            raise RequestError("tools: this model's chat template writes no tool-call syntax "
                               "the daemon parses (start it with --tool-call-parser hermes "
                               "where the model writes <tool_call>{json}</tool_call>, "
                               "llama3_json where it answers with JSON calls)",
                               param="tools", code="unsupported_parameter")
        text = await self.service.off_loop(
            render, self.service.chat_template, req.messages, req.add_generation_prompt,
            req.continue_final_message, req.chat_template_kwargs, req.tools_for_template())
        # The template writes the special tokens (BOS) itself, as HF's apply_chat_template.
        return [await self.service.tokenize_prompt(text, self.prompt_param,
                                                     add_special_tokens=False)]

    def constraint(self, req: ChatCompletionRequest) -> ConstraintSpec | None:
        """The request's own constraint, or a forced tool call (``tool_choice`` required
        or named) as one: calls in the syntax the answer is parsed in, their arguments
        within the functions' schemas. One at a time."""
        spec = req.constraint()
        forced = req.forced_tools()
        if forced is None:
            return spec
        if spec is not None:
            raise RequestError("one constraint at a time: a forced tool call (tool_choice) "
                               f"and {spec.param}", param=spec.param)
        try:
            return ConstraintSpec.tool_calls(
                "llama3_json" if self.tool_syntax == "llama3_json" else "hermes", forced,
                req.parallel_tool_calls)
        except ConstraintError as exc:
            raise RequestError(str(exc), param=exc.param) from exc

    def default_max_tokens(self, prompt_tokens: int) -> int:
        return self.service.max_model_len - prompt_tokens  # OpenAI: up to the context

    def requested_max_tokens(self, req: ChatCompletionRequest) -> int | None:
        return req.max_new_tokens

    def opening(self, job: Job) -> list[dict[str, Any]]:
        return [envelope(job, self.chunk_object, [{
            "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]) for i in range(len(job.prompts) * job.n)]

    def outputs(self, req: ChatCompletionRequest, prompts: list[list[int]]) -> ChatOutputs | None:
        tools = req.tools_on and self.tool_calls
        if not (self.reasoning or tools):
            return None
        # A template that opens the block for the model (Qwen3's thinking variants):
        # the answer starts inside it.
        tail = self.service.vocab.decode(prompts[0][-8:], skip_special_tokens=False)
        # A constrained answer is decoded within its constraint from its first token: it
        # is the answer, even after a template that opened the thinking block.
        return ChatOutputs(reasoning=self.reasoning, tools=tools,
                           thinking=(self.reasoning and not req.constrained
                                     and tail.rstrip().endswith(THINK_START)),
                           parallel=req.parallel_tool_calls,
                           syntax=self.tool_syntax or "hermes")

    def chunk(self, job: Job, delta: Delta) -> dict[str, Any]:
        message = {"content": delta.text} if delta.text else {}
        return envelope(job, self.chunk_object, [{
            "index": delta.index, "delta": message,
            "logprobs": self.choice_logprobs(job, delta.logprobs),
            "finish_reason": delta.finish_reason}])

    def chunks(self, job: Job, delta: Delta) -> list[dict[str, Any]]:
        """A delta through the choice's parser: an event with its reasoning and content
        (and the delta's log probabilities), then per tool call one with its index, id,
        type and name, and one with its arguments, then the finish."""
        outputs = job.outputs
        assert outputs is not None
        i = delta.index
        final = delta.finish_reason is not None
        piece = outputs.feed(i, delta.text, final=final)
        first_call = outputs.calls[i] - len(piece.tool_calls)
        deltas: list[dict[str, Any]] = []
        text: dict[str, Any] = {}
        if piece.reasoning:
            text["reasoning_content"] = piece.reasoning
        if piece.content:
            text["content"] = piece.content
        if text or delta.logprobs:
            deltas.append(text)
        for k, call in enumerate(piece.tool_calls, first_call):
            deltas.append({"tool_calls": [{"index": k, "id": call_id(), "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})
        if final:
            reason = job.finish[i] = outputs.finish_reason(i, str(delta.finish_reason))
            deltas.append({"finish_reason": reason})
        events = []
        for n, d in enumerate(deltas):
            reason = d.pop("finish_reason", None)
            events.append(envelope(job, self.chunk_object, [{
                "index": i, "delta": d,
                "logprobs": self.choice_logprobs(job, delta.logprobs) if n == 0 else None,
                "finish_reason": reason}]))
        return events

    def answer(self, job: Job, texts: dict[int, str], finish: dict[int, str]) -> dict[str, Any]:
        choices = []
        for i in sorted(finish):
            message: dict[str, Any] = {"role": "assistant", "content": texts.get(i, "")}
            if job.outputs is not None:
                piece = job.outputs.feed(i, texts.get(i, ""), final=True)
                finish[i] = job.outputs.finish_reason(i, finish[i])
                message["content"] = piece.content or (None if piece.tool_calls else "")
                if job.outputs.reasoning:
                    message["reasoning_content"] = piece.reasoning or None
                if piece.tool_calls:
                    message["tool_calls"] = [
                        {"id": call_id(), "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments}}
                        for c in piece.tool_calls]
            choices.append({"index": i, "message": message,
                            "logprobs": self.choice_logprobs(job, job.logprobs.get(i, [])),
                            "finish_reason": finish[i]})
        return envelope(job, "chat.completion", choices)

    def logprobs_json(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        return chat_logprobs(self.service.token_bytes, entries)


def call_id() -> str:
    """A tool call's id, OpenAI's shape."""
    return f"call_{random_hex(24)}"


def render(template: ChatTemplate | None, messages: list[ChatMessage], add_generation_prompt: bool,
           continue_final_message: bool, kwargs: dict[str, Any] | None,
           tools: list[dict[str, Any]] | None = None) -> str:
    if template is None:
        raise RequestError("this model has no chat template: use /v1/completions, or start "
                           "the daemon with --chat-template PATH", code="no_chat_template")
    return template.render([m.for_template() for m in messages],
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, kwargs=kwargs,
                           tools=tools)
