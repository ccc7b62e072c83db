"""The daemon under a GPU's load: decode steps, one token a record, a ladder of rates.

The reference peer in GPU-like steps (``--step-ms``, ``--batch``: every step each
running sequence gets one token, a burst of one-token records, at most ``--batch``
sequences running and the rest waiting), a daemon with ``--workers`` worker
processes pinned to ``--daemon-cores`` (standing in for the DPU's Arm cores), and
the load generator (``benchmarks.loadgen``, ``--clients`` processes) on the other
cores. Requests have ShareGPT lengths (``benchmarks.sharegpt_lengths``; without that
file, 100-token prompts and 200-token answers) with text prompts of about that many
tokens, so admission tokenizes for real. Arrivals are Poisson at each rate of the
ladder (``inf``: all at once).

Per rate: delivered tokens/s and SSE events/s; TTFT and inter-token latency
p50/p90/p99 beside the step period that paces them (what lies above a step is the
frontend's, the ring's and the load generator's); the daemon's CPU per 1,000 tokens
and per request (from /proc) and its RSS. Beside them, the bare limit measured in
the same run: aiohttp streaming canned one-token SSE events (``benchmarks.bare_sse``)
pinned the same way and driven the same way, as events/s per core.

    python -m benchmarks.frontend_load --rates 20 50 100 inf --requests 400
    python -m benchmarks.frontend_load --json build/frontend_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

from benchmarks.common import cpu_seconds, py_spy, record
from benchmarks.e2e_stream import cpu_list
from benchmarks.loadgen import Job, Run, percentile, run
from dpu_frontend.softroce.processes import DAEMON_READY, start, stop
from tests.stack import running_stack

#: Without ShareGPT lengths: (prompt, output) tokens of every request.
DEFAULT_PAIR = (100, 200)
WORD = " ring"  # one token of the bundled tokenizer, so a prompt of n words is ~n tokens


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and its live children, from /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return 0
    own = next((int(line.split()[1]) * 1024 for line in status.splitlines()
                if line.startswith("VmRSS:")), 0)
    return own + sum(rss_bytes(int(child)) for child in children)


def load_pairs(path: Path, cap: int) -> list[tuple[int, int]]:
    if not path.is_file():
        return [DEFAULT_PAIR]
    pairs = [(int(p), int(o)) for p, o in json.loads(path.read_text())["pairs"]]
    return [(min(p, cap), min(o, cap)) for p, o in pairs if p > 0 and o > 0]


def jobs(pairs: list[tuple[int, int]], count: int, rng: random.Random) -> list[Job]:
    picked = [rng.choice(pairs) for _ in range(count)]
    return [Job("Q" + WORD * (p - 1), o) for p, o in picked]


def figures(name: str, done: Run, step_ms: float, cpu_s: float) -> dict[str, object]:
    tokens = sum(r.tokens for r in done.results)
    events = sum(r.events for r in done.results)
    ttft = [r.ttft * 1e3 for r in done.results]
    gaps = [g * 1e3 for r in done.results for g in r.gaps]

    def pcts(values: list[float]) -> str:
        return " / ".join(f"{percentile(values, q):.1f}" for q in (0.5, 0.9, 0.99))

    elapsed = done.elapsed or float("nan")
    return {
        f"{name}: tokens/s delivered": round(tokens / elapsed),
        f"{name}: SSE events/s": round(events / elapsed),
        f"{name}: TTFT p50 / p90 / p99, ms (a step is {step_ms:g})": pcts(ttft),
        f"{name}: inter-token p50 / p90 / p99, ms (a step is {step_ms:g})": pcts(gaps),
        f"{name}: daemon CPU s per 1,000 tokens": round(cpu_s / tokens * 1e3, 4) if tokens else 0,
        f"{name}: daemon CPU ms per request": round(cpu_s / len(done.results) * 1e3, 2),
        f"{name}: daemon cores busy": round(cpu_s / elapsed, 2),
        f"{name}: load generator cores busy of {done.clients}":
            round(done.client_cpu_s / elapsed, 2),
    }


def bare_limit(cores: str | None, count: int, tokens: int, clients: int) -> float:
    """Events/s per core of aiohttp streaming canned events, pinned as the daemon is,
    ``count`` streams of ``tokens`` events at once."""
    prefix = ["taskset", "-c", cores] if cores else []
    proc, url = start([*prefix, sys.executable, "-m", "benchmarks.bare_sse", "--events",
                       str(tokens)], DAEMON_READY, timeout=60)
    try:
        cpu0 = cpu_seconds(proc.pid)
        done = run(url, [Job("bare", tokens)] * count, float("inf"), clients=clients,
                   extra={"model": "bare"})
        cpu = cpu_seconds(proc.pid) - cpu0
    finally:
        stop(proc)
    events = sum(r.events for r in done.results)
    return events / cpu if cpu else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[20, 50, 100, float("inf")],
                    help="requests/s, Poisson (inf: all at once)")
    ap.add_argument("--requests", type=int, default=400, help="requests at each rate")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the peer's decode step")
    ap.add_argument("--batch", type=int, default=1024, help="sequences a step decodes")
    ap.add_argument("--lengths", type=Path, default=Path("build/sharegpt-lengths.json"))
    ap.add_argument("--cap", type=int, default=1024, help="longest prompt and answer, tokens")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--daemon-cores", default="0" if (os.cpu_count() or 1) > 1 else None,
                    help="taskset -c LIST for the daemon (default 0); the rest run the load")
    ap.add_argument("--clients", type=int, default=1, help="load generator processes")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--py-spy", type=Path, metavar="DIR",
                    help="profile the daemon (py-spy, CPU samples) at each rate, into DIR")
    args = ap.parse_args(argv)

    prefix: tuple[str, ...] = ()
    affinity = os.sched_getaffinity(0)
    if args.daemon_cores:
        prefix = ("taskset", "-c", args.daemon_cores)
        os.sched_setaffinity(0, (affinity - cpu_list(args.daemon_cores)) or affinity)
    try:
        out = measure(args, prefix)
    finally:
        os.sched_setaffinity(0, affinity)  # a caller (the smoke test) keeps its cores
    record("frontend_load", out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def measure(args: argparse.Namespace, prefix: tuple[str, ...]) -> dict[str, object]:
    """The stack at every rate, then the bare limit: the figures."""
    pairs = load_pairs(args.lengths, args.cap)
    rng = random.Random(7)
    most = max(args.batch, args.requests)
    peer_args = ("--step-ms", str(args.step_ms), "--batch", str(args.batch),
                 "--tokens-per-step", "1", "--max-sequences", str(most),
                 "--resp-slots", str(2 * most))
    serve_args = ("--workers", str(args.workers), "--max-queued-requests", str(4 * most))
    out: dict[str, object] = {
        "lengths": f"{len(pairs)} ShareGPT pairs" if len(pairs) > 1 else
        f"no {args.lengths}: every request {DEFAULT_PAIR[0]} prompt / {DEFAULT_PAIR[1]} answer tokens",
        "peer": f"a step every {args.step_ms:g} ms, up to {args.batch} sequences, one token a record",
        "daemon": f"{args.workers} worker(s) on cores {args.daemon_cores or 'any'}",
    }
    with running_stack("shm", tokens_per_s=0, timeout=300, peer_args=peer_args,
                       serve_args=serve_args, daemon_prefix=prefix) as stack:
        daemon = stack.daemon.pid
        run(stack.base_url, jobs(pairs, 4, rng), float("inf"), clients=1)  # warm up
        out["daemon RSS at start, MB"] = round(rss_bytes(daemon) / 2**20, 1)
        saturation_events = 0.0
        for rate in args.rates:
            name = "all at once" if rate == float("inf") else f"{rate:g} req/s"
            cpu0 = cpu_seconds(daemon)
            spy = (args.py_spy / f"daemon-{name.replace(' ', '-').replace('/', '-per-')}.txt"
                   if args.py_spy else None)
            with py_spy(daemon, spy, idle=False):
                done = run(stack.base_url, jobs(pairs, args.requests, rng), rate,
                           clients=args.clients, seed=rng.randrange(1 << 30))
            cpu = cpu_seconds(daemon) - cpu0
            out |= figures(name, done, args.step_ms, cpu)
            if cpu:
                saturation_events = max(saturation_events,
                                        sum(r.events for r in done.results) / cpu)
        out["daemon RSS at the end, MB"] = round(rss_bytes(daemon) / 2**20, 1)
    mean_output = round(sum(o for _, o in pairs) / len(pairs))
    bare = bare_limit(args.daemon_cores, min(args.requests, 1000), mean_output, args.clients)
    out["daemon SSE events per CPU second (the best rate)"] = round(saturation_events)
    out[f"bare limit: aiohttp canned events per CPU second ({mean_output}-event streams)"] = \
        round(bare)
    out["daemon / bare limit"] = round(saturation_events / bare, 2) if bare else "-"
    return out


if __name__ == "__main__":
    raise SystemExit(main())
