"""An open-loop load generator for the OpenAI streaming API, in several processes.

One Python process parsing every SSE event can be the bound itself at a
GPU's output rates (tens of thousands of events a second). So the arrival schedule (Poisson at a
rate, or all at once) is drawn once, in the parent, and dealt round-robin to
``clients`` processes, each an asyncio loop with its own connections; all
start at one wall-clock instant, so arrivals keep the schedule's times.
Each event costs a client a byte search, not a JSON parse: only an error
event and the final usage event are parsed.

Per request it records the arrival (offset in the schedule), TTFT, the
time of the last token, the completion tokens (from ``usage``) and the
events received; ``summary`` turns a run into the figures the benchmarks
report. The clients' own CPU seconds are measured too: a load generator
near a full core per process is itself the bound, and the report says so.

    from benchmarks.loadgen import Job, run
    results = run("http://127.0.0.1:8000", jobs, rate=64.0, clients=4)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import random
import resource
import statistics
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from tests.stack import MODEL


@dataclass(frozen=True, slots=True)
class Job:
    """One request: a prompt (token ids or text) and how many tokens to ask for."""

    prompt: list[int] | str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Result:
    arrival: float  # seconds into the schedule
    ttft: float  # seconds from sending to the first token
    duration: float  # seconds from sending to the last token
    tokens: int  # completion tokens (usage)
    events: int  # SSE events with text
    #: Seconds between consecutive text events (the inter-token latency where each
    #: event carries one token).
    gaps: tuple[float, ...] = ()

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        return (self.duration - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass(frozen=True, slots=True)
class Run:
    results: list[Result]
    elapsed: float  # first arrival to the last response's end
    client_cpu_s: float  # the client processes' user + system seconds
    clients: int


def schedule(count: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival offsets: Poisson at ``rate`` per second, or all at 0 (``inf``)."""
    at, out = 0.0, []
    for _ in range(count):
        out.append(at)
        if rate != float("inf"):
            at += rng.expovariate(rate)
    return out


