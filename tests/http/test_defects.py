"""Regression tests for the defects of issue 10, through the real app over loopback peers."""

from __future__ import annotations

from typing import Any

import pytest

from tests.http.conftest import Factory

GENERATION = ["/v1/completions", "/v1/chat/completions"]
BODY_ROUTES = [*GENERATION, "/tokenize", "/detokenize"]


def assert_error(status: int, body: Any, expected: int, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
    """One OpenAI-style error body, and nothing else."""
    assert status == expected, body
    assert body == {"error": {"message": body["error"]["message"], "type": type_,
                              "param": param, "code": code}}
    assert body["error"]["message"]


async def post_raw(front: Any, path: str, raw: bytes) -> tuple[int, Any]:
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
    assert not front.gpu.arrivals
