"""What a token costs the daemon when the load is light, beside what it costs when the
daemon is saturated, in the same run (issue 26: CPU that grows with the work, not with
the polling).

One daemon worker pinned to ``--daemon-core`` over shm; the reference peer and this load
generator on the other cores. For each load, ``streams`` streams of ``tokens_per_s``
tokens/s each, from the peer in replay (each stream paced on its own from its start:
streams opened together stay in step), in replay with the streams' starts spread over
one token's period (out of step: records come one at a time, evenly, never in bursts of
a stream each), and in decode steps (``--step-ms``: every running stream a token a step, as
a GPU's decode emits them). After a second to settle, the daemon's CPU (its process,
from /proc) and the SSE events the clients received over ``--seconds``: microseconds per
event and the share of a core. Then the bare figure: 256 streams from an unpaced peer
(as fast as the ring takes), the daemon's microseconds per event at saturation. The
issue's target: at 64 x 20 tokens/s, at most 3x the saturated figure and 5% of a core.

    python -m benchmarks.light_load                      # 64x20, 256x20, 1000x5
    python -m benchmarks.light_load --loads 64x20 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time
from dataclasses import dataclass

import aiohttp

from benchmarks.common import cpu_seconds, record
from benchmarks.interference import parse_cores
from tests.stack import MODEL, running_stack

TARGET_RATIO, TARGET_CORES = 3.0, 0.05
#: The bare figure's streams, from an unpaced peer.
SATURATED_STREAMS = 256


@dataclass(frozen=True, slots=True)
class Load:
    streams: int
    tokens_per_s: float  # per stream; 0: as fast as the ring takes

    @classmethod
    def parse(cls, text: str) -> Load:
        streams, rate = text.split("x")
        return cls(int(streams), float(rate))

    def __str__(self) -> str:
        return f"{self.streams} x {self.tokens_per_s:g} tokens/s"


@dataclass(frozen=True, slots=True)
class Figure:
    events: int
    seconds: float
    cpu_s: float
    #: The poll loop's cadence over the window: waits past the poll interval, and bursts
    #: found at the end of one (dpu_frontend_peer_poll_cadence_total).
    skips: float = 0.0
    late: float = 0.0

    @property
    def us_per_event(self) -> float:
        return self.cpu_s / self.events * 1e6 if self.events else float("inf")

    @property
    def cores(self) -> float:
        return self.cpu_s / self.seconds


async def cadence_counts(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The daemon's poll-cadence counters, by outcome (skip, late), summed over peers:
    the outcomes /metrics exports."""
    counts: dict[str, float] = {}
    async with session.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            found = re.match(r'dpu_frontend_peer_poll_cadence_total\{.*outcome="(\w+)".*\} (\S+)$',
                             line)
            if found:
                counts[found.group(1)] = counts.get(found.group(1), 0.0) + float(found.group(2))
    return counts


