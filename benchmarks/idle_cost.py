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
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from benchmarks.common import cpu_seconds, py_spy, record
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


async def measure(url: str, pid: int, streams: int, seconds: float,
                  spy: Path | None = None) -> tuple[float, float]:
    """(cores busy with nothing open, cores busy with ``streams`` open and nothing due);
    ``spy``: a py-spy profile of the second part, into that file."""
    t0, c0 = time.monotonic(), cpu_seconds(pid)
    await asyncio.sleep(seconds)
    idle = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    hold, ready = asyncio.Event(), asyncio.Queue[int]()
    task = asyncio.create_task(open_streams(url, streams, hold, ready))
    for _ in range(streams):
        await asyncio.wait_for(ready.get(), 120)
    await asyncio.sleep(1.0)  # the opening burst settles
    with py_spy(pid, spy, idle=False):
        t0, c0 = time.monotonic(), cpu_seconds(pid)
        await asyncio.sleep(seconds)
        busy = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    hold.set()
    await task
    return idle, busy


#: The bare limit: an event loop (uvloop, as the daemon's) that does nothing but wake
#: up every ``interval``, its CPU from the scheduler's own account (ns, not ticks).
FLOOR = """
import asyncio, sys, time, uvloop
from pathlib import Path
interval, seconds = float(sys.argv[1]), float(sys.argv[2])
def ran(): return int(Path("/proc/self/schedstat").read_text().split()[0]) / 1e9
async def loop():
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(interval)
t0, c0 = time.monotonic(), ran()
uvloop.run(loop())
print((ran() - c0) / (time.monotonic() - t0))
"""


def floor(interval: float, seconds: float) -> float:
    """Cores busy for an event loop that only wakes up every ``interval``."""
    done = subprocess.run([sys.executable, "-c", FLOOR, str(interval), str(seconds)],
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--gap", type=float, default=600.0, help="seconds between a stream's tokens")
    ap.add_argument("--py-spy", type=Path, metavar="FILE",
                    help="profile the daemon (py-spy, CPU only) while the streams are open")
    args = ap.parse_args(argv)
    peer_args = ("--max-sequences", str(max(256, args.streams)),
                 "--resp-slots", str(2 * max(256, args.streams)))
    with running_stack("shm", tokens_per_s=1 / args.gap, peer_args=peer_args,
                       serve_args=("--max-queued-requests", str(args.streams))) as stack:
        idle, busy = asyncio.run(measure(stack.base_url, stack.daemon.pid, args.streams,
                                         args.seconds, args.py_spy))
    cfg = ServeConfig()
    bare = floor(cfg.poll_interval_s, args.seconds)
    record("idle_cost", {
        "streams open": args.streams, "seconds measured": args.seconds,
        "daemon cores busy, nothing open": round(idle, 4),
        f"daemon cores busy, {args.streams} streams open, nothing due": round(busy, 4),
        f"bare limit: an event loop waking every {cfg.poll_interval_s * 1e3:g} ms, cores":
            round(bare, 4),
        "open streams' cost over the bare limit": round(busy / bare, 2) if bare else "-",
        "target, cores": TARGET,
        "polls/s the intervals allow (open / idle)":
            f"{1 / cfg.poll_interval_s:.0f} / {1 / cfg.idle_poll_interval_s:.0f}",
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
