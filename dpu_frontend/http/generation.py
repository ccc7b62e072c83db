"""The one request path both generation endpoints share.

``/v1/completions`` and ``/v1/chat/completions`` differ in how a request
becomes prompts (token ids) and in the JSON of their answers; everything else
(validation, the context check, sampling parameters, n choices, streaming
with backpressure, usage, the error event) is here, once.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring as _encode_string
from typing import Any, Generic, TypeVar

from aiohttp import HttpVersion11, hdrs, web

from dpu_frontend.engine.choices import start_choices
from dpu_frontend.engine.service import Delta, DeltaSink, Service, TextOptions, TokenLogprob
from dpu_frontend.errors import ClientTooSlow, PeerError, RequestError
from dpu_frontend.http.errors import (
    CLIENT_GONE,
    FINISH_REASON,
    STREAMED_BYTES,
    body_for,
    random_hex,
)
from dpu_frontend.http.schemas import SamplingFields, check_model, parse
from dpu_frontend.metrics import RequestTimer
from dpu_frontend.ring import SamplingParams
from dpu_frontend.text.chat_output import ChatOutputs
from dpu_frontend.text.constraints import ConstraintSpec

log = logging.getLogger("dpu_frontend.http")

Request = TypeVar("Request", bound=SamplingFields)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


@dataclass(slots=True)
class Job:
    """One validated request on its way to the GPU side."""

    id: str
    created: int
    model: str
    prompts: list[list[int]]
    n: int
    usage_each_chunk: bool
    wants_logprobs: bool = False
    completion_tokens: dict[int, int] = field(default_factory=dict)
    #: Each choice's log probabilities, gathered for a non-streamed answer.
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    error: bool = False
    client_gone: bool = False
    #: A chat answer's split into reasoning, content and tool calls, where the request
    #: and the daemon ask for one: every event is then shaped by it (no plain-text path).
    outputs: ChatOutputs | None = None

    @property
    def finish_reason(self) -> str:
        """For the request counter: the first choice's, or ``error``."""
        if self.error:
            return "error"
        return self.finish.get(0, "none")

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def usage(self) -> dict[str, int]:
        done = sum(self.completion_tokens.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}


