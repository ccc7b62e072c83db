"""/metrics: checked by promtool on a live scrape, and scraped by a real Prometheus."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import aiohttp

from tests.integration.lifecycle import eventually
from tests.stack import MODEL, Stack

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


# Its own stack: the counters below are compared exactly.
STACK = {"tokens_per_s": 500}


async def traffic(stack: Stack) -> None:
    """Streamed and not, both endpoints, a client error, a client that leaves."""
    async with aiohttp.ClientSession(base_url=stack.base_url) as http:
        for stream in (False, True):
            body = {"model": MODEL, "prompt": "metrics", "max_tokens": 12, "stream": stream}
            async with http.post("/v1/completions", json=body) as r:
                assert r.status == 200
                await r.read()
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8, "stream": stream}
            async with http.post("/v1/chat/completions", json=chat) as r:
                assert r.status == 200
                await r.read()
        async with http.post("/v1/completions", json={"model": MODEL}) as r:
            assert r.status == 400
        r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "bye",
                                                    "max_tokens": 5000, "ignore_eos": True,
                                                    "stream": True})
        await r.content.readline()
        r.close()  # disconnect mid-stream


async def scrape(stack: Stack) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"{stack.base_url}/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return await r.text()


def value(text: str, pattern: str) -> float:
    match = re.search(rf"^{pattern} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"no sample matches {pattern}"
    return float(match.group(1))


async def test_promtool_accepts_a_live_scrape(own_stack: Stack) -> None:
    stack = own_stack
    await traffic(stack)

    async def settled() -> bool:
        # The handler counts the disconnect at once; its request stays running until
        # the peer's final (cancelled) record arrives.
        text = await scrape(stack)
        return ("dpu_frontend_disconnected_clients_total 1.0" in text
                and "dpu_frontend_num_requests_running 0.0" in text)

    await eventually(settled, "the disconnected client was never counted, or never ended")
    text = await scrape(stack)
    check = await asyncio.create_subprocess_exec(
        PROMTOOL, "check", "metrics", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await check.communicate(text.encode())
    assert check.returncode == 0, (out + err).decode()
    assert value(text, r'dpu_frontend_requests_total\{endpoint="/v1/completions",'
                       r'finish_reason="length",status="200"\}') == 2
    assert value(text, r'dpu_frontend_requests_total\{endpoint="/v1/completions",'
                       r'finish_reason="none",status="400"\}') == 1
    assert value(text, r"dpu_frontend_time_to_first_token_seconds_count") >= 4
    assert value(text, r"dpu_frontend_inter_token_latency_seconds_count") > 0
    assert value(text, r"dpu_frontend_request_queue_time_seconds_count") >= 5
    assert value(text, r"dpu_frontend_tokenize_seconds_count") >= 4
    assert value(text, r'dpu_frontend_aborted_requests_total\{reason="client_disconnected"\}') == 1
    assert value(text, r"dpu_frontend_output_tokens_total") >= 40
    assert value(text, r'dpu_frontend_peer_up\{peer="[^"]+"\}') == 1
    assert value(text, r'dpu_frontend_rdma_operations_total\{opcode="read",peer="[^"]+"\}') > 0
    assert value(text, r"dpu_frontend_num_requests_running") == 0


async def start_prometheus(config: Path, data: Path) -> tuple[asyncio.subprocess.Process, int]:
    """Prometheus on a free port. It cannot take port 0 and say which it got, so a port
    is picked and, should another program take it first, the next one tried."""
    for _ in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        process = await asyncio.create_subprocess_exec(
            PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        async with aiohttp.ClientSession() as http:
            while process.returncode is None:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/-/ready") as r:
                        if r.status == 200:
                            return process, port
                except aiohttp.ClientError:
                    pass
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(process.wait(), 0.1)  # exited: the port was taken
    raise AssertionError("Prometheus did not start on any of five free ports")


async def test_a_real_prometheus_scrapes_a_ttft_quantile(own_stack: Stack,
                                                         tmp_path: Path) -> None:
    stack = own_stack
    target = stack.base_url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: 1s
scrape_configs:
  - job_name: dpu-frontend
    static_configs:
      - targets: ["{target}"]
""")
    prometheus, port = await start_prometheus(config, tmp_path / "data")
    query = ("histogram_quantile(0.9, sum by (le) "
             "(rate(dpu_frontend_time_to_first_token_seconds_bucket[1m])))")
    try:
        async with aiohttp.ClientSession() as http:
            async def ttft() -> float | None:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/api/v1/query",
                                        params={"query": query}) as r:
                        answer: dict[str, Any] = await r.json()
                except aiohttp.ClientError:
                    return None
                results = answer.get("data", {}).get("result", [])
                if not results or results[0]["value"][1] in ("NaN", "+Inf"):
                    return None
                return float(results[0]["value"][1])

            async def scraped_with_traffic() -> bool:
                await traffic(stack)
                await asyncio.sleep(1)
                return await ttft() is not None

            await eventually(scraped_with_traffic, "Prometheus never returned a TTFT quantile",
                             limit=120)
            quantile = await ttft()
            assert quantile is not None and 0 < quantile < 10
    finally:
        prometheus.terminate()
        await prometheus.wait()
