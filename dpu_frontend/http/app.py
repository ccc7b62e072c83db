"""The aiohttp application: routes and the error boundary."""

from __future__ import annotations

import time

from aiohttp import web

from dpu_frontend.engine.service import Service
from dpu_frontend.http.completions import CompletionsHandler
from dpu_frontend.http.errors import error_body, error_middleware

SERVICE_KEY = web.AppKey("service", Service)


def create_app(service: Service, model_name: str) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=64 << 20)
    app[SERVICE_KEY] = service
    created = int(time.time())

    async def health(request: web.Request) -> web.Response:
        link = service.link
        if link.up:
            return web.json_response({"status": "ok", "in_flight": link.in_flight})
        reason = str(link.error) if link.error else "GPU peer not connected"
        return web.json_response(error_body(reason, "service_unavailable", None, 503), status=503)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "dpu-frontend",
            "max_model_len": service.max_model_len}]})

    app.router.add_post("/v1/completions", CompletionsHandler(service, model_name))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app
