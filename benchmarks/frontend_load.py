"""The daemon under a GPU's load: decode steps, one token a record, open and closed loops.

The reference peer in GPU-like steps (``--step-ms``, ``--batch``: every step each
running sequence gets one token, a burst of one-token records, at most ``--batch``
sequences running and the rest waiting), a daemon with ``--workers`` worker
processes pinned to ``--daemon-cores`` (standing in for the DPU's Arm cores), and
the load generator (``benchmarks.loadgen``, ``--clients`` processes) on the other
cores. Requests have ShareGPT lengths and, for the first 2,000, ShareGPT's prompt
texts (``benchmarks.sharegpt_lengths``; without that file, 100-token prompts and
200-token answers), so admission tokenizes real text.

* ``--rates``: open loop, Poisson arrivals at each rate of the ladder (``inf``: all
  at once), ``--requests`` each;
* ``--streams``: closed loop, that many streams held open for ``--seconds`` (each
  sends its next request when one ends), the per-core throughput figure;
* ``--admission``: requests of one token from that many closed-loop streams: the
  requests a daemon CPU second admits, tokenization and all.

Per run: delivered tokens/s and SSE events/s; TTFT and inter-token latency
p50/p90/p99 beside the step period that paces them (what lies above a step is the
frontend's, the ring's and the load generator's); the daemon's CPU per 1,000 tokens
and per request (from /proc) and its RSS. Beside them, the bare limits measured in
the same run, each figure also as a ratio to its limit: raw ``encode`` of the same
prompts, raw ``DecodeStream`` of the same outputs (the peer's corpus), and the bare
pipeline (``benchmarks.bare_sse --tokenizer``: detokenize, JSON chunk, aiohttp write)
pinned the same way at the same concurrency, all per CPU second.

    python -m benchmarks.frontend_load --rates 50 100 inf --streams 512 1000
    python -m benchmarks.frontend_load --json build/frontend_load.json --png build/plots
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from benchmarks.bare_sse import corpus_ids
from benchmarks.common import cpu_seconds, py_spy, record, rss_bytes
from benchmarks.e2e_stream import cpu_list, start_bare
from benchmarks.loadgen import Job, Run, percentile, run, run_closed
from dpu_frontend.softroce.processes import stop
from dpu_frontend.text.assets import default_tokenizer_dir
from tests.stack import running_stack

#: Without ShareGPT lengths: (prompt, output) tokens of every request.
DEFAULT_PAIR = (100, 200)
WORD = " ring"  # one token of the bundled tokenizer, so a prompt of n words is ~n tokens


@dataclass(frozen=True)
class Workload:
    pairs: list[tuple[int, int]]  # (prompt, output) tokens
    texts: list[str]  # the first pairs' prompt texts

    def jobs(self, count: int, rng: random.Random) -> list[Job]:
        """Requests of ShareGPT pairs: with the pair's prompt text where there is one,
        else a text of about that many tokens."""
        out = []
        for _ in range(count):
            k = rng.randrange(len(self.pairs))
            p, o = self.pairs[k]
            out.append(Job(self.texts[k] if k < len(self.texts) else "Q" + WORD * (p - 1), o))
        return out


def load_workload(path: Path, cap: int) -> Workload:
    if not path.is_file():
        return Workload([DEFAULT_PAIR], [])
    data = json.loads(path.read_text())
    pairs: list[tuple[int, int]] = []
    texts: list[str] = []
    for k, (p, o) in enumerate(data["pairs"]):
        if p > 0 and o > 0 and p <= cap:
            pairs.append((int(p), min(int(o), cap)))
            if k < len(data.get("prompts", [])) and len(texts) == len(pairs) - 1:
                texts.append(str(data["prompts"][k]))
    return Workload(pairs, texts)


def delivery_buckets(url: str) -> dict[float, float]:
    """The daemon's delivery histogram (``dpu_frontend_delivery_seconds``): cumulative
    count by upper bound, from its /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as page:
        text = page.read().decode()
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("dpu_frontend_delivery_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(bound)] = float(line.rsplit(" ", 1)[1])
    return out


def delivery_quantile(before: dict[float, float], after: dict[float, float],
                      q: float) -> float:
    """The bucket bound under which ``q`` of the run's delivery samples fall, ms."""
    counts = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    total = counts[-1][1] if counts else 0.0
    for bound, cumulative in counts:
        if total and cumulative >= q * total:
            return bound * 1e3
    return float("nan")


DELIVERY = "the daemon's own delay of a token (delivery) p50 / p99, at most, ms"


def delivery(before: dict[float, float], after: dict[float, float]) -> str:
    return " / ".join(f"{delivery_quantile(before, after, q):g}" for q in (0.5, 0.99))


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


def bare_pipeline(cores: str | None, count: int, tokens: int, clients: int,
                  step_ms: float) -> float:
    """Events per CPU second of the bare pipeline (``bare_sse --tokenizer``: detokenize,
    JSON chunk, aiohttp write), pinned as the daemon is, ``count`` streams of ``tokens``
    events at once, one event a stream every ``step_ms`` as the peer's steps pace the
    daemon."""
    proc, url = start_bare(tokens, "--tokenizer", str(default_tokenizer_dir()),
                           "--step-ms", str(step_ms),
                           prefix=("taskset", "-c", cores) if cores else ())
    try:
        cpu0 = cpu_seconds(proc.pid)
        done = run(url, [Job("bare", tokens)] * count, float("inf"), clients=clients,
                   extra={"model": "bare"})
        cpu = cpu_seconds(proc.pid) - cpu0
    finally:
        stop(proc)
    events = sum(r.events for r in done.results)
    return events / cpu if cpu else 0.0


def bare_encode(tokenizer: Tokenizer, texts: list[str]) -> tuple[float, float]:
    """Prompts and tokens per CPU second of ``Tokenizer.encode`` alone, one thread."""
    start_cpu = time.thread_time()
    tokens = sum(len(tokenizer.encode(text).ids) for text in texts)
    cpu = time.thread_time() - start_cpu
    return len(texts) / cpu, tokens / cpu


def bare_decode(tokenizer: Tokenizer, tokens: int) -> float:
    """Tokens per CPU second of ``DecodeStream.step``, one id a step, over the peer's
    corpus (what the reference peer generates)."""
    ids = corpus_ids(tokenizer)
    stream = DecodeStream(skip_special_tokens=True)
    start_cpu = time.thread_time()
    for k in range(tokens):
        stream.step(tokenizer, ids[k % len(ids)])
    return tokens / (time.thread_time() - start_cpu)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=float, nargs="*", default=[20, 50, 100, float("inf")],
                    help="open loop: requests/s, Poisson (inf: all at once)")
    ap.add_argument("--requests", type=int, default=400, help="requests at each rate")
    ap.add_argument("--streams", type=int, nargs="*", default=[512, 1000],
                    help="closed loop: streams held open, for --seconds each")
    ap.add_argument("--seconds", type=float, default=20.0, help="each closed-loop run")
    ap.add_argument("--admission", type=int, default=64, metavar="STREAMS",
                    help="admission: one-token requests from this many closed-loop streams "
                         "(0: none)")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the peer's decode step")
    ap.add_argument("--batch", type=int, default=1024, help="sequences a step decodes")
    ap.add_argument("--lengths", type=Path, default=Path("build/sharegpt-lengths.json"))
    ap.add_argument("--cap", type=int, default=1024, help="longest prompt and answer, tokens")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--peers", type=int, default=1, help="reference peer processes")
    ap.add_argument("--daemon-cores", default="0" if (os.cpu_count() or 1) > 1 else None,
                    help="taskset -c LIST for the daemon (default 0); the rest run the load")
    ap.add_argument("--clients", type=int, default=1, help="load generator processes")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--png", type=Path, metavar="DIR", help="plot the figures into DIR")
    ap.add_argument("--py-spy", type=Path, metavar="DIR",
                    help="profile the daemon (py-spy, CPU samples) in each run, into DIR")
    args = ap.parse_args(argv)

    prefix: tuple[str, ...] = ()
    affinity = os.sched_getaffinity(0)
    if args.daemon_cores:
        prefix = ("taskset", "-c", args.daemon_cores)
        os.sched_setaffinity(0, (affinity - cpu_list(args.daemon_cores)) or affinity)
    try:
        out, runs = measure(args, prefix)
    finally:
        os.sched_setaffinity(0, affinity)  # a caller (the smoke test) keeps its cores
    record("frontend_load", out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out | {"runs": runs}, indent=2) + "\n")
    if args.png:
        from benchmarks.plots import frontend_plots
        for path in frontend_plots(runs, args.png):
            print(f"  plot: {path}")
    return 0