async def stream_load(url: str, streams: int, max_tokens: int, pid: int, settle: float,
                      seconds: float, spread: float = 0.0) -> Figure:
    """Open ``streams`` streams (their starts evenly over ``spread`` seconds), wait
    ``settle`` seconds, then count the events every stream receives and the daemon's
    CPU over ``seconds``; close them all."""
    counted = [0]
    counting = asyncio.Event()
    done = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def one(i: int) -> None:
            await asyncio.sleep(spread * i / streams)
            body = {"model": MODEL, "prompt": f"light {i}", "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                async for raw in resp.content:
                    if done.is_set():
                        return
                    if counting.is_set() and raw.startswith(b"data: {"):
                        counted[0] += 1

        tasks = [asyncio.create_task(one(i)) for i in range(streams)]
        await asyncio.sleep(settle)
        before = await cadence_counts(session, url)
        t0, c0 = time.monotonic(), cpu_seconds(pid)
        counting.set()
        await asyncio.sleep(seconds)
        counting.clear()
        elapsed, cpu = time.monotonic() - t0, cpu_seconds(pid) - c0
        after = await cadence_counts(session, url)
        figure = Figure(counted[0], elapsed, cpu, after["skip"] - before["skip"],
                        after["late"] - before["late"])
        done.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return figure


def run_load(load: Load, peer_mode: str, step_ms: float, daemon_core: str, settle: float,
             seconds: float, daemon_args: tuple[str, ...] = ()) -> Figure:
    streams = load.streams
    rate = load.tokens_per_s
    peer_args = ["--max-sequences", str(max(256, streams)), "--resp-slots",
                 str(2 * max(256, streams))]
    if peer_mode == "step":  # else replay, in step or "staggered"
        peer_args += ["--step-ms", f"{step_ms:g}", "--batch", str(max(256, streams))]
        rate = 1000 / step_ms
    tokens = int(rate * (settle + seconds) * 2) + 64 if rate else 1 << 20
    with running_stack("shm", tokens_per_s=0 if peer_mode == "step" else load.tokens_per_s,
                       peer_args=tuple(peer_args),
                       serve_args=("--max-queued-requests", str(streams), *daemon_args),
                       daemon_prefix=("taskset", "-c", daemon_core)) as stack:
        spread = 1 / load.tokens_per_s if peer_mode == "staggered" else 0.0
        return asyncio.run(stream_load(stack.base_url, streams, tokens, stack.daemon.pid,
                                       settle, seconds, spread))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loads", nargs="+", type=Load.parse,
                    default=[Load(64, 20), Load(256, 20), Load(1000, 5)],
                    help="STREAMSxTOKENS_PER_S each")
    ap.add_argument("--step-ms", type=float, default=20.0,
                    help="the step mode's step (every stream a token a step)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--daemon-core", default="0")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                    help="an argument more for the daemon (repeatable), e.g. "
                         "--daemon-arg=--poll-cadence=off for the A/B of the poll cadence")
    ap.add_argument("--client-cores", default="1",
                    help="this process's (the clients') and the peer's")
    args = ap.parse_args(argv)
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, parse_cores(args.client_cores))
    try:
        run(args)
    finally:
        os.sched_setaffinity(0, cores)
    return 0


def run(args: argparse.Namespace) -> None:
    bare = run_load(Load(SATURATED_STREAMS, 0), "replay", args.step_ms, args.daemon_core,
                    args.settle, args.seconds, tuple(args.daemon_arg))
    figures: dict[str, object] = {
        "machine": f"{os.cpu_count()} cores", "daemon core": args.daemon_core,
        "seconds measured": args.seconds, "daemon arguments": " ".join(args.daemon_arg),
        f"bare: saturated ({SATURATED_STREAMS} streams, unpaced peer), events/s":
            round(bare.events / bare.seconds),
        "bare: saturated, daemon us per event": round(bare.us_per_event, 1),
        "target": f"<= {TARGET_RATIO:g}x the saturated us per event and <= "
                  f"{TARGET_CORES:.0%} of a core at 64 x 20 tokens/s",
    }
    for load in args.loads:
        for mode in ("replay", "staggered", "step"):
            if mode == "staggered" and not load.tokens_per_s:
                continue
            f = run_load(load, mode, args.step_ms, args.daemon_core, args.settle,
                         args.seconds, tuple(args.daemon_arg))
            name = (f"{load} ({'replay' if mode == 'replay' else 'replay, out of step'})"
                    if mode != "step" else f"{load.streams} streams, a {args.step_ms:g} ms step")
            figures[f"{name}: events/s, daemon us per event (x saturated), share of a core"] = (
                f"{f.events / f.seconds:.0f}, {f.us_per_event:.1f} "
                f"({f.us_per_event / bare.us_per_event:.1f}x), {f.cores:.1%}")
            figures[f"{name}: cadence skips/s, late bursts/s"] = (
                f"{f.skips / f.seconds:.0f}, {f.late / f.seconds:.1f}")
    record("light_load", figures)


if __name__ == "__main__":
    raise SystemExit(main())
