"""API keys and streams per key, through the real app over loopback peers."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import openai
import pytest

from dpu_frontend.config import ServeConfig
from dpu_frontend.errors import StartupError
from dpu_frontend.http.auth import ApiKeys, fingerprint
from dpu_frontend.ring import FinishReason
from tests.http.conftest import MODEL, Factory, events, next_event

KEY = "sk-test-0123456789abcdef"
OTHER = "sk-other-0123456789abcdef"
PROMPT = {"model": MODEL, "prompt": [11, 12], "max_tokens": 4}
STREAM = PROMPT | {"max_tokens": 1000, "stream": True}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("headers", [{}, bearer("sk-wrong-0123456789abcdef"),
                                     {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": "Bearer "}])
async def test_a_request_without_a_valid_key_gets_401(make_frontend: Factory,
                                                      headers: dict[str, str]) -> None:
    front = await make_frontend(api_keys=f"{KEY},{OTHER}")
    resp = await front.client.post("/v1/completions", json=PROMPT, headers=headers)
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"] == "Bearer"
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_api_key"
    assert error["param"] is None
    assert KEY not in error["message"]
    assert not front.gpu.arrivals  # nothing reached the GPU side
    assert front.metrics.registry.get_sample_value(
        "dpu_frontend_requests_total",
        {"endpoint": "/v1/completions", "status": "401", "finish_reason": "none"}) == 1


@pytest.mark.parametrize("key", [KEY, OTHER])
async def test_each_configured_key_is_accepted(make_frontend: Factory, key: str) -> None:
    front = await make_frontend(api_keys=f"{KEY}, {OTHER}")
    request = asyncio.create_task(front.client.post("/v1/completions", json=PROMPT,
                                                    headers=bearer(key)))
    (arrival,) = await front.gpu.wait_for(1)
    front.gpu.finish(arrival.record.request_id, (20,), FinishReason.LENGTH)
    assert (await request).status == 200


async def test_keys_from_a_file_and_the_environment_together(make_frontend: Factory,
                                                             tmp_path: Path) -> None:
    path = key_file(tmp_path, f"# the team\n{OTHER}  # until 2027\n\n")
    front = await make_frontend(api_keys=KEY, api_key_file=path)
    for key in (KEY, OTHER):
        resp = await front.client.get("/v1/models", headers=bearer(key))
        assert resp.status == 200
    assert (await front.client.get("/v1/models")).status == 401


@pytest.mark.parametrize("path", ["/health", "/metrics"])
async def test_probes_are_exempt_by_default(make_frontend: Factory, path: str) -> None:
    front = await make_frontend(api_keys=KEY)
    assert (await front.client.get(path)).status == 200


async def test_exempt_paths_are_configurable(make_frontend: Factory) -> None:
    front = await make_frontend(api_keys=KEY, auth_exempt_paths="/openapi.json")
    assert (await front.client.get("/openapi.json")).status == 200
    assert (await front.client.get("/health")).status == 401
    assert (await front.client.get("/v1/models")).status == 401


async def test_without_keys_the_api_is_open(make_frontend: Factory) -> None:
    front = await make_frontend()
    assert (await front.client.get("/v1/models")).status == 200


@pytest.mark.parametrize(("text", "mode", "message"), [
    (f"{KEY}\n", 0o640, "open to others (mode 640): chmod 600 it"),
    ("# nothing yet\n", 0o600, "holds no key"),
    ("short\n", 0o600, "must be at least 16 printable ASCII characters"),
])
def test_a_bad_key_file_refuses_to_start(tmp_path: Path, text: str, mode: int,
                                         message: str) -> None:
    keys = ApiKeys(ServeConfig(api_key_file=key_file(tmp_path, text, mode)))
    with pytest.raises(StartupError, match=re.escape(message)) as caught:
        keys.load()
    assert "short" not in str(caught.value)  # never the key itself


def test_the_stream_limit_needs_keys() -> None:
    with pytest.raises(StartupError, match="max_streams_per_key needs API keys"):
        ApiKeys(ServeConfig(max_streams_per_key=2)).load()


def test_the_config_repr_holds_no_key() -> None:
    assert KEY not in repr(ServeConfig(api_keys=KEY))
    assert fingerprint(KEY) not in KEY


async def test_sighup_reload_takes_new_keys_and_keeps_old_on_error(make_frontend: Factory,
                                                                   tmp_path: Path) -> None:
    path = key_file(tmp_path, f"{KEY}\n")
    front = await make_frontend(api_key_file=path)
    path.write_text(f"{OTHER}\n")
    assert front.keys.reload()
    assert (await front.client.get("/v1/models", headers=bearer(KEY))).status == 401
    assert (await front.client.get("/v1/models", headers=bearer(OTHER))).status == 200
    os.chmod(path, 0o644)  # a mistake while editing: the keys in use stay
    assert not front.keys.reload()
    assert (await front.client.get("/v1/models", headers=bearer(OTHER))).status == 200


async def test_streams_over_the_limit_of_a_key_get_429(make_frontend: Factory) -> None:
    front = await make_frontend(api_keys=f"{KEY},{OTHER}", max_streams_per_key=1)
    first = await front.client.post("/v1/completions", json=STREAM, headers=bearer(KEY))
    (arrival,) = await front.gpu.wait_for(1)
    over = await front.client.post("/v1/completions", json=STREAM, headers=bearer(KEY))
    assert over.status == 429
    assert over.headers["Retry-After"] == "1"
    error = (await over.json())["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "too_many_streams")
    # Another key has its own count; other endpoints are not counted.
    assert (await front.client.post("/tokenize", json={"model": MODEL, "prompt": "hi"},
                                    headers=bearer(KEY))).status == 200
    second = await front.client.post("/v1/chat/completions", headers=bearer(OTHER), json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "max_tokens": 4})
    assert second.status == 200
    arrivals = await front.gpu.wait_for(2)
    for each in arrivals:
        front.gpu.finish(each.record.request_id, (20,), FinishReason.LENGTH)
    await events(first)
    await events(second)
    async with asyncio.timeout(5):
        await front.keys.wait_streams(KEY)
    # Released when the stream ended: the key may open another.
    again = asyncio.create_task(front.client.post("/v1/completions", json=PROMPT,
                                                  headers=bearer(KEY)))
    (third,) = (await front.gpu.wait_for(3))[2:]
    front.gpu.finish(third.record.request_id, (20,), FinishReason.LENGTH)
    assert (await again).status == 200
    assert arrival.record.request_id != third.record.request_id


async def test_a_stream_whose_client_goes_away_is_released(make_frontend: Factory) -> None:
    front = await make_frontend(api_keys=KEY, max_streams_per_key=1)
    resp = await front.client.post("/v1/completions", json=STREAM, headers=bearer(KEY))
    (arrival,) = await front.gpu.wait_for(1)
    front.gpu.emit(arrival.record.request_id, (20,))
    await next_event(resp)
    assert front.keys.streams(KEY) == 1
    resp.close()  # mid-stream
    await front.gpu.wait_for(1, cancels=1)
    front.gpu.finish(arrival.record.request_id, finish=FinishReason.CANCELLED)
    async with asyncio.timeout(5):
        await front.keys.wait_streams(KEY)


async def test_the_schema_documents_the_bearer_scheme(make_frontend: Factory) -> None:
    front = await make_frontend(api_keys=KEY, auth_exempt_paths="/health,/openapi.json")
    spec = await (await front.client.get("/openapi.json")).json()
    assert spec["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert spec["security"] == [{"apiKey": []}]
    assert spec["paths"]["/health"]["get"]["security"] == []
    assert "401" in spec["paths"]["/v1/completions"]["post"]["responses"]
    assert "401" not in spec["paths"]["/health"]["get"]["responses"]


async def test_the_openai_sdk_sees_an_authentication_error(make_frontend: Factory) -> None:
    front = await make_frontend(api_keys=KEY)
    base = str(front.client.make_url("/v1"))
    async with openai.AsyncOpenAI(base_url=base, api_key="sk-wrong-0123456789abcdef",
                                  max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as caught:
            await wrong.models.list()
    assert caught.value.code == "invalid_api_key"
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as right:
        assert [m.id async for m in right.models.list()] == [MODEL]