def run(url: str, jobs: list[Job], rate: float, *, clients: int = 4,
        seed: int = 1, extra: dict[str, Any] | None = None) -> Run:
    """Send ``jobs`` at ``rate`` (per second; inf: all at once) from ``clients``
    processes; every request streams with ``ignore_eos`` and greedy sampling."""
    arrivals = schedule(len(jobs), rate, random.Random(seed))
    start = time.time() + 0.5 + 0.05 * clients  # time for the processes to start
    body = _body(extra)
    shares = [[(arrivals[i], jobs[i]) for i in range(k, len(jobs), clients)]
              for k in range(clients)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(clients) as pool:
        parts = pool.starmap(_client, [(url, share, start, body) for share in shares])
    results = [r for part, _ in parts for r in part]
    ends = [r.arrival + r.duration for r in results]
    return Run(results, max(ends, default=0.0), sum(cpu for _, cpu in parts), clients)


def run_closed(url: str, jobs: list[Job], streams: int, seconds: float, *,
               clients: int = 4, extra: dict[str, Any] | None = None) -> Run:
    """Hold ``streams`` streams open for ``seconds`` (closed loop): each sends its next job
    the moment its last one ends, taking ``jobs`` in turn. At the end, the streams still
    open are closed where they are: their tokens so far count (one an event)."""
    start = time.time() + 0.5 + 0.05 * clients
    body = _body(extra)
    shares = [(streams // clients + (k < streams % clients), jobs[k::clients] or jobs)
              for k in range(clients)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(clients) as pool:
        parts = pool.starmap(_client_closed, [(url, share, slots, start, seconds, body)
                                              for slots, share in shares])
    results = [r for part, _ in parts for r in part]
    return Run(results, seconds, sum(cpu for _, cpu in parts), clients)


def _body(extra: dict[str, Any] | None) -> dict[str, Any]:
    return {"model": MODEL, "stream": True, "ignore_eos": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}} | (extra or {})


def _client(url: str, share: list[tuple[float, Job]], start: float,
            body: dict[str, Any]) -> tuple[list[Result], float]:
    return _timed(_client_loop(url, share, start, body))


def _client_closed(url: str, share: list[Job], slots: int, start: float, seconds: float,
                   body: dict[str, Any]) -> tuple[list[Result], float]:
    return _timed(_closed_loop(url, share, slots, start, seconds, body))


def _timed(loop: Coroutine[Any, Any, list[Result]]) -> tuple[list[Result], float]:
    """The client's results, and the CPU seconds it spent on them."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    results = asyncio.run(loop)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return results, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


async def _closed_loop(url: str, share: list[Job], slots: int, start: float, seconds: float,
                       body: dict[str, Any]) -> list[Result]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    results: list[Result] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.sleep(max(0.0, start - time.time()))
        origin = time.perf_counter() - (time.time() - start)
        until = origin + seconds

        async def stream(k: int) -> None:
            while time.perf_counter() < until:
                job = share[k % len(share)]
                k += slots
                request = body | {"prompt": job.prompt, "max_tokens": job.max_tokens}
                result = await _one(session, url, request, time.perf_counter() - origin,
                                    until)
                if result.tokens:  # not one cut before its first token
                    results.append(result)

        await asyncio.gather(*(stream(k) for k in range(slots)))
    return results


async def _client_loop(url: str, share: list[tuple[float, Job]], start: float,
                       body: dict[str, Any]) -> list[Result]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.sleep(max(0.0, start - time.time()))
        origin = time.perf_counter() - (time.time() - start)  # the schedule's 0
        tasks = []
        for arrival, job in share:
            delay = origin + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(
                _one(session, url, body | {"prompt": job.prompt, "max_tokens": job.max_tokens},
                     arrival)))
        return list(await asyncio.gather(*tasks))


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               arrival: float, until: float = float("inf")) -> Result:
    """One streamed request; past ``until`` (perf_counter), it is left where it is and
    its events so far count as its tokens."""
    sent = time.perf_counter()
    first = last = ended = None
    tokens = events = 0
    times: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            if until != float("inf") and time.perf_counter() > until:
                resp.close()  # the run is over: this stream is cut, not finished
                tokens = tokens or events
                if first is None or last is None:
                    return Result(arrival, 0.0, 0.0, 0, 0)
                return Result(arrival, first - sent, last - sent, tokens, events,
                              _gaps(times))
            if not raw.startswith(b"data: {"):
                continue
            if b'"error"' in raw[:16]:
                raise RuntimeError(f"the stream ended with an error: {raw.decode()}")
            ended = time.perf_counter()
            if b'"usage": {' in raw:
                usage = json.loads(raw[6:])["usage"]
                tokens = usage["completion_tokens"]
                if b'"text": ""' in raw or b'"choices": []' in raw:
                    continue
            if b'"text": "' in raw and b'"text": ""' not in raw:
                last = ended
                first = first or last
                events += 1
                times.append(ended)
    if not tokens or ended is None:
        raise RuntimeError(f"a stream without a token (HTTP {resp.status})")
    if first is None or last is None:
        # Tokens without text (random weights draw special tokens, or a lone piece
        # of a UTF-8 character): the client saw them when the stream ended.
        first = last = ended
    return Result(arrival, first - sent, last - sent, tokens, events, _gaps(times))


def _gaps(times: list[float]) -> tuple[float, ...]:
    return tuple(b - a for a, b in itertools.pairwise(times))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def full_batch_tokens_per_s(results: list[Result], width: int) -> float:
    """Output tokens/s while at least ``width`` requests were in flight (a server of
    that batch width kept full): a run of requests sent at once ends in a tail of a
    few long answers, which the whole run's average counts in. Each request's tokens
    are taken as spread evenly from its first token to its last."""
    ends = sorted(r.arrival + r.duration for r in results)
    if len(ends) < width:
        return 0.0
    until = ends[len(ends) - width]  # from here fewer than ``width`` remain
    tokens = 0.0
    for r in results:
        first, last = r.arrival + r.ttft, r.arrival + r.duration
        if r.tokens <= 1 or last <= first:
            tokens += r.tokens if last <= until else 0
            continue
        tokens += r.tokens * max(0.0, min(last, until) - first) / (last - first)
    return tokens / until if until > 0 else 0.0


def summary(done: Run, name: str, full_batch: int = 0) -> dict[str, object]:
    """The figures of one run, keyed ``"{name}: ..."``; with ``full_batch``, the
    output tokens/s while that many requests were in flight."""
    tokens = sum(r.tokens for r in done.results)
    ttft = [r.ttft * 1e3 for r in done.results]
    tpot = [t * 1e3 for r in done.results if (t := r.tpot) is not None]
    return {
        f"{name}: output tokens/s": round(tokens / done.elapsed) if done.elapsed else 0,
        f"{name}: TTFT p50 / p99, ms": f"{percentile(ttft, 0.5):.0f} / {percentile(ttft, 0.99):.0f}",
        f"{name}: TPOT p50 / p99, ms": f"{percentile(tpot, 0.5):.1f} / {percentile(tpot, 0.99):.1f}",
        f"{name}: client CPU, cores busy of {done.clients}":
            round(done.client_cpu_s / done.elapsed, 2) if done.elapsed else 0,
        f"{name}: mean tokens per request": round(statistics.mean(
            r.tokens for r in done.results), 1) if done.results else 0,
    } | ({f"{name}: output tokens/s while {full_batch} or more were in flight":
          round(full_batch_tokens_per_s(done.results, full_batch))} if full_batch else {})