def measure(args: argparse.Namespace,
            prefix: tuple[str, ...]) -> tuple[dict[str, object], list[dict[str, Any]]]:
    """The stack in every run, then the bare limits: the figures, and one entry a run
    for the plots."""
    work = load_workload(args.lengths, args.cap)
    rng = random.Random(7)
    most = max(args.batch, args.requests, *args.streams, args.admission)
    peer_args, serve_args = stack_args(args.step_ms, args.batch, most, args.workers)
    out: dict[str, object] = {
        "lengths": f"{len(work.pairs)} ShareGPT pairs, {len(work.texts)} with their prompt "
        "text" if len(work.pairs) > 1 else f"no {args.lengths}: every request "
        f"{DEFAULT_PAIR[0]} prompt / {DEFAULT_PAIR[1]} answer tokens",
        "peer": f"a step every {args.step_ms:g} ms, up to {args.batch} sequences, one token a record",
        "daemon": f"{args.workers} worker(s) on cores {args.daemon_cores or 'any'}",
    }
    runs: list[dict[str, Any]] = []
    best_events = 0.0
    admitted = 0.0

    def spy(name: str) -> Path | None:
        return args.py_spy / f"daemon-{name.replace(' ', '-').replace('/', '-per-')}.txt" \
            if args.py_spy else None

    with running_stack("shm", tokens_per_s=0, timeout=300, peer_args=peer_args,
                       serve_args=serve_args, daemon_prefix=prefix, peers=args.peers) as stack:
        daemon = stack.daemon.pid
        run(stack.base_url, work.jobs(4, rng), float("inf"), clients=1)  # warm up
        out["daemon RSS at start, MB"] = round(rss_bytes(daemon) / 2**20, 1)
        for rate in args.rates:
            name = "all at once" if rate == float("inf") else f"{rate:g} req/s"
            delivered = delivery_buckets(stack.base_url)
            cpu0 = cpu_seconds(daemon)
            with py_spy(daemon, spy(name), idle=False):
                done = run(stack.base_url, work.jobs(args.requests, rng), rate,
                           clients=args.clients, seed=rng.randrange(1 << 30))
            cpu = cpu_seconds(daemon) - cpu0
            out |= figures(name, done, args.step_ms, cpu)
            out[f"{name}: {DELIVERY}"] = delivery(delivered, delivery_buckets(stack.base_url))
            runs.append(point("open", rate, done, cpu))
        for streams in args.streams:
            name = f"{streams} streams"
            delivered = delivery_buckets(stack.base_url)
            cpu0 = cpu_seconds(daemon)
            with py_spy(daemon, spy(name), idle=False):
                done = run_closed(stack.base_url, work.jobs(4 * streams, rng), streams,
                                  args.seconds, clients=args.clients)
            cpu = cpu_seconds(daemon) - cpu0
            out |= figures(name, done, args.step_ms, cpu)
            out[f"{name}: {DELIVERY}"] = delivery(delivered, delivery_buckets(stack.base_url))
            out[f"{name}: daemon RSS, MB"] = round(rss_bytes(daemon) / 2**20, 1)
            runs.append(point("closed", streams, done, cpu))
            best_events = max(best_events, runs[-1]["events per CPU s"])
        if args.admission:
            cpu0 = cpu_seconds(daemon)
            one_token = [Job(j.prompt, 1) for j in work.jobs(2000, rng)]
            with py_spy(daemon, spy("admission"), idle=False):
                done = run_closed(stack.base_url, one_token, args.admission, args.seconds / 2,
                                  clients=args.clients)
            cpu = cpu_seconds(daemon) - cpu0
            admitted = len(done.results) / cpu if cpu else 0.0
            out[f"admission: requests per daemon CPU second ({args.admission} streams of "
                "one-token requests)"] = round(admitted)
        out["daemon RSS at the end, MB"] = round(rss_bytes(daemon) / 2**20, 1)
    out |= limits(args, work, runs, best_events, admitted)
    return out, runs


