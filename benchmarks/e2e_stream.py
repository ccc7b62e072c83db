"""End-to-end streaming through one daemon process over the shm transport.

A reference peer generating as fast as the ring takes (``--tokens-per-s 0``),
one daemon, and C concurrent streaming clients asking for N tokens each
(``ignore_eos``). Reports delivered tokens/s and time to first token, and
beside them the bare limit measured in the same run: the same client against
an aiohttp server streaming canned events of the same shape and count
(benchmarks/bare_sse.py). The client shares the machine's cores with the
daemon, so both figures are of the pair, measured the same way.

    python -m benchmarks.e2e_stream --concurrency 32 --tokens 256

On a GPU machine, against the CUDA peer, with the daemon pinned to two cores
(standing in for the DPU's) and the client on others:

    python -m benchmarks.e2e_stream --peer gpu-peer --tokens-per-step 1 --daemon-cores 0-1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
    parser.add_argument("--peer", choices=("peer", "gpu-peer"), default="peer",
                        help="the reference peer, or the CUDA peer (a GPU machine)")
    parser.add_argument("--tokens-per-step", type=int, default=0,
                        help="tokens per record per engine step (0: a full record)")
    parser.add_argument("--daemon-cores", default=None,
                        help="pin the daemon (taskset -c LIST); the client takes the other cores")
    args = parser.parse_args()

    prefix: tuple[str, ...] = ()
    if args.daemon_cores:
        prefix = ("taskset", "-c", args.daemon_cores)
        pinned = cpu_list(args.daemon_cores)
        os.sched_setaffinity(0, (os.sched_getaffinity(0) - pinned) or os.sched_getaffinity(0))
    peer_args: tuple[str, ...] = ("--tokens-per-step", str(args.tokens_per_step))
    if args.peer == "gpu-peer":
        peer_args += ("--max-sequences", "1024", "--resp-slots", "2048")
    with running_stack("shm", tokens_per_s=0, timeout=300, peer_command=args.peer,
                       peer_args=peer_args, daemon_prefix=prefix) as stack:
        daemon = asyncio.run(load(stack.base_url, MODEL, args.concurrency, args.tokens))
    proc, url = start_bare(args.tokens)
    try:
        bare = asyncio.run(load(url, "bare", args.concurrency, args.tokens))
    finally:
        stop(proc)
    record("e2e_stream_shm", {
        "peer": args.peer, "daemon cores": args.daemon_cores or "any",
        "tokens per step": args.tokens_per_step or "a full record",
        "concurrency x tokens": f"{args.concurrency} x {args.tokens}",
        "daemon tokens/s delivered": daemon["tokens/s"],
        "daemon SSE events/s (one event per text delta)": daemon["events/s"],
        "daemon ttft p50 / p99 ms": f"{daemon['ttft p50 ms']} / {daemon['ttft p99 ms']}",
        "bare limit: aiohttp canned SSE events/s (one token each)": bare["events/s"],
        "bare ttft p50 / p99 ms": f"{bare['ttft p50 ms']} / {bare['ttft p99 ms']}",
    })


def cpu_list(text: str) -> set[int]:
    """taskset's CPU list: ``0-1,4``."""
    cores: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def start_bare(events: int, *args: str,
               prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen[str], str]:
    """``benchmarks.bare_sse`` serving ``events`` events a stream, with ``args``, its
    command after ``prefix`` (taskset)."""
    return start([*prefix, sys.executable, "-m", "benchmarks.bare_sse", "--events",
                  str(events), *args], DAEMON_READY, timeout=60)


if __name__ == "__main__":
    main()
