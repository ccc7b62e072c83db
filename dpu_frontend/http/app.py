"""The aiohttp application: routes, the error boundary, API keys; and its runner,
which bounds the open connections."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, cast

from aiohttp import web, web_log
from aiohttp.typedefs import Handler, Middleware
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CONTENT_TYPE_LATEST

from dpu_frontend import __version__
from dpu_frontend.engine.service import Service
from dpu_frontend.errors import BodyTooSlow
from dpu_frontend.http import openapi
from dpu_frontend.http.auth import ApiKeys, authenticate
from dpu_frontend.http.chat import ChatCompletionsHandler
from dpu_frontend.http.completions import CompletionsHandler
from dpu_frontend.http.errors import STREAMED_BYTES, add_request_id, boundary, error_body
from dpu_frontend.http.tokenize import TokenizeHandlers
from dpu_frontend.metrics import Metrics


def create_app(service: Service, model_name: str, metrics: Metrics,
               keys: ApiKeys | None = None) -> web.Application:
    """``keys``: loaded already (``ApiKeys.load``); None or none configured: no authentication."""
    # A body over the limit is refused from its Content-Length before a byte is read, or
    # by aiohttp as soon as a chunked one grows past it (the error boundary: 413).
    # The keys are checked inside the boundary, which answers and counts their 401s.
    keys = keys if keys is not None else ApiKeys(service.config)
    app = web.Application(middlewares=[boundary(metrics), authenticate(keys),
                                       body_within(service.config.body_timeout_s)],
                          client_max_size=service.config.max_request_bytes)
    app.on_response_prepare.append(add_request_id)
    created = int(time.time())
    # Whether keys are required is fixed at start: a reload must find at least one.
    spec = openapi.build(model_name, keys.config.exempt_paths if keys.enabled else None,
                         service.vocab.tokenizer.get_vocab_size())
    tokenize = TokenizeHandlers(service, model_name)

    async def health(request: web.Request) -> web.Response:
        pool = service.pool
        peers = [{"address": str(link.address), "up": link.up, "in_flight": link.in_flight,
                  "outstanding_tokens": link.outstanding, "reconnects": link.reconnects,
                  "error": None if link.up or link.error is None else str(link.error)}
                 for link in pool.links]
        if pool.draining:
            body = error_body("draining: no new requests", "service_unavailable", None, 503)
            return web.json_response(body | {"peers": peers}, status=503)
        if not pool.up:
            body = error_body("no GPU peer is up", "service_unavailable", None, 503)
            return web.json_response(body | {"peers": peers}, status=503)
        return web.json_response({"status": "ok", "in_flight": pool.in_flight, "peers": peers})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "dpu-frontend",
            "root": model_name, "max_model_len": service.max_model_len}]})

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def openapi_json(request: web.Request) -> web.Response:
        return web.json_response(spec)

    async def prometheus(request: web.Request) -> web.Response:
        service.pool.update_gauges()
        return web.Response(body=metrics.exposition(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_post("/v1/completions", CompletionsHandler(service, model_name).handle)
    app.router.add_post("/v1/chat/completions",
                        ChatCompletionsHandler(service, model_name).handle)
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/metrics", prometheus)
    return app


#: What a connection over ``max_connections`` is told before it is closed, unread.
_FULL = json.dumps(error_body("too many open connections (max_connections); retry shortly",
                              "service_unavailable", None, 503)).encode()
_FULL_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Retry-After: 1\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(_FULL), _FULL))


class _BoundedServer(web.Server):
    """aiohttp's server, which turns away connections past ``max_connections`` at accept:
    a 503 written before anything is read, then closed. The connection still costs a file
    descriptor for that instant, so the open-files limit must leave room (daemon.py)."""

    def __init__(self, *args: Any, max_connections: int, refused: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections
        self._refused = refused
        self._open: set[RequestHandler] = set()

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        if len(self._open) >= self.max_connections:
            self._refused.inc()
            transport.write(_FULL_RESPONSE)
            transport.close()  # its connection_lost comes, and finds it never counted
            return
        self._open.add(handler)
        super().connection_made(handler, transport)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self._open.discard(handler)
        super().connection_lost(handler, exc)


#: After an answer sent before the whole body was read (413, 408), how long aiohttp keeps
#: reading what the client still sends, so that it reads the answer rather than a reset.
#: aiohttp's 10 s would let a client that trickles its body keep the connection that long.
LINGER_S = 2.0


def body_within(timeout_s: float) -> Middleware:
    """Read the whole body (aiohttp keeps it for the handler) within ``timeout_s`` of the
    head, after the key is checked: a client that trickles its body (slow POST) holds a
    connection and a handler only that long, then gets 408 and is disconnected."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.body_exists:
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()
            except TimeoutError:
                raise BodyTooSlow(timeout_s) from None  # answered, then the connection closed
        return await handler(request)

    return middleware


class AccessLog(web_log.AccessLogger):
    """aiohttp's access log, with the size field of a stream counting the events the
    poll loop wrote itself (``STREAMED_BYTES``) beside those aiohttp wrote."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse,
            time: float) -> None:
        streamed = request.get(STREAMED_BYTES, 0)
        if streamed:
            response = cast(web.StreamResponse, _Sized(response, streamed))
        super().log(request, response, time)


class _Sized:
    """A response as the access log reads it, its ``body_length`` raised by ``extra``."""

    def __init__(self, response: web.StreamResponse, extra: int) -> None:
        self._response = response
        self.body_length = response.body_length + extra

    def __getattr__(self, name: str) -> Any:
        return getattr(self._response, name)


class BoundedRunner(web.AppRunner):
    """An ``AppRunner`` whose server holds at most ``max_connections`` connections and closes
    one that has not sent a complete request head within ``idle_timeout_s`` (aiohttp's
    keep-alive timer runs from the accept, and from the end of each response)."""

    def __init__(self, app: web.Application, *, max_connections: int, idle_timeout_s: float,
                 metrics: Metrics, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=idle_timeout_s, lingering_time=LINGER_S,
                         **kwargs)
        self.max_connections = max_connections
        self._refused = metrics.refused_connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Rebuilt with the same arguments, bounded: AppRunner builds its server in this one
        # overridable step and keeps no other reference to it.
        return _BoundedServer(server.request_handler, request_factory=server.request_factory,
                              handler_cancellation=server.handler_cancellation,
                              max_connections=self.max_connections, refused=self._refused,
                              **server._kwargs)