def stack_args(step_ms: float, batch: int, most: int,
               workers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The peer's arguments (decode steps of ``batch``, room for ``most`` sequences on a
    channel, a channel a daemon worker) and the daemon's."""
    peer = ("--step-ms", str(step_ms), "--batch", str(batch), "--tokens-per-step", "1",
            "--max-sequences", str(most), "--resp-slots", str(2 * most),
            "--channels", str(max(workers, 1)))
    serve = ("--workers", str(workers), "--max-queued-requests", str(4 * most))
    return peer, serve


def point(loop: str, load: float, done: Run, cpu: float) -> dict[str, Any]:
    """One run for the plots."""
    events = sum(r.events for r in done.results)
    tokens = sum(r.tokens for r in done.results)
    gaps = [g * 1e3 for r in done.results for g in r.gaps]
    ttft = [r.ttft * 1e3 for r in done.results]
    return {"loop": loop, "load": load if load != float("inf") else "inf",
            "tokens/s": tokens / done.elapsed if done.elapsed else 0.0,
            "events per CPU s": events / cpu if cpu else 0.0,
            "CPU us per token": cpu / tokens * 1e6 if tokens else 0.0,
            "cores busy": cpu / done.elapsed if done.elapsed else 0.0,
            "TTFT p50 ms": percentile(ttft, 0.5), "TTFT p99 ms": percentile(ttft, 0.99),
            "ITL p50 ms": percentile(gaps, 0.5), "ITL p99 ms": percentile(gaps, 0.99)}


