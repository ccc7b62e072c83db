"""Regression tests for the defects of issue 10, through the real app over loopback peers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer
from pytest_aiohttp import AiohttpClient

import dpu_frontend.engine.service as service_module
from dpu_frontend.config import ServeConfig
from dpu_frontend.daemon import Daemon
from dpu_frontend.http.errors import boundary
from dpu_frontend.metrics import Metrics, RequestTimer
from dpu_frontend.ring import FinishReason
from dpu_frontend.text.chat_template import MAX_NESTING
from dpu_frontend.text.stop import StopMatcher
from dpu_frontend.text.tokenizer import COUNT_CHUNK_CHARS, Vocabulary
from tests.engine.loopback import LoopbackPeer
from tests.http.conftest import MODEL, Factory, Frontend, events, ids, start_daemon

GENERATION = ["/v1/completions", "/v1/chat/completions"]
BODY_ROUTES = [*GENERATION, "/tokenize", "/detokenize"]


def assert_error(status: int, body: Any, expected: int, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
    """One OpenAI-style error body, and nothing else."""
    assert status == expected, body
    assert body == {"error": {"message": body["error"]["message"], "type": type_,
                              "param": param, "code": code}}
    assert body["error"]["message"]


async def post_raw(front: Frontend, path: str, raw: bytes) -> tuple[int, Any]:
    resp = await front.client.post(path, data=raw, headers={"Content-Type": "application/json"})
    return resp.status, await resp.json()


# -- defect 1: malformed bodies are 400, never 500 ------------------------------------


@pytest.mark.parametrize("path", BODY_ROUTES)
@pytest.mark.parametrize(("raw", "says"), [
    (b"[" * 100_000, "nested too deeply"),
    (b'{"model": "qwen3", "prompt": "caf\xe9"}', "not UTF-8"),
    (b'{"model": "qwen3", "prompt": "a\\ud800", "messages": [], "tokens": []}', "surrogate"),
])
async def test_malformed_bodies_get_400(make_frontend: Factory, path: str, raw: bytes,
                                        says: str) -> None:
    front = await make_frontend()
    status, body = await post_raw(front, path, raw)
    assert_error(status, body, 400)
    assert says in body["error"]["message"]
    assert front.metrics.registry.get_sample_value(
        "dpu_frontend_requests_total",
        {"endpoint": path, "status": "400", "finish_reason": "none"}) == 1


async def test_deep_nesting_inside_a_valid_request_is_400(make_frontend: Factory) -> None:
    front = await make_frontend()
    deep = b"[" * 5000 + b"]" * 5000
    raw = b'{"model": "qwen3", "messages": [{"role": "user", "content": "x"}], ' \
          b'"chat_template_kwargs": {"k": ' + deep + b"}}"
    status, body = await post_raw(front, "/v1/chat/completions", raw)
    assert_error(status, body, 400)
    assert body["error"]["message"] == ("request body is not valid JSON: nested too deeply "
                                        f"(more than {MAX_NESTING} levels of arrays and objects)")
    assert not front.gpu.arrivals


async def test_nesting_at_the_limit_is_served(make_frontend: Factory) -> None:
    """``MAX_NESTING`` levels in all (the body is one, ``chat_template_kwargs`` another)."""
    front = await make_frontend()
    inner = MAX_NESTING - 2
    raw = b'{"model": "qwen3", "messages": [{"role": "user", "content": "x"}], ' \
          b'"max_tokens": 1, "chat_template_kwargs": {"k": ' + b"[" * inner + b"]" * inner + b"}}"
    request = asyncio.create_task(front.client.post(
        "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}))
    async with asyncio.timeout(60):  # before the bound, a 3.13 server took 5,000 levels
        (arrival,) = await front.gpu.wait_for(1)
    front.gpu.finish(arrival.record.request_id, (6,))
    assert (await request).status == 200


# -- defect 2: a body over max_request_bytes is 413, before it is read ------------------


async def exchange_raw(server: BaseTestServer, head: bytes, body: bytes = b"", *,
                       until_close: bool = False) -> bytes:
    """Send ``head`` (and ``body``) on a socket of its own; the whole response as it came
    on the wire, or everything until the server closed the connection. The guard only
    fails a test that would otherwise hang."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(head + b"\r\n\r\n" + body)
        async with asyncio.timeout(60):
            if until_close:
                return await reader.read()
            raw = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in raw.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is not None:
                return raw + await reader.readexactly(length)
            return raw + await reader.readuntil(b"\r\n0\r\n\r\n")  # the last chunk
    finally:
        writer.close()
        await writer.wait_closed()


