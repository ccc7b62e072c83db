"""End-to-end streaming through one daemon process over the shm transport.

A reference peer generating as fast as the ring takes (``--tokens-per-s 0``),
one daemon, and C concurrent streaming clients asking for N tokens each
(``ignore_eos``). Reports delivered tokens/s and time to first token, and
beside them the bare limit measured in the same run: the same client against
an aiohttp server streaming canned events of the same shape and count
(benchmarks/bare_sse.py). The client shares the machine's cores with the
daemon, so both figures are of the pair, measured the same way.

    python -m benchmarks.e2e_stream --concurrency 32 --tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import aiohttp

from benchmarks.common import record
from dpu_frontend.softroce.processes import DAEMON_READY, start, stop
from tests.stack import MODEL, running_stack


async def load(base_url: str, model: str, concurrency: int, tokens: int) -> dict[str, float]:
    ttfts: list[float] = []
    events = generated = 0
    body = {"model": model, "prompt": "Tell me about the request ring.", "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal events, generated
        start = time.perf_counter()
        first = None
        usage = 0
        async with session.post(f"{base_url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                if raw.startswith(b"data: {"):
                    if first is None:
                        first = time.perf_counter() - start
                    chunk = json.loads(raw[6:])
                    events += 1
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
        generated += usage
        ttfts.append(first or 0.0)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await one(session)  # warm-up
        ttfts.clear()
        events = generated = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(session) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttfts.sort()
    return {"events/s": round(events / wall), "tokens/s": round(generated / wall),
            "wall s": round(wall, 3),
            "ttft p50 ms": round(statistics.median(ttfts) * 1e3, 2),
            "ttft p99 ms": round(ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()

    with running_stack("shm", tokens_per_s=0, timeout=120) as stack:
        daemon = asyncio.run(load(stack.base_url, MODEL, args.concurrency, args.tokens))
    proc, url = start_bare(args.tokens)
    try:
        bare = asyncio.run(load(url, "bare", args.concurrency, args.tokens))
    finally:
        stop(proc)
    record("e2e_stream_shm", {
        "concurrency x tokens": f"{args.concurrency} x {args.tokens}",
        "daemon tokens/s delivered": daemon["tokens/s"],
        "daemon SSE events/s (one event per text delta)": daemon["events/s"],
        "daemon ttft p50 / p99 ms": f"{daemon['ttft p50 ms']} / {daemon['ttft p99 ms']}",
        "bare limit: aiohttp canned SSE events/s (one token each)": bare["events/s"],
        "bare ttft p50 / p99 ms": f"{bare['ttft p50 ms']} / {bare['ttft p99 ms']}",
    })


def start_bare(events: int) -> tuple[subprocess.Popen[str], str]:
    return start([sys.executable, "-m", "benchmarks.bare_sse", "--events", str(events)],
                 DAEMON_READY, timeout=60)


if __name__ == "__main__":
    main()
