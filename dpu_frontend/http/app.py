"""The aiohttp application: routes and the error boundary."""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from dpu_frontend import __version__
from dpu_frontend.engine.service import Service
from dpu_frontend.http import openapi
from dpu_frontend.http.chat import ChatCompletionsHandler
from dpu_frontend.http.completions import CompletionsHandler
from dpu_frontend.http.errors import add_request_id, boundary, error_body
from dpu_frontend.http.tokenize import TokenizeHandlers
from dpu_frontend.metrics import Metrics


def create_app(service: Service, model_name: str, metrics: Metrics) -> web.Application:
    # A body over the limit is refused from its Content-Length before a byte is read, or
    # by aiohttp as soon as a chunked one grows past it (the error boundary: 413).
    app = web.Application(middlewares=[boundary(metrics)],
                          client_max_size=service.config.max_request_bytes)
    app.on_response_prepare.append(add_request_id)
    created = int(time.time())
    spec = openapi.build(model_name)
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
