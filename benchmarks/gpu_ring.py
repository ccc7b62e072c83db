"""The ring against the CUDA peer, beside the Python reference peer in the same run.

A DPU-side client (the daemon's own ``PeerSession``/``DpuChannel`` over the shm
transport, no HTTP) drives one channel of a peer process whose rings live in
host memory mapped into the GPU. For each peer it measures:

* request-to-first-record latency: from the poll batch that carries a
  request's commit WRITE to the poll that returns its record (CPU store ->
  kernel intake -> step -> publish -> CPU sees it), one request at a time;
* records and tokens per second with 1, 64 and 1000 streams kept open (one
  token per record per step, as a decode step gives);
* the peer process's CPU seconds per 1,000 tokens over that window (/proc,
  10 ms ticks): the launcher's, for the CUDA peer, which should be about zero.

The client is Python on one pinned core, so at high rates it is the client's
limit that shows: it is the same client for both peers, and its own bare
limit (polling an idle ring) is printed beside them.

    python -m benchmarks.gpu_ring                      # both peers
    python -m benchmarks.gpu_ring --peers peer         # the Python peer only (no GPU)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import record
from dpu_frontend.config import PeerAddress, ServeConfig
from dpu_frontend.engine.session import PeerSession
from dpu_frontend.ring import SamplingParams
from dpu_frontend.softroce.processes import CLI, PEER_READY, start, stop

CLIENT_CORE = 0
PEER_CORES = "2-5"


def cpu_seconds(pid: int) -> float:
    if not pid:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Client:
    def __init__(self, session: PeerSession) -> None:
        assert session.channel is not None and session.transport is not None
        self.ring, self.transport = session.channel, session.transport
        self.ids = iter(range(1, 1 << 62))
        self.open: set[int] = set()

    def submit(self, params: SamplingParams, prompt: list[int]) -> int:
        request_id = next(self.ids)
        self.ring.submit(request_id, prompt, params)
        self.open.add(request_id)
        return request_id

    async def poll(self) -> list[Any]:
        poll = self.ring.begin_poll()
        data = await self.transport.exchange(poll.writes, poll.reads)
        records, more = self.ring.end_poll(poll, data, time.monotonic())
        for op in more:
            records += self.ring.on_records(op, await self.transport.read(op))
        return records

    async def latency(self, samples: int) -> list[float]:
        out = []
        for i in range(samples):
            request_id = self.submit(SamplingParams(max_tokens=1), [i % 1000 + 1, 2, 3])
            start_at = time.perf_counter()  # this poll's batch carries the commit WRITE
            while not any(r.request_id == request_id for r in await self.poll()):
                pass
            self.open.discard(request_id)
            out.append(time.perf_counter() - start_at)
        return out

    async def throughput(self, streams: int, seconds: float, pid: int) -> dict[str, float]:
        params = SamplingParams(max_tokens=256, ignore_eos=True)
        for _ in range(streams):
            self.submit(params, [7, 8, 9])
        records = tokens = 0
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for r in await self.poll():
                records += 1
                tokens += len(r.tokens)
                if r.final:
                    self.open.discard(r.request_id)
                    self.submit(params, [7, 8, 9])
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
        for request_id in self.open:  # cancel what is left before the next run
            self.ring.cancel(request_id)
        self.open.clear()
        deadline = time.perf_counter() + 30
        while (self.ring.open_sequences or self.ring.queued) and time.perf_counter() < deadline:
            await self.poll()
        return {"records/s": records / elapsed, "tokens/s": tokens / elapsed,
                "peer CPU s in the window": cpu,
                "peer CPU s per 1000 tokens": cpu / max(tokens, 1) * 1000}

    async def idle_polls(self, seconds: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await self.poll()
            n += 1
        return n / (time.perf_counter() - t0)


async def measure(command: str, args: argparse.Namespace) -> dict[str, Any]:
    if args.peer_address:
        return await measure_at(PeerAddress.parse(args.peer_address), 0, args)
    shm = f"/dev/shm/dpu-frontend-bench-{os.getpid()}-{command}"
    argv = ["taskset", "-c", PEER_CORES, *CLI, command, "--transport", "shm", "--port", "0",
            "--shm-path", shm, "--tokens-per-step", "1", "--max-sequences", "1024",
            "--resp-slots", "2048"]
    if command == "peer":
        argv += ["--tokens-per-s", "0"]
    proc, address = start(argv, PEER_READY, 300)
    try:
        return await measure_at(PeerAddress.parse(address), proc.pid, args)
    finally:
        stop(proc)


async def measure_at(peer: PeerAddress, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """Measure the peer at ``peer`` (``pid`` 0: one started elsewhere, CPU not read)."""
    session = await PeerSession.connect(ServeConfig(peers=(peer,), transport="shm"), peer)
    try:
        client = Client(session)
        await client.latency(50)  # warm up
        lat = sorted(await client.latency(args.samples))
        out: dict[str, Any] = {
            "request->first record p50 us": round(statistics.median(lat) * 1e6, 1),
            "request->first record p99 us": round(lat[int(len(lat) * 0.99)] * 1e6, 1),
        }
        for streams in args.streams:
            figures = await client.throughput(streams, args.seconds, pid)
            for key, value in figures.items():
                out[f"{streams} streams: {key}"] = round(value, 6 if "CPU" in key else 0)
        out["client bare limit: idle polls/s"] = round(await client.idle_polls(1.0))
        return out
    finally:
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", nargs="+", default=["gpu-peer", "peer"])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 1000])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--peer-address", default=None,
                        help="measure a peer started elsewhere (e.g. under compute-sanitizer)")
    args = parser.parse_args()
    os.sched_setaffinity(0, {CLIENT_CORE})
    for command in [f"at {args.peer_address}"] if args.peer_address else args.peers:
        record(f"gpu_ring {command}", asyncio.run(measure(command, args)))


if __name__ == "__main__":
    main()
