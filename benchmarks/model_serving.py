"""The model behind the daemon under load: ShareGPT lengths, Poisson arrivals, a ladder of rates.

On a GPU machine: ``dpu-frontend model-peer`` (random bf16 weights; Qwen3-0.6B
shapes, or ``--model-config FILE``'s, handed to the peer; its engine loop on the
host or, ``--scheduler gpu``, inside the GPU) and a daemon with ``--workers``
worker processes over the shm
transport, and this process as the load generator on the remaining cores.
Each request is a ShareGPT (prompt, output) length pair
(``benchmarks/sharegpt_lengths.py``): a prompt of that many token ids and
``max_tokens`` of the output with ``ignore_eos``, streamed. For each rate it
reports output tokens/s, TTFT and TPOT p50/p99, and the peer process's CPU
seconds per 1,000 generated tokens (the host-driven figure the CPU-free path
drives to zero). Beside them, the bound: the decode throughput the GPU's copy
bandwidth allows for the same mix (every weight and the K and V of each
sequence's context read once per step, at the batch the peer allows). The load
generator is ``benchmarks.loadgen``: ``--clients`` processes, whose CPU is
reported beside the daemon's, so that neither passes for the model's limit.
At each rate the peer's engine counters give the steps it took, their GPU time,
and the bound of those very steps (``benchmarks.model_figures``): the same
figures with either ``--scheduler``, beside the host's work per step (host) or
the scheduler kernel's pass (gpu). Every bound is the model config's. With
``--guided-regex`` every request is constrained (structured output, walked on the
GPU); a regex whose end stays open (``[a-z ]+``: the end token is allowed, but the
weights rarely pick it among so many) keeps the output lengths those of the run
without, so the two runs' tokens/s compare.

    python -m benchmarks.sharegpt_lengths --out build/sharegpt-lengths.json   # with network
    python -m benchmarks.model_serving --lengths build/sharegpt-lengths.json --rates 4 16 64 inf
    python -m benchmarks.model_serving --model-config benchmarks/configs/qwen3-8b.json --scheduler gpu
    python -m benchmarks.model_serving --rates inf --max-seqs 64 --guided-regex '[a-z ]+'
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch

from benchmarks.common import cpu_seconds, engine_counters, py_spy, record
from benchmarks.loadgen import Job, run, summary
from benchmarks.model_figures import (
    BenchTokenizer,
    Precision,
    add_served_model_arguments,
    bound_tokens_per_s,
    describe,
    engine_figures,
    load_config,
    own_peer_flags,
)
from benchmarks.model_step import copy_bandwidth
from dpu_frontend.model.options import KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULERS
from tests.stack import running_stack


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=Path, default=Path("build/sharegpt-lengths.json"))
    ap.add_argument("--rates", type=float, nargs="+", default=[4, 16, 64, float("inf")])
    ap.add_argument("--requests", type=int, default=400, help="per rate")
    ap.add_argument("--workers", type=int, default=4, help="daemon worker processes")
    ap.add_argument("--clients", type=int, default=4, help="load generator processes")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=20261126)
    add_served_model_arguments(ap)
    ap.add_argument("--scheduler", choices=SCHEDULERS, default="host",
                    help="the model peer's engine loop: on the host, or inside the GPU")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                    help="the model peer's flag: FP8 linear weights (the bounds count them)")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="the model peer's flag: an FP8 KV cache (the bounds count it)")
    ap.add_argument("--peer-arg", action="append", default=[],
                    help="one more model-peer flag (repeat), e.g. --peer-arg=--no-overlap")
    ap.add_argument("--guided-regex", metavar="REGEX",
                    help="every request's answer within this regex (structured output, "
                         "walked on the GPU): its cost against the same run without")
    ap.add_argument("--py-spy", type=Path, metavar="DIR",
                    help="sample the model peer with py-spy at each rate, into DIR")
    args = ap.parse_args(argv)
    try:
        precision = Precision.of_flags(args.quantization, args.kv_cache_dtype)
        own_flags = own_peer_flags(args.model_config, args.scheduler, args.peer_arg, precision)
    except ValueError as exc:
        ap.error(str(exc))

    config, origin = load_config(args.model_config)
    try:
        tokenizer = BenchTokenizer.load(args.tokenizer, config)
    except ValueError as exc:
        ap.error(str(exc))
    pairs = [tuple(p) for p in json.loads(args.lengths.read_text())["pairs"]]
    rng = random.Random(args.seed)
    bandwidth = copy_bandwidth(torch.device("cuda", 0), size=2 << 30)
    peer_args = ("--channels", str(args.workers), "--max-seqs", str(args.max_seqs),
                 "--max-model-len", "4096", "--max-sequences", "1024", "--resp-slots", "2048",
                 *own_flags, *tokenizer.flags(), *args.peer_arg)
    figures: dict[str, object] = {
        "model config": origin, "model": describe(config), "scheduler": args.scheduler,
        "precision": precision.describe(), "tokenizer": tokenizer.name,
        "lengths": f"{len(pairs)} ShareGPT pairs, prompt mean "
                   f"{statistics.mean(p for p, _ in pairs):.0f}, output mean "
                   f"{statistics.mean(o for _, o in pairs):.0f} tokens",
        "daemon workers": args.workers, "load generator processes": args.clients,
        "max sequences per step": args.max_seqs, "model peer flags": " ".join(args.peer_arg),
        "constraint": f"guided_regex {args.guided_regex!r}" if args.guided_regex else "none",
        "copy bandwidth (bare limit), GB/s": round(bandwidth / 1e9, 1),
        f"bound at batch {args.max_seqs}, output tokens/s":
            round(bound_tokens_per_s(config, pairs, args.max_seqs, bandwidth, precision)),
    }
    serve_args = ("--workers", str(args.workers), "--max-queued-requests", "10000",
                  *tokenizer.flags())

    extra = {"guided_regex": args.guided_regex} if args.guided_regex else None

    def jobs(count: int) -> list[Job]:
        chosen = [rng.choice(pairs) for _ in range(count)]
        return [Job(tokenizer.prompt_ids(rng, p), o) for p, o in chosen]

    with running_stack("shm", timeout=900, peer_command="model-peer", peer_args=peer_args,
                       serve_args=serve_args) as stack:
        peer, daemon = stack.peers[0].proc.pid, stack.daemon.pid
        run(stack.base_url, jobs(8), float("inf"), clients=1, extra=extra)  # warm up
        for rate in args.rates:
            cpu0 = cpu_seconds(peer), cpu_seconds(daemon)
            engine0 = engine_counters(stack.peer_address())
            name = "saturation" if rate == float("inf") else f"{rate:g} req/s"
            spy = args.py_spy / f"peer-{name.split()[0]}.txt" if args.py_spy else None
            with py_spy(peer, spy):
                done = run(stack.base_url, jobs(args.requests), rate, clients=args.clients,
                           seed=rng.randrange(1 << 30), extra=extra)
            tokens = sum(r.tokens for r in done.results)
            figures |= summary(done, name, full_batch=args.max_seqs if rate == float("inf") else 0)
            figures |= engine_figures(name, config, engine0,
                                      engine_counters(stack.peer_address()),
                                      tokens / done.elapsed, bandwidth, precision)
            figures[f"{name}: peer CPU s per 1,000 tokens"] = round(
                (cpu_seconds(peer) - cpu0[0]) / tokens * 1000, 3)
            figures[f"{name}: daemon CPU, cores busy of {args.workers}"] = round(
                (cpu_seconds(daemon) - cpu0[1]) / done.elapsed, 2)
    record("model_serving", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