def split_response(raw: bytes) -> tuple[list[bytes], dict[str, str], bytes]:
    """Status lines found anywhere in ``raw``, the headers, and the body (de-chunked)."""
    status_lines = [line for line in raw.split(b"\r\n") if line.startswith(b"HTTP/1.")]
    head, _, rest = raw.partition(b"\r\n\r\n")
    headers = dict(line.decode().split(": ", 1) for line in head.split(b"\r\n")[1:])
    if headers.get("Transfer-Encoding") != "chunked":
        return status_lines, headers, rest
    body = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n", rest  # nothing after the last chunk
            return status_lines, headers, body
        body, rest = body + rest[:size], rest[size + 2:]


@pytest.mark.parametrize("path", BODY_ROUTES)
async def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(
        make_frontend: Factory, path: str) -> None:
    """Headers only: a server that read the body would wait for it; 413 comes at once."""
    front = await make_frontend()
    limit = ServeConfig().max_request_bytes
    assert limit < 10_000_000  # "a 10 MB body gets 413"
    raw = await exchange_raw(front.client.server, f"POST {path} HTTP/1.1\r\nHost: x\r\n"
                                    f"Content-Type: application/json\r\n"
                                    f"Content-Length: 10000000".encode())
    status_lines, headers, body = split_response(raw)
    # Python 3.13 renamed 413 "Content Too Large" (RFC 9110); aiohttp takes http's phrase
    assert status_lines == [f"HTTP/1.1 413 {HTTPStatus(413).phrase}".encode()]
    assert headers["Content-Type"].startswith("application/json")
    assert_error(413, json.loads(body), 413, code="request_too_large")
    assert str(limit) in json.loads(body)["error"]["message"]


async def test_a_chunked_body_is_cut_off_at_the_limit(make_frontend: Factory) -> None:
    front = await make_frontend(max_request_bytes=1024)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "qwen3", "prompt": "'
        for _ in range(1000):  # 1 MB in all, with no Content-Length
            yield b"x" * 1000
        yield b'"}'

    resp = await front.client.post("/v1/completions", data=chunks())
    assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
    assert_error(resp.status, await resp.json(), 413, code="request_too_large")
    assert "1024 bytes" in (await resp.json())["error"]["message"]
    assert not front.gpu.arrivals


async def test_a_body_at_the_limit_is_served(make_frontend: Factory) -> None:
    front = await make_frontend(max_request_bytes=1024)
    body = json.dumps({"model": MODEL, "prompt": [5], "max_tokens": 1}).encode()
    body += b" " * (1024 - len(body))
    request = asyncio.create_task(front.client.post(
        "/v1/completions", data=body, headers={"Content-Type": "application/json"}))
    (arrival,) = await front.gpu.wait_for(1)
    front.gpu.finish(arrival.record.request_id, (6,))
    assert (await request).status == 200
    over = await front.client.post("/v1/completions", data=body + b" ",
                                   headers={"Content-Type": "application/json"})
    assert_error(over.status, await over.json(), 413, code="request_too_large")


# -- defect 2: a prompt that cannot fit is refused cheaply, naming its parameter ---------


