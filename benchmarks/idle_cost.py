"""What the daemon costs with streams open and nothing due: the response-ring poll.

A reference peer that emits each stream's first token at once and the next
one only after ``--gap`` seconds; one daemon worker over shm; ``--streams``
streams opened and each read to its first token. Then the daemon's CPU
(its process tree, from /proc) over ``--seconds``, as a fraction of a core,
with no stream open and with all of them open; beside it the issue's
target (5% of a core) and the poll rate that the configured intervals
allow.

    python -m benchmarks.idle_cost --streams 1000 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp

from benchmarks.common import cpu_seconds, record
from dpu_frontend.config import ServeConfig
from tests.stack import MODEL, running_stack

TARGET = 0.05


async def open_streams(url: str, streams: int, hold: asyncio.Event,
                       ready: asyncio.Queue[int]) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def one(i: int) -> None:
            body = {"model": MODEL, "prompt": f"idle {i}", "max_tokens": 8, "ignore_eos": True,
                    "stream": True}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                async for raw in resp.content:
                    if raw.startswith(b"data: {"):
                        await ready.put(i)
                        break
                await hold.wait()  # then leave: the daemon cancels the stream

        await asyncio.gather(*(one(i) for i in range(streams)))


async def measure(url: str, pid: int, streams: int, seconds: float) -> tuple[float, float]:
    """(cores busy with nothing open, cores busy with ``streams`` open and nothing due)."""
    t0, c0 = time.monotonic(), cpu_seconds(pid)
    await asyncio.sleep(seconds)
    idle = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    hold, ready = asyncio.Event(), asyncio.Queue[int]()
    task = asyncio.create_task(open_streams(url, streams, hold, ready))
    for _ in range(streams):
        await asyncio.wait_for(ready.get(), 120)
    await asyncio.sleep(1.0)  # the opening burst settles
    t0, c0 = time.monotonic(), cpu_seconds(pid)
    await asyncio.sleep(seconds)
    busy = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    hold.set()
    await task
    return idle, busy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--gap", type=float, default=600.0, help="seconds between a stream's tokens")
    args = ap.parse_args(argv)
    peer_args = ("--max-sequences", str(max(256, args.streams)),
                 "--resp-slots", str(2 * max(256, args.streams)))
    with running_stack("shm", tokens_per_s=1 / args.gap, peer_args=peer_args,
                       serve_args=("--max-queued-requests", str(args.streams))) as stack:
        idle, busy = asyncio.run(measure(stack.base_url, stack.daemon.pid, args.streams,
                                         args.seconds))
    cfg = ServeConfig()
    record("idle_cost", {
        "streams open": args.streams, "seconds measured": args.seconds,
        "daemon cores busy, nothing open": round(idle, 4),
        f"daemon cores busy, {args.streams} streams open, nothing due": round(busy, 4),
        "target, cores": TARGET,
        "polls/s the intervals allow (open / idle)":
            f"{1 / cfg.poll_interval_s:.0f} / {1 / cfg.idle_poll_interval_s:.0f}",
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
