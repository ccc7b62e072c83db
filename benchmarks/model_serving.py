"""The model behind the daemon under load: ShareGPT lengths, Poisson arrivals, a ladder of rates.

On a GPU machine: ``dpu-frontend model-peer`` (random bf16 weights, Qwen3-0.6B
shapes) and a daemon with ``--workers`` worker processes over the shm
transport, and this process as the load generator on the remaining cores.
Each request is a ShareGPT (prompt, output) length pair
(``benchmarks/sharegpt_lengths.py``): a prompt of that many token ids and
``max_tokens`` of the output with ``ignore_eos``, streamed. For each rate it
reports output tokens/s, TTFT and TPOT p50/p99, and the peer process's CPU
seconds per 1,000 generated tokens (the host-driven figure the CPU-free path
drives to zero). Beside them, the bound: the decode throughput the GPU's copy
bandwidth allows for the same mix (every weight and the K and V of each
sequence's context read once per step, at the batch the peer allows).

    python -m benchmarks.sharegpt_lengths --out build/sharegpt-lengths.json   # with network
    python -m benchmarks.model_serving --lengths build/sharegpt-lengths.json --rates 4 16 64 inf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import torch

from benchmarks.common import record
from benchmarks.model_step import copy_bandwidth
from dpu_frontend.model.config import ModelConfig
from tests.stack import MODEL, running_stack

VOCAB_LOW, VOCAB_HIGH = 100, 150_000


@dataclass
class Result:
    ttft: float
    tpot: float | None
    tokens: int


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> Result:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            if not raw.startswith(b"data: {"):
                continue
            chunk = json.loads(raw[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                now = time.perf_counter()
                first = first or now
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None or last is None:
        raise RuntimeError("a stream without a token")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Result(first - start, tpot, tokens)


async def run_rate(url: str, pairs: list[tuple[int, int]], rate: float, count: int,
                   rng: random.Random) -> tuple[list[Result], float]:
    """``count`` requests, Poisson arrivals at ``rate`` per second (inf: all at once)."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        start = time.perf_counter()
        for _ in range(count):
            p, o = rng.choice(pairs)
            prompt = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(p)]
            tasks.append(asyncio.create_task(one(session, url, prompt, o)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bound_tokens_per_s(pairs: list[tuple[int, int]], batch: int, bandwidth: float) -> float:
    """Decode tokens/s the copy bandwidth allows with ``batch`` sequences running, at the
    mix's mean context per generated token (a sequence's k-th token reads p + k)."""
    config = ModelConfig.default()
    weights = config.parameter_count() * 2
    generated = sum(o for _, o in pairs)
    context = sum(o * (p + o / 2) for p, o in pairs) / generated
    step_bytes = weights + batch * context * config.kv_bytes_per_token(2)
    return batch / (step_bytes / bandwidth)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=Path, default=Path("build/sharegpt-lengths.json"))
    ap.add_argument("--rates", type=float, nargs="+", default=[4, 16, 64, float("inf")])
    ap.add_argument("--requests", type=int, default=400, help="per rate")
    ap.add_argument("--workers", type=int, default=2, help="daemon worker processes")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=20261126)
    args = ap.parse_args(argv)

    pairs = [tuple(p) for p in json.loads(args.lengths.read_text())["pairs"]]
    rng = random.Random(args.seed)
    bandwidth = copy_bandwidth(torch.device("cuda", 0), size=2 << 30)
    peer_args = ("--channels", str(args.workers), "--max-seqs", str(args.max_seqs),
                 "--max-model-len", "4096", "--max-sequences", "1024", "--resp-slots", "2048")
    figures: dict[str, object] = {
        "lengths": f"{len(pairs)} ShareGPT pairs, prompt mean "
                   f"{statistics.mean(p for p, _ in pairs):.0f}, output mean "
                   f"{statistics.mean(o for _, o in pairs):.0f} tokens",
        "daemon workers": args.workers, "max sequences per step": args.max_seqs,
        "copy bandwidth (bare limit), GB/s": round(bandwidth / 1e9, 1),
        f"bound at batch {args.max_seqs}, output tokens/s":
            round(bound_tokens_per_s(pairs, args.max_seqs, bandwidth)),
    }
    serve_args = ("--workers", str(args.workers), "--max-queued-requests", "10000")
    with running_stack("shm", timeout=900, peer_command="model-peer", peer_args=peer_args,
                       serve_args=serve_args) as stack:
        pid = stack.peers[0].proc.pid
        asyncio.run(run_rate(stack.base_url, pairs[:8], float("inf"), 8, rng))  # warm up
        for rate in args.rates:
            cpu0 = cpu_seconds(pid)
            results, elapsed = asyncio.run(run_rate(stack.base_url, pairs, rate, args.requests, rng))
            cpu = cpu_seconds(pid) - cpu0
            tokens = sum(r.tokens for r in results)
            ttft = [r.ttft * 1e3 for r in results]
            tpot = [r.tpot * 1e3 for r in results if r.tpot is not None]
            name = "saturation" if rate == float("inf") else f"{rate:g} req/s"
            figures[f"{name}: output tokens/s"] = round(tokens / elapsed)
            figures[f"{name}: TTFT p50 / p99, ms"] = (f"{percentile(ttft, 0.5):.0f} / "
                                                      f"{percentile(ttft, 0.99):.0f}")
            figures[f"{name}: TPOT p50 / p99, ms"] = (f"{percentile(tpot, 0.5):.1f} / "
                                                      f"{percentile(tpot, 0.99):.1f}")
            figures[f"{name}: peer CPU s per 1,000 tokens"] = round(cpu / tokens * 1000, 3)
    record("model_serving", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