def chat_body(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **fields}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 64}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[5], [5] * 70]}, "prompt"),
    ("/v1/chat/completions", chat_body("hi " * 70), "messages"),
])
async def test_the_context_error_names_the_right_parameter(
        make_frontend: Factory, path: str, body: dict[str, Any], param: str) -> None:
    front = await make_frontend(max_model_len=64)
    resp = await front.client.post(path, json=body)
    assert_error(resp.status, await resp.json(), 400, param=param,
                 code="context_length_exceeded")
    assert "maximum context length is 64 tokens" in (await resp.json())["error"]["message"]
    assert not front.gpu.arrivals


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 60, "max_tokens": 5}),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 50}),  # the default 16
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 60, "max_tokens": 2**32 - 1}),
    ("/v1/chat/completions", chat_body("hi", max_tokens=60)),
    ("/v1/chat/completions", chat_body("hi", max_completion_tokens=60)),
])
async def test_max_tokens_past_the_context_is_capped_at_its_end(
        make_frontend: Factory, path: str, body: dict[str, Any]) -> None:
    """A prompt that leaves room is served: the completion may run to the end of the
    context and no further, and then ends with finish_reason "length"."""
    front = await make_frontend(max_model_len=64)
    answering = asyncio.create_task(front.client.post(path, json=body))  # not streamed
    (arrival,) = await front.gpu.wait_for(1)
    assert arrival.record.params.max_tokens == 64 - len(arrival.prompt)
    front.gpu.finish(arrival.record.request_id, (5,), finish=FinishReason.LENGTH)
    resp = await answering
    answer = await resp.json()
    assert resp.status == 200 and answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("path", "make_body", "param"), [
    ("/v1/completions", lambda text: {"model": MODEL, "prompt": text}, "prompt"),
    ("/v1/completions", lambda text: {"model": MODEL, "prompt": ["hi", text]}, "prompt"),
    ("/v1/chat/completions", chat_body, "messages"),
])
async def test_a_prompt_of_too_many_characters_is_refused_untokenized(
        make_frontend: Factory, monkeypatch: pytest.MonkeyPatch, path: str,
        make_body: Any, param: str) -> None:
    """No token of the vocabulary stands for more than max_token_chars characters."""
    front = await make_frontend(max_model_len=64)
    most = front.service.vocab.max_token_chars
    assert most == 192  # Qwen3: 128 bytes, NFC composing at most 1.5 characters a byte
    tokenized: list[int] = []
    encode = front.service._encode

    def recording(text: str, add_special_tokens: bool) -> list[int]:
        tokenized.append(len(text))
        return encode(text, add_special_tokens)

    monkeypatch.setattr(front.service, "_encode", recording)
    resp = await front.client.post(path, json=make_body("x" * (most * 63 + 1)))
    body = await resp.json()
    assert_error(resp.status, body, 400, param=param, code="context_length_exceeded")
    assert re.search(r"your prompt is \d+ characters long", body["error"]["message"])
    assert all(n == len("hi") for n in tokenized)  # the other prompt at most, never this one


