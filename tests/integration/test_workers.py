"""``serve --workers 2``: two processes, one port, a channel each, metrics summed over both."""

from __future__ import annotations

import asyncio
import re
import signal

import aiohttp

from dpu_frontend.control.stats import peer_stats
from tests.integration.lifecycle import outcome, read_events
from tests.integration.test_metrics import PROMTOOL
from tests.stack import MODEL, running_stack

REQUESTS = 24


async def test_two_workers_share_the_port_and_aggregate_metrics() -> None:
    # --port 0: the supervisor reserves a port the kernel picks and hands it to both.
    with running_stack("shm", tokens_per_s=200, timeout=120, peer_args=("--channels", "2"),
                       serve_args=("--workers", "2")) as stack:
        body = {"model": MODEL, "prompt": "workers", "max_tokens": 6, "stream": True}

        async def one(i: int) -> str:
            # A connection each: the kernel spreads connections over the workers.
            async with aiohttp.ClientSession() as http, http.post(
                    f"{stack.base_url}/v1/completions", json=body | {"prompt": f"w {i}"}) as r:
                return outcome(await read_events(r))

        assert await asyncio.gather(*(one(i) for i in range(REQUESTS))) == ["finished"] * REQUESTS
        channels = await peer_stats(stack.peer_address())
        assert [c["attached"] for c in channels] == [True, True]  # one channel per worker
        assert sum(c["admitted"] for c in channels) == REQUESTS
        assert all(c["admitted"] > 0 for c in channels), channels

        # Each worker set its gauges before its ready line: no wait for a refresh.
        async with aiohttp.ClientSession() as http, http.get(f"{stack.base_url}/metrics") as r:
            text = await r.text()
        total = re.search(r'^dpu_frontend_requests_total\{endpoint="/v1/completions",'
                          r'finish_reason="length",status="200"\} ([0-9.]+)$', text, re.MULTILINE)
        assert total and float(total.group(1)) == REQUESTS  # summed over both workers
        up = re.search(r'^dpu_frontend_peer_up\{peer="[^"]+"\} ([0-9.]+)$', text, re.MULTILINE)
        assert up and float(up.group(1)) == 1
        check = await asyncio.create_subprocess_exec(
            PROMTOOL, "check", "metrics", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await check.communicate(text.encode())
        assert check.returncode == 0, (out + err).decode()
        stack.daemon.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(stack.daemon.wait, 60) == 0
