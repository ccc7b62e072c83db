"""The request boundary: every failure leaves as one OpenAI-style error body.

``RequestError`` becomes its 4xx, ``PeerError`` a 503, anything unexpected a
logged 500 that never takes the worker down. Each request is counted here
too, by endpoint, status and finish reason.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from dpu_frontend.errors import PeerError, RequestError, RequestTooLarge
from dpu_frontend.logs import request_id
from dpu_frontend.metrics import Metrics

log = logging.getLogger("dpu_frontend.http")

#: Where a handler leaves the finish reason of its request, for the counter.
FINISH_REASON = web.RequestKey("finish_reason", str)
REQUEST_ID = web.RequestKey("request_id", str)
#: Set by a handler whose client went away mid-answer: counted as 499.
CLIENT_GONE = web.RequestKey("client_gone", bool)
#: Bytes of a stream's events that the poll loop wrote itself, past aiohttp's count: the
#: access log's size field adds them (``http.app.AccessLog``).
STREAMED_BYTES = web.RequestKey("streamed_bytes", int)
#: nginx's status for "the client closed the request".
CLIENT_CLOSED = 499


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def body_for(exc: Exception) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, RequestError):
        return exc.status, error_body(exc.message, exc.type, exc.param, exc.code)
    if isinstance(exc, PeerError):
        return exc.status, error_body(str(exc), exc.type, None, exc.status)
    return 500, error_body("internal server error", "internal_error", None, 500)


def headers_for(exc: Exception) -> dict[str, str]:
    """``Retry-After`` for the statuses a client should retry (429, 503), and the
    ``WWW-Authenticate`` challenge of a 401."""
    headers = {}
    retry = getattr(exc, "retry_after", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    challenge = getattr(exc, "challenge", None)
    if challenge is not None:
        headers["WWW-Authenticate"] = challenge
    return headers


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``X-Request-Id`` on every response, streams included (set before the status line)."""
    response.headers.setdefault("X-Request-Id", request.get(REQUEST_ID, "-"))


def random_hex(digits: int) -> str:
    """A random id of ``digits`` hex digits: unique, not secret (a completion's id, a
    request's log id). ``uuid4`` read the OS's random source, a system call that gives
    up the GIL, which a tokenizer thread could then hold: it was 2.6% of the daemon's
    CPU samples under load (docs/benchmarks.md)."""
    return f"{random.getrandbits(4 * digits):0{digits}x}"


def boundary(metrics: Metrics) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        # Every log line about this request carries its id (the client's, or a new one).
        rid = request.headers.get("X-Request-Id", "")[:64] or random_hex(16)
        request[REQUEST_ID] = rid
        request_id.set(rid)
        try:
            response = await _answer(request, handler)
            status = CLIENT_CLOSED if request.get(CLIENT_GONE) else response.status
            return response
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        finally:
            resource = request.match_info.route.resource
            endpoint = resource.canonical if resource is not None else "other"
            metrics.requests.labels(endpoint, str(status),
                                    request.get(FINISH_REASON, "none")).inc()

    return middleware


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        if (request.content_length or 0) > request.client_max_size:
            raise RequestTooLarge(request.client_max_size)  # before reading a byte of it
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge as exc:  # a chunked body grew past the limit
            raise RequestTooLarge(request.client_max_size) from exc
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # 405 keeps its Allow header (RFC 9110 section 15.5.6 requires it).
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return web.json_response(
            error_body(exc.reason, "invalid_request_error" if exc.status < 500 else "server_error",
                       None, exc.status), status=exc.status, headers=allow)
    except (RequestError, PeerError) as exc:
        status, body = body_for(exc)
        log.info("%s %s -> %d: %s", request.method, request.path, status, exc)
        response = web.json_response(body, status=status, headers=headers_for(exc))
        if getattr(exc, "close_connection", False):
            response.force_close()
        return response
    except Exception as exc:
        log.exception("unhandled error on %s %s", request.method, request.path)
        if request.writer.output_size > 0:
            # A response has begun (a stream): a second one would write its status
            # line into the first one's body. aiohttp closes the connection instead.
            raise
        status, body = body_for(exc)
        return web.json_response(body, status=status)
