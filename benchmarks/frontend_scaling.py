"""Scale-out: ``serve --workers N``, N worker processes on N cores, against one.

For each worker count N, a fresh stack: the daemon pinned to cores 0..N-1 (the
DPU's Arm cores), ``--peers`` reference peers in GPU-like steps and the load
generator (``--clients`` processes) on the other cores; ``--streams`` streams
per worker held open for ``--seconds`` (closed loop), ShareGPT lengths. Per N:
SSE events/s delivered, the daemon's CPU per event and its cores busy, TTFT and
inter-token p99, and the throughput against N times that of one worker (linear).

    python -m benchmarks.frontend_scaling --workers 1 2 4 8 --streams 1000 --step-ms 25
    python -m benchmarks.frontend_scaling --json build/scaling.json --png build/plots
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Any

from benchmarks.common import cpu_seconds, record, rss_bytes
from benchmarks.frontend_load import load_workload, point, stack_args
from benchmarks.loadgen import run, run_closed
from tests.stack import running_stack


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--streams", type=int, default=1000, help="streams per worker")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--step-ms", type=float, default=25.0, help="the peers' decode step")
    ap.add_argument("--peers", type=int, default=1)
    ap.add_argument("--clients", type=int, default=1, help="load generator processes")
    ap.add_argument("--lengths", type=Path, default=Path("build/sharegpt-lengths.json"))
    ap.add_argument("--cap", type=int, default=1024)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path, metavar="DIR")
    args = ap.parse_args(argv)

    work = load_workload(args.lengths, args.cap)
    affinity = os.sched_getaffinity(0)
    cores = sorted(affinity)
    points: list[dict[str, Any]] = []
    out: dict[str, object] = {
        "load": f"{args.streams} streams a worker (closed loop), a step every "
                f"{args.step_ms:g} ms, {args.peers} peer(s), {args.clients} client process(es)"}
    try:
        for n in args.workers:
            if n >= len(cores):
                raise SystemExit(f"{n} workers leave no core for the load ({len(cores)} cores)")
            daemon_cores = ",".join(str(c) for c in cores[:n])
            os.sched_setaffinity(0, set(cores[n:]))  # peers and clients: the rest
            points.append(one(args, work, n, daemon_cores))
    finally:
        os.sched_setaffinity(0, affinity)
    one_worker = points[0]["events/s"] / points[0]["workers"]
    for p in points:
        name = f"{p['workers']} worker(s)"
        p["of linear"] = p["events/s"] / (one_worker * p["workers"]) if one_worker else 0.0
        out |= {f"{name}: SSE events/s": round(p["events/s"]),
                f"{name}: of linear": round(p["of linear"], 2),
                f"{name}: daemon CPU us per event": round(1e6 / p["events per CPU s"], 1)
                if p["events per CPU s"] else "-",
                f"{name}: daemon cores busy": round(p["cores busy"], 2),
                f"{name}: TTFT p99 / inter-token p99, ms":
                    f"{p['TTFT p99 ms']:.0f} / {p['ITL p99 ms']:.1f}",
                f"{name}: daemon RSS, MB": round(p["RSS MB"], 1)}
    record("frontend_scaling", out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out | {"points": points}, indent=2) + "\n")
    if args.png:
        from benchmarks.plots import scaling_plot
        print(f"  plot: {scaling_plot(points, args.png)}")
    return 0


def one(args: argparse.Namespace, work: Any, workers: int, daemon_cores: str) -> dict[str, Any]:
    streams = args.streams * workers
    per_peer = -(-streams // args.peers)
    peer_args, serve_args = stack_args(args.step_ms, per_peer, per_peer, workers)
    rng = random.Random(workers)
    with running_stack("shm", tokens_per_s=0, timeout=300, peer_args=peer_args,
                       serve_args=serve_args, peers=args.peers,
                       daemon_prefix=("taskset", "-c", daemon_cores)) as stack:
        daemon = stack.daemon.pid
        run(stack.base_url, work.jobs(4 * workers, rng), float("inf"), clients=1)  # warm up
        cpu0 = cpu_seconds(daemon)
        done = run_closed(stack.base_url, work.jobs(4 * streams, rng), streams, args.seconds,
                          clients=args.clients)
        cpu = cpu_seconds(daemon) - cpu0
        rss = rss_bytes(daemon)
    p = point("closed", streams, done, cpu)
    events = sum(r.events for r in done.results)
    return p | {"workers": workers, "events/s": events / done.elapsed, "RSS MB": rss / 2**20}


if __name__ == "__main__":
    raise SystemExit(main())