def limits(args: argparse.Namespace, work: Workload, runs: list[dict[str, Any]],
           best_events: float, admitted: float) -> dict[str, object]:
    """The bare limits, measured now, beside the figures they bound."""
    out: dict[str, object] = {}
    texts = work.texts or [job.prompt for job in work.jobs(2000, random.Random(3))
                           if isinstance(job.prompt, str)]
    tokenizer = Tokenizer.from_file(str(default_tokenizer_dir() / "tokenizer.json"))
    prompts_per_s, tokens_per_s = bare_encode(tokenizer, texts)
    out["bare encode: prompts per CPU second (one thread)"] = round(prompts_per_s)
    out["bare encode: tokens per CPU second"] = round(tokens_per_s)
    if admitted:
        out["admission / bare encode"] = round(admitted / prompts_per_s, 2)
    out["bare DecodeStream: tokens per CPU second"] = round(bare_decode(tokenizer, 200_000))
    mean_output = round(sum(o for _, o in work.pairs) / len(work.pairs))
    # Paced, a stream of the mean output takes mean_output steps: at most --seconds.
    bare_events = max(2, int(args.seconds * 1e3 / args.step_ms))
    for streams in args.streams:
        mine = next(r for r in runs if r["loop"] == "closed" and r["load"] == streams)
        # Paced as the daemon is (a wake-up and a write a stream a step), and as fast as
        # it goes (the writes of a stream back to back: the floor of the framework).
        for name, step_ms in (("paced", args.step_ms), ("unpaced", 0.0)):
            bare = bare_pipeline(args.daemon_cores, streams, min(mean_output, bare_events),
                                 args.clients, step_ms)
            out[f"bare pipeline {name}, {streams} streams: events per CPU second"] = \
                round(bare)
            mine[f"bare {name} events per CPU s"] = bare
            out[f"{streams} streams: daemon events per CPU second / bare {name}"] = \
                round(mine["events per CPU s"] / bare, 2) if bare else "-"
    if best_events:
        out["daemon SSE events per CPU second (the best closed loop)"] = round(best_events)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
