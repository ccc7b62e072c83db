"""POST /v1/chat/completions: messages rendered with the model's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpu_frontend.engine.service import Delta, TokenLogprob
from dpu_frontend.errors import RequestError
from dpu_frontend.http.generation import GenerationHandler, Job, envelope
from dpu_frontend.http.logprobs import chat_logprobs
from dpu_frontend.http.schemas import ChatCompletionRequest, ChatMessage
from dpu_frontend.text.chat_template import ChatTemplate


class ChatCompletionsHandler(GenerationHandler[ChatCompletionRequest]):
    model_type = ChatCompletionRequest
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    chunk_object = "chat.completion.chunk"

    async def prompts(self, req: ChatCompletionRequest) -> list[list[int]]:
        text = await self.service.off_loop(
            render, self.service.chat_template, req.messages, req.add_generation_prompt,
            req.continue_final_message, req.chat_template_kwargs)
        # The template writes the special tokens (BOS) itself, as HF's apply_chat_template.
        return [await self.service.tokenize_prompt(text, self.prompt_param,
                                                     add_special_tokens=False)]

    def default_max_tokens(self, prompt_tokens: int) -> int:
        return self.service.max_model_len - prompt_tokens  # OpenAI: up to the context

    def requested_max_tokens(self, req: ChatCompletionRequest) -> int | None:
        return req.max_new_tokens

    def opening(self, job: Job) -> list[dict[str, Any]]:
        return [envelope(job, self.chunk_object, [{
            "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]) for i in range(len(job.prompts) * job.n)]

    def chunk(self, job: Job, delta: Delta) -> dict[str, Any]:
        message = {"content": delta.text} if delta.text else {}
        return envelope(job, self.chunk_object, [{
            "index": delta.index, "delta": message,
            "logprobs": self.choice_logprobs(job, delta.logprobs),
            "finish_reason": delta.finish_reason}])

    def answer(self, job: Job, texts: dict[int, str], finish: dict[int, str]) -> dict[str, Any]:
        return envelope(job, "chat.completion", [
            {"index": i, "message": {"role": "assistant", "content": texts.get(i, "")},
             "logprobs": self.choice_logprobs(job, job.logprobs.get(i, [])),
             "finish_reason": finish[i]}
            for i in sorted(finish)])

    def logprobs_json(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        return chat_logprobs(self.service.token_bytes, entries)


def render(template: ChatTemplate | None, messages: list[ChatMessage], add_generation_prompt: bool,
           continue_final_message: bool, kwargs: dict[str, Any] | None) -> str:
    if template is None:
        raise RequestError("this model has no chat template: use /v1/completions, or start "
                           "the daemon with --chat-template PATH", code="no_chat_template")
    return template.render([m.for_template() for m in messages],
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, kwargs=kwargs)