async def test_counting_stops_once_the_prompt_cannot_fit(
        make_frontend: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    front = await make_frontend(max_model_len=1000)
    service = front.service
    assert service.vocab.max_token_chars is not None
    text = "hello world " * 15_000  # 180,000 characters, 30,000 tokens
    assert len(text) < service.vocab.max_token_chars * 999  # past the character bound
    seen: list[int] = []
    real = service._tokenizer

    class Recording:
        """The tokenizer, recording the length of each text it encodes."""

        def encode_batch(self, texts: list[str], add_special_tokens: bool) -> Any:
            seen.extend(len(t) for t in texts)
            return real.encode_batch(texts, add_special_tokens=add_special_tokens)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    monkeypatch.setattr(service, "_tokenizer", Recording())
    resp = await front.client.post("/v1/completions", json={"model": MODEL, "prompt": text})
    body = await resp.json()
    assert_error(resp.status, body, 400, param="prompt", code="context_length_exceeded")
    assert "at least" in body["error"]["message"]
    assert len(seen) == 1 and seen[0] <= COUNT_CHUNK_CHARS  # one chunk, never the whole
    # One likely to fit (its first chunk projects to 547 tokens) is tokenized whole next.
    seen.clear()
    fits = " " * 70_000  # 547 tokens of up to 128 spaces
    request = asyncio.create_task(front.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": fits, "max_tokens": 1}))
    (arrival,) = await front.gpu.wait_for(1)
    assert list(arrival.prompt) == service.vocab.encode(fits)
    front.gpu.finish(arrival.record.request_id, (6,))
    assert (await request).status == 200
    assert seen == [COUNT_CHUNK_CHARS, len(fits)]
    # One no longer than a chunk is tokenized whole at once.
    seen.clear()
    short = "hello world " * 400  # 4,800 characters, 800 tokens
    request = asyncio.create_task(front.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": short, "max_tokens": 1}))
    (_, arrival) = await front.gpu.wait_for(2)
    front.gpu.finish(arrival.record.request_id, (6,))
    assert (await request).status == 200
    assert seen == [len(short)]


# -- defect 3: a failure after the stream started ends it with an error event -----------


async def post_on_the_wire(front: Frontend, path: str, body: dict[str, Any]) -> bytes:
    """Everything the server writes until it closes the connection."""
    data = json.dumps(body).encode()
    return await exchange_raw(front.client.server, f"POST {path} HTTP/1.1\r\nHost: x\r\n"
                                     f"Connection: close\r\nContent-Type: application/json\r\n"
                                     f"Content-Length: {len(data)}".encode(), data,
                              until_close=True)


def sse_events(body: bytes) -> list[Any]:
    """Each ``data:`` payload: parsed JSON, or the string ``[DONE]``."""
    events: list[Any] = []
    for block in body.decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), body
            payload = block.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.mark.parametrize("path", GENERATION)
async def test_an_unexpected_error_mid_stream_ends_it_with_an_error_event(
        make_frontend: Factory, vocab: Vocabulary, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, path: str) -> None:
    front = await make_frontend()
    on_delta = RequestTimer.on_delta
    calls = 0

    def failing_on_delta(self: RequestTimer, index: int, completion_tokens: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("a bug in building the second chunk")
        on_delta(self, index, completion_tokens)

    monkeypatch.setattr(RequestTimer, "on_delta", failing_on_delta)
    body = {"model": MODEL, "max_tokens": 100, "stream": True} | (
        {"prompt": "Hi"} if path == "/v1/completions" else
        {"messages": [{"role": "user", "content": "Hi"}]})
    wire = asyncio.create_task(post_on_the_wire(front, path, body))
    (arrival,) = await front.gpu.wait_for(1)
    request_id = arrival.record.request_id
    front.gpu.emit(request_id, ids(vocab, " Hello"))
    front.gpu.emit(request_id, ids(vocab, " world"))
    status_lines, headers, raw_body = split_response(await wire)
    assert status_lines == [b"HTTP/1.1 200 OK"]  # and no second one inside the body
    assert headers["Content-Type"] == "text/event-stream"
    events = sse_events(raw_body)
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "internal server error", "type": "internal_error",
                                    "param": None, "code": 500}}
    texts = [e["choices"][0].get("text", e["choices"][0].get("delta", {}).get("content"))
             for e in events[:-2]]
    assert texts[-1] == " Hello" and len(texts) == (1 if path == "/v1/completions" else 2)
    # Logged with its traceback, counted, and the generation cancelled on the GPU.
    (logged,) = [r for r in caplog.records if r.exc_info is not None]
    assert logged.name == "dpu_frontend.http" and "after its stream started" in logged.message
    assert "a bug in building the second chunk" in str(logged.exc_info[1] if logged.exc_info
                                                       else None)
    assert front.aborted("internal_error") == 1
    assert front.metrics.registry.get_sample_value(
        "dpu_frontend_requests_total",
        {"endpoint": path, "status": "200", "finish_reason": "error"}) == 1
    await front.gpu.wait_for(1, cancels=1)
    assert front.gpu.cancels == [request_id]


async def test_the_boundary_never_answers_a_started_response_twice(
        aiohttp_client: AiohttpClient) -> None:
    """Should a failure escape a handler after its response began, the boundary lets
    aiohttp close the connection rather than write a 500 into the body."""

    async def broken(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: first\n\n")
        raise RuntimeError("escaped after prepare")

    app = web.Application(middlewares=[boundary(Metrics())])
    app.router.add_post("/broken", broken)
    client = await aiohttp_client(app)
    raw = await exchange_raw(client.server, b"POST /broken HTTP/1.1\r\nHost: x\r\n"
                                            b"Connection: close\r\nContent-Length: 0",
                             until_close=True)
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n") and raw.count(b"HTTP/1.") == 1
    assert raw.endswith(b"data: first\n\n\r\n")  # cut off: no [DONE] could be written


# -- defect 4: nothing reaches the GPU for a request that failed to be built ------------


@pytest.mark.parametrize("n", [1, 3])
async def test_a_generation_that_fails_to_be_built_leaves_nothing_on_the_gpu(
        make_frontend: Factory, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The last choice's stop matcher fails: the others were submitted and are cancelled,
    and the failing one was never submitted."""
    front = await make_frontend()
    built = 0

    def stop_matcher(*args: Any, **kwargs: Any) -> StopMatcher:
        nonlocal built
        built += 1
        if built == n:
            raise RuntimeError("cannot build the stop matcher")
        return StopMatcher(*args, **kwargs)

    monkeypatch.setattr(service_module, "StopMatcher", stop_matcher)
    resp = await front.client.post("/v1/completions", json={
        "model": MODEL, "prompt": [5, 6], "max_tokens": 1000, "n": n, "stop": ["x"]})
    assert_error(resp.status, await resp.json(), 500, type_="internal_error", code=500)
    await front.gpu.wait_exchanges(2)  # what was queued has reached the GPU by now
    arrivals = front.gpu.arrivals
    assert len(arrivals) <= n - 1
    assert all(arrival.cancelled for arrival in arrivals.values())
    for request_id in arrivals:
        front.gpu.finish(request_id, finish=FinishReason.CANCELLED)
    await front.service.pool.wait_idle()
    assert front.service.pool.in_flight == 0


# -- defect 5: the smaller ones ---------------------------------------------------------


async def test_openapi_lists_every_status_a_body_route_answers(make_frontend: Factory) -> None:
    front = await make_frontend()
    spec = await (await front.client.get("/openapi.json")).json()
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, statuses in [("/v1/completions", {"400", "404", "413", "429", "503"}),
                           ("/v1/chat/completions", {"400", "404", "413", "429", "503"}),
                           ("/tokenize", {"400", "404", "413"}),
                           ("/detokenize", {"400", "404", "413"})]:
        responses = spec["paths"][path]["post"]["responses"]
        assert set(responses) == {"200"} | statuses, path
        for status in statuses:
            assert responses[status]["content"]["application/json"]["schema"] == error


async def test_openapi_names_the_served_model_and_bounds_token_ids_by_the_vocabulary(
        make_frontend: Factory, vocab: Vocabulary) -> None:
    """A request the document allows is one the daemon serves: an unknown model and an id
    outside the vocabulary are refused by the schema already."""
    front = await make_frontend()
    schemas = (await (await front.client.get("/openapi.json")).json())["components"]["schemas"]
    served = {"const": MODEL, "description": "the served model's name"}
    assert schemas["CompletionRequest"]["properties"]["model"] == served
    assert schemas["TokenizeChatRequest"]["properties"]["model"]["anyOf"][0] == served
    top = vocab.tokenizer.get_vocab_size() - 1
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == {
        "type": "integer", "minimum": 0, "maximum": top}
    assert "x-token-id" not in json.dumps(schemas)


@pytest.mark.parametrize("method", ["TRACE", "PUT", "DELETE"])
async def test_a_405_says_which_methods_are_allowed(make_frontend: Factory, method: str) -> None:
    """RFC 9110 section 15.5.6: a 405 carries Allow, beside OpenAI's error body."""
    front = await make_frontend()
    for path, allowed in [("/v1/completions", "POST"), ("/v1/models", "GET")]:
        resp = await front.client.request(method, path)
        assert_error(resp.status, await resp.json(), 405, code=405)
        assert allowed in resp.headers["Allow"]


async def test_a_negative_seed_reaches_the_gpu_as_a_u64(make_frontend: Factory) -> None:
    front = await make_frontend()
    request = asyncio.create_task(front.client.post("/v1/completions", json={
        "model": MODEL, "prompt": [5], "max_tokens": 1, "n": 2, "seed": -1}))
    arrivals = await front.gpu.wait_for(2)
    # Two's complement, and the second choice's seed + 1 wraps to 0.
    assert [a.record.params.seed for a in arrivals] == [2**64 - 1, 0]
    for arrival in arrivals:
        front.gpu.finish(arrival.record.request_id, (6,), FinishReason.LENGTH)
    resp = await request
    assert resp.status == 200
    assert [c["finish_reason"] for c in (await resp.json())["choices"]] == ["length", "length"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_template_kwargs_naming_a_render_argument_get_400(
        make_frontend: Factory, path: str) -> None:
    front = await make_frontend()
    resp = await front.client.post(path, json=chat_body(
        "hi", chat_template_kwargs={"add_generation_prompt": False}))
    body = await resp.json()
    assert_error(resp.status, body, 400, param="chat_template_kwargs")
    assert "'add_generation_prompt'" in body["error"]["message"]
    assert not front.gpu.arrivals


async def test_an_unstreamed_answer_that_overflows_its_buffer_is_a_503(
        make_frontend: Factory, vocab: Vocabulary) -> None:
    """Nobody but the daemon reads a non-streamed answer: if a whole buffer of records
    piles up (here one poll returns three, over a buffer of one), the daemon fell behind,
    a transient overload of the server: 503 with Retry-After, never a 408."""
    front = await make_frontend(stream_buffer_records=1)
    request = asyncio.create_task(front.client.post("/v1/completions", json={
        "model": MODEL, "prompt": [5], "max_tokens": 100}))
    (arrival,) = await front.gpu.wait_for(1)
    for word in (" one", " two", " three"):
        front.gpu.emit(arrival.record.request_id, tuple(vocab.encode(word)))
    resp = await request
    assert resp.headers["Retry-After"] == "1"
    body = await resp.json()
    assert_error(resp.status, body, 503, type_="client_too_slow", code="stream_buffer_overflow")
    assert "the daemon fell behind" in body["error"]["message"]
    await front.gpu.wait_for(1, cancels=1)
    assert front.aborted("client_too_slow") == 1


async def test_a_stream_that_overflows_its_buffer_ends_with_an_error_event(
        make_frontend: Factory, vocab: Vocabulary) -> None:
    front = await make_frontend(stream_buffer_records=1)
    resp = await front.client.post("/v1/completions", json={
        "model": MODEL, "prompt": [5], "max_tokens": 100, "stream": True})
    assert resp.status == 200
    (arrival,) = await front.gpu.wait_for(1)
    for word in (" one", " two", " three"):
        front.gpu.emit(arrival.record.request_id, tuple(vocab.encode(word)))
    error = (await events(resp))[-1]["error"]
    assert error["type"] == "client_too_slow" and error["code"] == "stream_buffer_overflow"
    assert "client read too slowly" in error["message"]


async def test_a_body_that_trickles_gets_408_and_the_connection_closed(
        daemons: list[Daemon], peer: LoopbackPeer) -> None:
    """A slow POST: the head in time, then a byte of the body now and then. The head's
    idle timer no longer runs; body_timeout_s bounds the rest, and the connection is
    closed after the answer (within the daemon's 2 s linger)."""
    daemon = await start_daemon(daemons, peer, body_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)

    async def drip() -> None:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        for _ in range(200):
            writer.write(b" ")
            await asyncio.sleep(0.05)

    dripping = asyncio.create_task(drip())
    try:
        answer = b""
        async with asyncio.timeout(5):
            # To the end: the daemon closes the connection after its linger. A byte the
            # client drips after that close is answered with a reset, which may come
            # before the FIN is read; the answer came seconds before either.
            with contextlib.suppress(ConnectionResetError):
                while chunk := await reader.read(65536):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 408")
        body = answer.partition(b"\r\n\r\n")[2]
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert not dripping.done()  # cut off while the client was still sending
    finally:
        dripping.cancel()
        writer.close()
    assert not peer.gpu.arrivals
