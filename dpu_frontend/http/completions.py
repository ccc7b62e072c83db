"""POST /v1/completions: prompts as text or token ids, one or several."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from dpu_frontend.engine.service import Delta, TokenLogprob
from dpu_frontend.http.generation import GenerationHandler, Job, envelope
from dpu_frontend.http.logprobs import completion_logprobs
from dpu_frontend.http.schemas import CompletionRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class CompletionsHandler(GenerationHandler[CompletionRequest]):
    model_type = CompletionRequest
    id_prefix = "cmpl"
    prompt_param = "prompt"
    chunk_object = "text_completion"

    async def prompts(self, req: CompletionRequest) -> list[list[int]]:
        if isinstance(req.prompt, str):
            return [await self.service.tokenize_prompt(req.prompt, self.prompt_param)]
        items: list[Any] = list(req.prompt)
        if not items:
            return [[]]
        if isinstance(items[0], int):  # one prompt as token ids
            return [items]
        if isinstance(items[0], list):  # several prompts as token ids
            return [list(p) for p in items]
        return list(await asyncio.gather(*(self.service.tokenize_prompt(t, self.prompt_param)
                                           for t in items)))

    def default_max_tokens(self, prompt_tokens: int) -> int:
        return DEFAULT_MAX_TOKENS

    def requested_max_tokens(self, req: CompletionRequest) -> int | None:
        return req.max_tokens

    def chunk(self, job: Job, delta: Delta) -> dict[str, Any]:
        return envelope(job, self.chunk_object, [{
            "index": delta.index, "text": delta.text,
            "logprobs": self.choice_logprobs(job, delta.logprobs),
            "finish_reason": delta.finish_reason}])

    def answer(self, job: Job, texts: dict[int, str], finish: dict[int, str]) -> dict[str, Any]:
        return envelope(job, "text_completion", [
            {"index": i, "text": texts.get(i, ""),
             "logprobs": self.choice_logprobs(job, job.logprobs.get(i, [])),
             "finish_reason": finish[i]}
            for i in sorted(finish)])

    def logprobs_json(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        return completion_logprobs(self.service.token_bytes, entries)
