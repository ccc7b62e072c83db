"""Blink's experiment: the scheduler inside the GPU against the host-driven loop, on a
quiet host and beside a noisy co-tenant.

On the GPU machine (16 cores): the daemon pinned to cores 0-1 (standing in for
the DPU's), the load generator's processes on cores 2-3 (standing in for remote
clients), the model peer's launcher on the host cores 4-15. For each
``--scheduler`` mode the peer starts once; then, on a quiet host and with the
interference of ``benchmarks.interference`` on every host core (a busy loop on
each, a memory-bandwidth hog on the first), a ladder of ShareGPT request rates
(``benchmarks.loadgen``, Poisson arrivals). Per point: TTFT and TPOT p50/p99,
output tokens/s, the launcher's CPU per 1,000 tokens, and GPU energy from
``nvidia-smi`` as tokens per joule. Beside them, the bare figures of the same
run: the interference's own CPU (it really ran) and the GPU's idle power.

Each point also has the bound of the run's own steps (``benchmarks.model_figures``:
the peer's counters before and after it, the copy bandwidth measured at the start), so
every throughput stands beside it. ``--model-config`` runs one of Blink's four models
at its real shapes with random bf16 weights (``benchmarks/configs/``), with the
tokenizer ``--tokenizer`` names for the daemon and the peer; the prompts are token ids
below its size, so a model whose tokenizer installs from no package (Phi-4) runs with
a smaller one (GPT-2's), as the results record.

    python -m benchmarks.blink --lengths build/sharegpt-lengths.json --mode gpu \\
        --rates 4 8 16 32 64 128 --out build/blink-gpu.json
    python -m benchmarks.blink ... --mode host --out build/blink-host.json
    python -m benchmarks.blink ... --model-config benchmarks/configs/llama-3-8b.json \\
        --tokenizer build/assets/llama3_1 --mode gpu --out build/blink-llama-gpu.json
    python -m benchmarks.blink --plot build/blink-gpu.json build/blink-host.json --into docs/img
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import cpu_seconds, engine_counters, record
from benchmarks.gpu_power import PowerSampler
from benchmarks.interference import interference, parse_cores
from benchmarks.loadgen import Job, percentile, run
from benchmarks.model_figures import (
    BenchTokenizer,
    add_served_model_arguments,
    describe,
    load_config,
    own_peer_flags,
    run_bound,
)
from dpu_frontend.config import PeerAddress
from dpu_frontend.model.config import ModelConfig
from tests.stack import running_stack


def pin(pid: int, cores: list[int]) -> None:
    """Every thread of ``pid`` onto ``cores`` (taskset -a: threads started before, too)."""
    subprocess.run(["taskset", "-a", "-p", "-c", ",".join(map(str, cores)), str(pid)],
                   check=True, capture_output=True)


@dataclass(frozen=True, slots=True)
class Model:
    """What the bound of a point's own steps needs: the config and the copy bandwidth."""

    config: ModelConfig
    bandwidth: float
    address: PeerAddress


