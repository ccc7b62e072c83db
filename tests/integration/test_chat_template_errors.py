"""A chat template that raises is the request's 400, through a real daemon (shm)."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.stack import MODEL, running_stack
from tests.unit.test_chat_template import STRICT


async def test_template_raise_exception_is_a_400(tmp_path: Path) -> None:
    template = tmp_path / "strict.jinja"
    template.write_text(STRICT)
    with running_stack("shm", timeout=60, serve_args=("--chat-template", str(template))) as stack:
        async with aiohttp.ClientSession(base_url=stack.base_url) as http:
            bad = {"model": MODEL, "messages": [{"role": "assistant", "content": "first"}]}
            async with http.post("/v1/chat/completions", json=bad) as resp:
                body = await resp.json()
                assert resp.status == 400
                assert body["error"]["code"] == "chat_template_error"
                assert "roles must alternate" in body["error"]["message"]
            good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3}
            async with http.post("/v1/chat/completions", json=good) as resp:
                assert resp.status == 200
                assert (await resp.json())["usage"]["completion_tokens"] == 3
