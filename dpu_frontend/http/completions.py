"""POST /v1/completions: one validated request model, one path for stream and non-stream."""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from dpu_frontend.engine.service import Delta, Service
from dpu_frontend.errors import ModelNotFound, PeerError, RequestError
from dpu_frontend.http.errors import body_for
from dpu_frontend.ring import SamplingParams
from dpu_frontend.ring.records import MAX_STOP_TOKEN_IDS, U32_MAX

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

#: The fields this endpoint honours. Anything else is refused with a 400,
#: never silently ignored.
KNOWN_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "top_p",
    "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "stop_token_ids", "ignore_eos", "user", "n",
})


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool

    @classmethod
    def parse(cls, body: Any) -> CompletionRequest:
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        unknown = sorted(set(body) - KNOWN_FIELDS)
        if unknown:
            raise RequestError(f"unsupported parameter(s): {', '.join(unknown)}", param=unknown[0])
        model = _get(body, "model", str, required=True)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
            pass
        elif not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string or a list of token ids",
                               param="prompt")
        if _get(body, "n", int, default=1) != 1:
            raise RequestError("only n=1 is supported", param="n")
        max_tokens = _get(body, "max_tokens", int)
        stream_options = _get(body, "stream_options", dict, default={})
        stream = _get(body, "stream", bool, default=False)
        if stream_options and not stream:
            raise RequestError("stream_options is only allowed with stream=true",
                               param="stream_options")
        stop_ids = _get(body, "stop_token_ids", list, default=[])
        if len(stop_ids) > MAX_STOP_TOKEN_IDS or not all(_is_token(t) for t in stop_ids):
            raise RequestError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids",
                               param="stop_token_ids")
        seed = _get(body, "seed", int)
        if seed is not None and not 0 <= seed < 2**64:
            raise RequestError("seed must be in [0, 2**64)", param="seed")
        params = SamplingParams(
            max_tokens=_bounded(max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS,
                                "max_tokens", 1, U32_MAX),
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_num(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
            top_k=_bounded(_get(body, "top_k", int, default=-1), "top_k", -1, 2**31 - 1),
            min_p=_num(body, "min_p", 0.0, 0.0, 1.0),
            seed=seed,
            presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=_num(body, "repetition_penalty", 1.0, 0.0, 2.0, open_low=True),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=_get(body, "ignore_eos", bool, default=False),
        )
        _get(body, "user", str)
        include_usage = _get(stream_options, "include_usage", bool, default=False)
        return cls(model, prompt, params, stream, include_usage)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U32_MAX


def _get(body: dict[str, Any], name: str, kind: type, *, required: bool = False,
         default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise RequestError(f"'{name}' is required", param=name)
        return default
    # bool is an int in Python; JSON true is not a token count.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(f"'{name}' must be of type {kind.__name__}", param=name)
    return value


def _bounded(value: int, name: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be in [{low}, {high}], got {value}", param=name)
    return value


def _num(body: dict[str, Any], name: str, default: float, low: float, high: float, *,
         open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a number", param=name)
    if value > high or value < low or (open_low and value == low):
        bracket = "(" if open_low else "["
        raise RequestError(f"'{name}' must be in {bracket}{low}, {high}], got {value}", param=name)
    return float(value)


class CompletionsHandler:
    def __init__(self, service: Service, model_name: str) -> None:
        self.service = service
        self.model_name = model_name

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from exc
        req = CompletionRequest.parse(body)
        if req.model != self.model_name:
            raise ModelNotFound(f"The model `{req.model}` does not exist.", param="model",
                                code="model_not_found")
        prompt = req.prompt if isinstance(req.prompt, list) else (
            await self.service.tokenize(req.prompt))
        if not prompt:
            raise RequestError("prompt encodes to zero tokens", param="prompt")
        self.service.check_length(len(prompt), req.params.max_tokens)
        meta = _Meta(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, len(prompt))
        # aclosing: however the handler ends (a client that went away cancels
        # it), the generator's cleanup runs now and sends the cancel record.
        async with contextlib.aclosing(self.service.generate(prompt, req.params)) as deltas:
            if req.stream:
                return await self._stream(request, req, meta, deltas)
            text: list[str] = []
            last: Delta | None = None
            async for delta in deltas:
                text.append(delta.text)
                last = delta
        if last is None:
            raise PeerError("GPU peer ended the stream without a final record")
        return web.json_response(meta.chunk("".join(text), last.finish_reason) | {
            "usage": meta.usage(last.completion_tokens)})

    async def _stream(self, request: web.Request, req: CompletionRequest, meta: _Meta,
                      deltas: AsyncIterator[Delta]) -> web.StreamResponse:
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no"})
        await response.prepare(request)
        completion_tokens = 0
        extra = {"usage": None} if req.include_usage else {}
        try:
            async for delta in deltas:
                completion_tokens = delta.completion_tokens
                if delta.text or delta.finish_reason:
                    # One write per event: aiohttp applies backpressure in write().
                    await _event(response, meta.chunk(delta.text, delta.finish_reason) | extra)
            if req.include_usage:
                await _event(response, meta.envelope([]) | {
                    "usage": meta.usage(completion_tokens)})
        except (RequestError, PeerError) as exc:
            # Headers are gone: the error becomes an event, then the stream ends.
            await _event(response, body_for(exc)[1])
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")


@dataclass(frozen=True, slots=True)
class _Meta:
    id: str
    created: int
    model: str
    prompt_tokens: int

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self.envelope([{"index": 0, "text": text, "logprobs": None,
                               "finish_reason": finish_reason}])

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}