def point(url: str, jobs: list[Job], rate: float, *, clients: int, seed: int, peer: int,
          power: PowerSampler, model: Model) -> dict[str, Any]:
    """One rate: the latencies, the rate served beside the bound of its own steps, the
    launcher's CPU and the GPU's energy."""
    counters0 = engine_counters(model.address)
    cpu0, t0 = cpu_seconds(peer), time.monotonic()
    done = run(url, jobs, rate, clients=clients, seed=seed)
    t1 = time.monotonic()
    bound = run_bound(model.config, counters0, engine_counters(model.address), model.bandwidth)
    tokens = sum(r.tokens for r in done.results)
    ttft = [r.ttft * 1e3 for r in done.results]
    tpot = [t * 1e3 for r in done.results if (t := r.tpot) is not None]
    joules = power.energy(t0, t1)
    return {
        "rate": rate, "requests": len(done.results), "tokens": tokens,
        "output_tokens_per_s": tokens / done.elapsed if done.elapsed else 0.0,
        "own_steps_bound_tokens_per_s": bound,
        "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
        "tpot_p50_ms": percentile(tpot, 0.5), "tpot_p99_ms": percentile(tpot, 0.99),
        "launcher_cpu_s_per_1k_tokens": (cpu_seconds(peer) - cpu0) / tokens * 1000 if tokens else 0,
        "gpu_joules": joules, "tokens_per_joule": tokens / joules if joules else 0.0,
        "gpu_mean_watts": power.mean_watts(t0, t1), "seconds": t1 - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("gpu", "host"), help="the model peer's --scheduler")
    ap.add_argument("--lengths", type=Path, default=Path("build/sharegpt-lengths.json"))
    ap.add_argument("--rates", type=float, nargs="+", default=[4, 8, 16, 32, 64, 128])
    ap.add_argument("--seconds", type=float, default=12.0, help="arrivals per point")
    ap.add_argument("--min-requests", type=int, default=40)
    ap.add_argument("--daemon-cores", default="0-1")
    ap.add_argument("--client-cores", default="2-3")
    ap.add_argument("--host-cores", default="4-15", help="the launcher's, and the interference's")
    ap.add_argument("--max-seqs", type=int, default=256)
    add_served_model_arguments(ap)
    ap.add_argument("--seed", type=int, default=20261127)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, nargs="+", metavar="JSON",
                    help="no run: plot these results into --into")
    ap.add_argument("--into", type=Path, default=Path("docs/img"))
    args = ap.parse_args(argv)
    if args.plot:
        from benchmarks.plots import blink_plot

        print(blink_plot([json.loads(p.read_text()) for p in args.plot], args.into))
        return 0
    if args.mode is None:
        ap.error("--mode is required for a run")

    config, origin = load_config(args.model_config)
    try:
        tokenizer = BenchTokenizer.load(args.tokenizer, config)
        own_flags = own_peer_flags(args.model_config, args.mode, [])
    except ValueError as exc:
        ap.error(str(exc))
    # A run needs the GPU; --plot and --help do not.
    import torch

    from benchmarks.model_step import copy_bandwidth

    bandwidth = copy_bandwidth(torch.device("cuda", 0), size=2 << 30)
    daemon_cores, client_cores = parse_cores(args.daemon_cores), parse_cores(args.client_cores)
    host_cores = parse_cores(args.host_cores)
    pairs = [tuple(p) for p in json.loads(args.lengths.read_text())["pairs"]]
    rng = random.Random(args.seed)
    workers = len(daemon_cores)
    peer_args = (*own_flags, "--channels", str(workers), "--max-seqs", str(args.max_seqs),
                 "--max-model-len", "4096", "--max-sequences", "1024", "--resp-slots", "2048",
                 *tokenizer.flags())
    serve_args = ("--workers", str(workers), "--max-queued-requests", "10000",
                  *tokenizer.flags())

    def jobs(count: int) -> list[Job]:
        chosen = [rng.choice(pairs) for _ in range(count)]
        return [Job(tokenizer.prompt_ids(rng, p), o) for p, o in chosen]

    os.sched_setaffinity(0, host_cores)  # the peer inherits the host's cores
    results: dict[str, Any] = {
        "mode": args.mode, "machine": f"{os.cpu_count()} cores",
        "device": torch.cuda.get_device_name(0), "model config": origin,
        "model": describe(config), "tokenizer": tokenizer.name,
        "copy bandwidth (bare limit), GB/s": round(bandwidth / 1e9, 1),
        "cores": {"daemon": daemon_cores, "clients": client_cores, "host": host_cores},
        "lengths": f"{len(pairs)} ShareGPT pairs, prompt mean "
                   f"{statistics.mean(p for p, _ in pairs):.0f}, output mean "
                   f"{statistics.mean(o for _, o in pairs):.0f} tokens",
        "points": []}
    with running_stack("shm", timeout=900, peer_command="model-peer", peer_args=peer_args,
                       serve_args=serve_args,
                       daemon_prefix=("taskset", "-c", args.daemon_cores)) as stack:
        peer = stack.peers[0].proc.pid
        pin(peer, host_cores)
        model = Model(config, bandwidth, stack.peer_address())
        os.sched_setaffinity(0, client_cores)  # the load generator's processes from here
        with PowerSampler() as power:
            time.sleep(3)
            results["gpu_idle_watts"] = power.mean_watts(time.monotonic() - 2.5, time.monotonic())
            run(stack.base_url, jobs(16), float("inf"), clients=1)  # warm up
            for setting in ("quiet", "interference"):
                for rate in args.rates:
                    count = max(args.min_requests, int(rate * args.seconds))
                    if setting == "quiet":
                        p = point(stack.base_url, jobs(count), rate, clients=len(client_cores),
                                  seed=rng.randrange(1 << 30), peer=peer, power=power,
                                  model=model)
                    else:
                        with interference(host_cores) as load:
                            time.sleep(0.5)
                            burnt = load.cpu_seconds()
                            p = point(stack.base_url, jobs(count), rate,
                                      clients=len(client_cores), seed=rng.randrange(1 << 30),
                                      peer=peer, power=power, model=model)
                            p["interference_cores_busy"] = (
                                (load.cpu_seconds() - burnt) / p["seconds"])
                            assert load.running(), "the interference died"
                    p["setting"] = setting
                    results["points"].append(p)
                    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                      for k, v in p.items()}), flush=True)
        results["kernel"] = engine_counters(stack.peer_address())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    record(f"blink_{args.mode}", {f"{p['setting']} {p['rate']:g} req/s": (
        f"{p['output_tokens_per_s']:.0f} tok/s (bound of its steps "
        f"{p['own_steps_bound_tokens_per_s']:.0f}), TTFT p50/p99 {p['ttft_p50_ms']:.0f}/"
        f"{p['ttft_p99_ms']:.0f} ms, TPOT p50/p99 {p['tpot_p50_ms']:.1f}/{p['tpot_p99_ms']:.1f} ms, "
        f"launcher {p['launcher_cpu_s_per_1k_tokens']:.3f} s/1k tok, "
        f"{p['tokens_per_joule']:.1f} tok/J") for p in results["points"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
