"""Every failure leaves as one OpenAI-style error body: ``{"error": {...}}``.

The middleware is the request boundary: ``RequestError`` becomes its 4xx,
``PeerError`` a 503, anything unexpected a logged 500 that never takes the
worker down.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from dpu_frontend.errors import PeerError, RequestError

log = logging.getLogger("dpu_frontend.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
    """``Retry-After`` for the statuses a client should retry (429, 503)."""
    retry = getattr(exc, "retry_after", None)
    return {"Retry-After": str(retry)} if retry is not None else {}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response(
            error_body(exc.reason, "invalid_request_error" if exc.status < 500 else "server_error",
                       None, exc.status), status=exc.status)
    except (RequestError, PeerError) as exc:
        status, body = body_for(exc)
        log.info("%s %s -> %d: %s", request.method, request.path, status, exc)
        return web.json_response(body, status=status, headers=headers_for(exc))
    except Exception as exc:
        log.exception("unhandled error on %s %s", request.method, request.path)
        status, body = body_for(exc)
        return web.json_response(body, status=status)
