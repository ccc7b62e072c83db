"""/openapi.json, generated from the very models the handlers validate with."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from dpu_frontend import __version__
from dpu_frontend.http.schemas import (
    TOKEN_ID,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": "OpenAI-style error"} | _json(_ref(ErrorResponse))
            for s in statuses}


def _served(node: Any, model_name: str, vocab_size: int | None) -> None:
    """What this daemon accepts, beyond the models' types: its one model name, and token
    ids below its vocabulary's size. A request the schema allows is then one the daemon
    serves, and a client (or a fuzzer) learns both limits from the document."""
    if isinstance(node, list):
        for item in node:
            _served(item, model_name, vocab_size)
        return
    if not isinstance(node, dict):
        return
    if node.pop(TOKEN_ID, False) and vocab_size is not None:
        node["maximum"] = vocab_size - 1
    properties = node.get("properties")
    if isinstance(properties, dict) and "model" in properties:
        model = properties["model"]
        served = {"const": model_name, "description": "the served model's name"}
        if "anyOf" in model:  # optional: the name, or null
            model["anyOf"] = [served, {"type": "null"}]
        else:
            properties["model"] = served
    for child in node.values():
        _served(child, model_name, vocab_size)


def build(model_name: str, exempt: frozenset[str] | None = None,
          vocab_size: int | None = None) -> dict[str, Any]:
    """``exempt``: with API keys configured, the paths served without one; None: no keys.
    ``vocab_size``: token ids must be below it (None: only the ring's u32 bound)."""
    models: list[type[BaseModel]] = [CompletionRequest, ChatCompletionRequest,
                                     TokenizeCompletionRequest, TokenizeChatRequest,
                                     DetokenizeRequest, ErrorResponse]
    _, schemas = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    _served(schemas, model_name, vocab_size)
    generation = {"200": {"description": "the completion; `text/event-stream` of chunks "
                                         "ending with `data: [DONE]` when `stream` is true",
                          "content": {"application/json": {}, "text/event-stream": {}}},
                  # 413: over max_request_bytes; 429: the queue in front of the rings is full.
                  **_errors(400, 404, 413, 429, 503)}

    def post(summary: str, body: dict[str, Any], responses: dict[str, Any]) -> dict[str, Any]:
        return {"post": {"summary": summary, "requestBody": {"required": True} | _json(body),
                         "responses": responses}}

    def get(summary: str) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}

    spec = {
        "openapi": "3.1.0",
        "info": {"title": "dpu-frontend", "version": __version__,
                 "description": f"OpenAI-compatible API serving `{model_name}`."},
        "paths": {
            "/v1/completions": post("Text completion", _ref(CompletionRequest), generation),
            "/v1/chat/completions": post("Chat completion", _ref(ChatCompletionRequest),
                                         generation),
            "/tokenize": post("Tokenize a prompt or chat messages",
                              {"oneOf": [_ref(TokenizeCompletionRequest),
                                         _ref(TokenizeChatRequest)]},
                              {"200": {"description": "count, max_model_len, tokens"},
                               **_errors(400, 404, 413)}),
            "/detokenize": post("Detokenize token ids", _ref(DetokenizeRequest),
                                {"200": {"description": "prompt"}, **_errors(400, 404, 413)}),
            "/v1/models": get("The served model"),
            "/health": get("200 while a GPU peer is up; 503 when none is, or while draining"),
            "/version": get("The daemon's version"),
            "/openapi.json": get("This document"),
        },
        "components": {"schemas": schemas.get("$defs", {})},
    }
    if exempt is not None:
        _require_keys(spec, exempt)
    return spec


def _require_keys(spec: dict[str, Any], exempt: frozenset[str]) -> None:
    """The bearer scheme on every operation but the exempt ones, each with its 401."""
    spec["components"]["securitySchemes"] = {"apiKey": {
        "type": "http", "scheme": "bearer",
        "description": "one of the daemon's API keys (api_key_file, DPU_FRONTEND_API_KEYS)"}}
    spec["security"] = [{"apiKey": []}]
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            if path in exempt:
                operation["security"] = []
            else:  # a new dict: the generation responses are shared by two operations
                operation["responses"] = operation["responses"] | _errors(401)