class GenerationHandler(abc.ABC, Generic[Request]):
    model_type: type[Request]
    id_prefix: str  # "cmpl", "chatcmpl"
    prompt_param: str  # the parameter that holds the prompt: "prompt", "messages"
    chunk_object: str  # the "object" of streamed events

    def __init__(self, service: Service, model_name: str) -> None:
        self.service = service
        self.model_name = model_name

    # -- what each endpoint defines ------------------------------------------

    @abc.abstractmethod
    async def prompts(self, req: Request) -> list[list[int]]:
        """The request's prompts as token ids."""

    @abc.abstractmethod
    def default_max_tokens(self, prompt_tokens: int) -> int:
        """``max_tokens`` when the request gives none."""

    @abc.abstractmethod
    def requested_max_tokens(self, req: Request) -> int | None:
        """``max_tokens`` as the request gives it."""

    @abc.abstractmethod
    def chunk(self, job: Job, delta: Delta) -> dict[str, Any]:
        """One streamed event for ``delta``."""

    def opening(self, job: Job) -> list[dict[str, Any]]:
        """Events sent before any generated text (chat: the role of each choice)."""
        return []

    def outputs(self, req: Request, prompts: list[list[int]]) -> ChatOutputs | None:
        """How the answers' text splits (chat: reasoning, tool calls); None: plain text."""
        return None

    def chunks(self, job: Job, delta: Delta) -> list[dict[str, Any]]:
        """The streamed events of ``delta`` where ``job.outputs`` shapes them (any number,
        none while text is held back)."""
        return [self.chunk(job, delta)]

    @abc.abstractmethod
    def answer(self, job: Job, texts: dict[int, str], finish: dict[int, str]) -> dict[str, Any]:
        """The non-streamed response body."""

    def constraint(self, req: Request) -> ConstraintSpec | None:
        """The structured output ``req`` asks for, if any."""
        return req.constraint()

    @abc.abstractmethod
    def logprobs_json(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """``choices[i].logprobs`` in this endpoint's shape."""

    def choice_logprobs(self, job: Job, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """``choices[i].logprobs``: null unless the request asked for them."""
        return self.logprobs_json(entries) if job.wants_logprobs else None

    # -- the shared path ------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        req = parse(self.model_type, await request.read())
        check_model(req.model, self.model_name)
        prompts = await self.prompts(req)
        if any(not p for p in prompts):
            raise RequestError("prompt encodes to zero tokens", param=self.prompt_param)
        for prompt in prompts:
            self.service.check_ids(prompt, self.prompt_param)
        self.service.check_ids(req.stop_token_ids, "stop_token_ids")
        spec = self.constraint(req)
        longest = max(len(p) for p in prompts)
        max_tokens = self.service.fit(longest, self.requested_max_tokens(req)
                                      or max(1, self.default_max_tokens(longest)),
                                      self.prompt_param)
        each_chunk = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        job = Job(f"{self.id_prefix}-{random_hex(32)}", int(time.time()), self.model_name,
                  prompts, req.n, each_chunk, req.top_logprobs_wanted is not None,
                  outputs=self.outputs(req, prompts))
        options = TextOptions(tuple(req.stop_strings), req.include_stop_str_in_output,
                              req.skip_special_tokens)
        # Compiled (or found in the cache) before anything is submitted: a constraint that
        # cannot be served is the request's 400, with nothing started on the GPU.
        constraint = await self.service.constraint(spec) if spec is not None else None
        choices = start_choices(self.service, prompts, sampling_params(req, max_tokens), req.n,
                                options, constraint)
        metrics = self.service.metrics
        timer = metrics.request(arrival)
        try:
            async with contextlib.aclosing(choices.batches()) as batches:
                if req.stream:
                    response = await self._stream(request, job, batches, timer,
                                                  req.include_usage, choices.attach)
                else:
                    response = await self._collect(job, batches, timer)
        except asyncio.CancelledError:
            job.client_gone = True
            raise
        finally:
            # However this handler ends (a client that went away cancels it), every
            # sequence still generating is cancelled on the GPU side now.
            choices.cancel()
            timer.finish(job.prompt_tokens)
            if job.client_gone:
                metrics.disconnected.inc()
                metrics.aborted.labels("client_disconnected").inc()
                request[CLIENT_GONE] = True
        request[FINISH_REASON] = job.finish_reason
        return response

    async def _collect(self, job: Job, batches: AsyncIterator[list[Delta]],
                       timer: RequestTimer) -> web.Response:
        texts: dict[int, list[str]] = {}
        finish = job.finish
        try:
            async for batch in batches:
                for delta in batch:
                    timer.on_delta(delta.index, delta.completion_tokens)
                    texts.setdefault(delta.index, []).append(delta.text)
                    if job.wants_logprobs:
                        job.logprobs.setdefault(delta.index, []).extend(delta.logprobs)
                    job.completion_tokens[delta.index] = delta.completion_tokens
                    if delta.finish_reason is not None:
                        finish[delta.index] = delta.finish_reason
        except ClientTooSlow as exc:
            raise ClientTooSlow("the daemon fell behind this request's output (a whole "
                                "buffer of records) and cancelled it; try again",
                                code=exc.code) from exc
        if len(finish) != len(job.prompts) * job.n:
            raise PeerError("GPU peer ended a sequence without a final record")
        body = self.answer(job, {i: "".join(t) for i, t in texts.items()}, finish)
        return web.json_response(body | {"usage": job.usage()})

    async def _stream(self, request: web.Request, job: Job,
                      batches: AsyncIterator[list[Delta]], timer: RequestTimer,
                      include_usage: bool, attach: Callable[[DeltaSink], bool],
                      ) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        if request.version < HttpVersion11:
            # No chunked coding before HTTP/1.1: the stream's end is the connection's,
            # even where the client asked to keep it alive.
            response.force_close()
        await response.prepare(request)
        direct = _DirectWriter.where_possible(request, response, job, timer, attach)
        # The status line is on the wire: from here every failure but a cancellation
        # ends the stream with an error event and [DONE]; none may reach the error
        # boundary, which would answer it with a second status line.
        try:
            try:
                await self._events(response, job, batches, timer, include_usage, direct)
            except ConnectionResetError:
                raise
            except (RequestError, PeerError) as exc:
                job.error = True
                await _send(response, body_for(exc)[1])
            except Exception as exc:
                job.error = True
                log.exception("%s failed after its stream started", job.id)
                self.service.metrics.aborted.labels("internal_error").inc()
                await _send(response, body_for(exc)[1])
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            job.client_gone = True  # the client closed the connection under a write
        except Exception:
            job.error = True  # the error event itself could not be written: give up
            log.exception("%s: cannot end its stream", job.id)
        finally:
            if direct is not None and direct.sent:
                request[STREAMED_BYTES] = direct.sent
        return response

    async def _events(self, response: web.StreamResponse, job: Job,
                      batches: AsyncIterator[list[Delta]], timer: RequestTimer,
                      include_usage: bool, direct: _DirectWriter | None) -> None:
        """An event a delta; the events of one batch (one poll's records) in one write:
        one system call for the lot, so that a daemon that fell behind catches up
        cheaper. After the first write, a plain-text stream has the poll loop write its
        events (``_DirectWriter``) where the engine can: this loop then runs for the
        last one, and for those that came while the connection was backed up."""
        def usage() -> dict[str, Any]:
            """The ``usage`` field of a chunk: absent, null, or the counts so far."""
            if not include_usage:
                return {}
            return {"usage": job.usage() if job.usage_each_chunk else None}

        for event in self.opening(job):
            await _send(response, event | usage())
        # The chunk of plain text (no finish, no log probabilities, usage absent or
        # null) is the same bytes each time but for the text: rendered once per choice,
        # then filled in (one event a token; the whole chunk as JSON cost 3.5 us).
        templates: dict[int, tuple[bytes, bytes]] = {}

        def template(index: int) -> tuple[bytes, bytes]:
            found = templates.get(index)
            if found is None:
                found = templates[index] = self._template(job, index, usage())
            return found

        plain = not job.usage_each_chunk
        outputs = job.outputs
        async for batch in batches:
            events: list[bytes] = []
            try:
                for delta in batch:
                    timer.on_delta(delta.index, delta.completion_tokens)
                    job.completion_tokens[delta.index] = delta.completion_tokens
                    if delta.finish_reason is not None:
                        job.finish[delta.index] = delta.finish_reason
                    if (delta.finish_reason is None and plain and delta.text
                            and not delta.logprobs
                            and (outputs is None or outputs.passthrough(delta.index))):
                        before, after = template(delta.index)
                        events.append(before + _json_string(delta.text) + after)
                    elif outputs is not None:
                        events.extend(_event(c | usage()) for c in self.chunks(job, delta))
                    elif delta.text or delta.finish_reason or delta.logprobs:
                        events.append(_event(self.chunk(job, delta) | usage()))
            except Exception:
                if events:  # the events before the failure go out before its error event
                    await response.write(b"".join(events))
                raise
            if events:
                timer.on_write(batch[0].received)
                # One awaited write a batch: aiohttp applies backpressure here.
                await response.write(b"".join(events))
                if (direct is not None and plain and not direct.started
                        and (outputs is None or outputs.passthrough(0))):
                    # After the first event, in order behind it: from here the events
                    # of plain-text deltas may go straight onto the connection.
                    direct.start(template(0))
        if include_usage:
            await _send(response, envelope(job, self.chunk_object, []) | {"usage": job.usage()})

    def _template(self, job: Job, index: int, usage: dict[str, Any]) -> tuple[bytes, bytes]:
        """The event of a plain-text delta of choice ``index``, as the bytes before and
        after its text's JSON string: ``self.chunk`` rendered around a marker."""
        event = _event(self.chunk(job, Delta(index, _MARK, None, 0)) | usage)
        before, marker, after = event.partition(_json_string(_MARK))
        if not marker or _json_string(_MARK) in after:
            raise RuntimeError(f"{type(self).__name__}.chunk must hold the text once")
        return before, after


class _DirectWriter:
    """Writes the events of a plain-text stream from the poll loop (a ``DeltaSink``):
    no wake-up of the handler, no await, one ``transport.write`` an event.

    Only while the transport's write buffer is empty, so that nothing waits: when the
    client falls behind, ``ready`` is False and the handler writes, through aiohttp,
    which waits for it (and the stream buffer cuts it off in the end). Over TLS the
    transport's buffer is the TLS layer's, which fills only once the socket's own
    (some 64 KiB) is full: a client behind is noticed that much later. The event
    bytes are the handler's own template; the framing is HTTP/1.1's chunked transfer
    coding where aiohttp chose it for the response, as its own writer frames.
    """

    __slots__ = ("_attach", "_chunked", "_job", "_timer", "_transport", "sent", "started",
                 "template")

    def __init__(self, transport: asyncio.Transport, chunked: bool, job: Job,
                 timer: RequestTimer, attach: Callable[[DeltaSink], bool]) -> None:
        self.template = (b"", b"")  # the plain-text event around its text, from ``start``
        self.started = False
        self.sent = 0  # bytes written, framing included (as aiohttp counts its own)
        self._transport = transport
        self._chunked = chunked
        self._job = job
        self._timer = timer
        self._attach = attach  # the stream's engine side: ``Choices.attach``

    def start(self, template: tuple[bytes, bytes]) -> None:
        """Once, after the handler's first event: attach to the stream's generation, where
        it can take this writer (one choice, no stop strings, no log probabilities)."""
        self.template, self.started = template, True
        self._attach(self)

    @classmethod
    def where_possible(cls, request: web.Request, response: web.StreamResponse, job: Job,
                       timer: RequestTimer, attach: Callable[[DeltaSink], bool],
                       ) -> _DirectWriter | None:
        """One for a stream of one choice, uncompressed, on a transport; else None."""
        transport = request.transport
        if job.n != 1 or len(job.prompts) != 1 or response.compression or transport is None:
            return None
        # aiohttp frames a response of no declared length in chunks (HTTP/1.1) and says
        # so in the headers it sent; ``response.chunked`` is only what was asked of it.
        chunked = response.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"
        return cls(transport, chunked, job, timer, attach)

    def ready(self) -> bool:
        transport = self._transport
        return not transport.get_write_buffer_size() and not transport.is_closing()

    def take(self, delta: Delta) -> None:
        timer, now = self._timer, time.monotonic()
        timer.on_delta(delta.index, delta.completion_tokens, now)
        timer.on_write(delta.received, now)
        self._job.completion_tokens[delta.index] = delta.completion_tokens
        before, after = self.template
        event = before + _json_string(delta.text) + after
        if self._chunked:
            event = b"%x\r\n%b\r\n" % (len(event), event)
        self.sent += len(event)
        self._transport.write(event)


#: Stands for the text while a template is rendered. Its JSON ("\u0000dpu-frontend
#: text\u0000") is in no id, model name or usage; ``_template`` checks it is there once.
_MARK = "\x00dpu-frontend text\x00"


def _json_string(text: str) -> bytes:
    """``text`` as a JSON string, the bytes ``json.dumps(text, ensure_ascii=False)`` makes."""
    return _encode_string(text).encode()


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def envelope(job: Job, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model,
            "choices": choices}


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(_event(payload))


def sampling_params(req: SamplingFields, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos,
        logprobs=req.top_logprobs_wanted,
    )
