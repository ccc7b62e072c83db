"""A second opinion: NVIDIA's aiperf against the daemon, beside our load generator.

One configuration, twice on the same stack (the reference peer in decode steps,
the daemon pinned to ``--daemon-cores``, as ``benchmarks.frontend_load``): first
aiperf (PyPI ``aiperf``, pinned here, installed on first use into its own venv
under ``build/``, since its dependencies are not the daemon's), then
``benchmarks.loadgen``'s closed loop; both hold ``--concurrency`` streams of
``/v1/completions`` with prompts of about ``--input-tokens`` tokens and answers of
``--output-tokens`` (``ignore_eos``), for ``--requests`` requests. Their TTFT and
inter-token latency p50/p99 side by side, with the step that paces them.

    python -m benchmarks.second_opinion --concurrency 64 --requests 640
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

from benchmarks.common import record
from benchmarks.e2e_stream import cpu_list
from benchmarks.frontend_load import WORD, stack_args
from benchmarks.loadgen import Job, percentile, run_closed
from dpu_frontend.text.assets import default_tokenizer_dir
from tests.stack import MODEL, running_stack

AIPERF = "aiperf==0.13.0"


def aiperf_exe(root: Path) -> Path:
    """aiperf in its own venv under ``root``, installed from PyPI the first time."""
    exe = root / "bin" / "aiperf"
    if not exe.exists():
        venv.create(root, with_pip=True)
        subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", AIPERF],
                       check=True)
    return exe


def run_aiperf(exe: Path, url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One aiperf profile; its summary metrics (milliseconds) as it exports them."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([
        str(exe), "profile", "--model", MODEL, "--url", url, "--endpoint-type", "completions",
        "--streaming", "--tokenizer", str(default_tokenizer_dir()),
        "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
        "--synthetic-input-tokens-mean", str(args.input_tokens),
        "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean",
        str(args.output_tokens), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--use-legacy-max-tokens",
        "--random-seed", "7", "--ui-type", "none", "--artifact-dir", str(out)],
        check=True, stdout=subprocess.DEVNULL)
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise SystemExit(f"aiperf left no profile_export_aiperf.json under {out}")
    data: dict[str, Any] = json.loads(found[-1].read_text())
    return data


def metric(data: dict[str, Any], name: str, stat: str) -> float:
    """A statistic of one of aiperf's exported metrics (its records or its top level)."""
    entry = data.get(name) or data.get("records", {}).get(name) or {}
    return float(entry.get(stat, float("nan")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=640)
    ap.add_argument("--input-tokens", type=int, default=100)
    ap.add_argument("--output-tokens", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--daemon-cores", default="0" if (os.cpu_count() or 1) > 1 else None)
    ap.add_argument("--venv", type=Path, default=Path("build/aiperf-venv"))
    ap.add_argument("--out", type=Path, default=Path("build/second_opinion"))
    args = ap.parse_args(argv)

    exe = aiperf_exe(args.venv)
    prefix: tuple[str, ...] = ()
    affinity = os.sched_getaffinity(0)
    if args.daemon_cores:
        prefix = ("taskset", "-c", args.daemon_cores)
        os.sched_setaffinity(0, (affinity - cpu_list(args.daemon_cores)) or affinity)
    most = max(args.concurrency, 64)
    peer_args, serve_args = stack_args(args.step_ms, most, most, 1)
    try:
        with running_stack("shm", tokens_per_s=0, timeout=300, peer_args=peer_args,
                           serve_args=serve_args, daemon_prefix=prefix) as stack:
            theirs = run_aiperf(exe, stack.base_url, args, args.out)
            jobs = [Job("Q" + WORD * (args.input_tokens - 1), args.output_tokens)]
            # As many requests as aiperf sent, from as many streams: a closed loop cut at
            # the time it takes, so the whole run is the steady state.
            seconds = args.requests / args.concurrency * args.output_tokens * args.step_ms / 1e3
            ours = run_closed(stack.base_url, jobs, args.concurrency, seconds, clients=1)
    finally:
        os.sched_setaffinity(0, affinity)
    ttft = [r.ttft * 1e3 for r in ours.results]
    gaps = [g * 1e3 for r in ours.results for g in r.gaps]
    figures: dict[str, object] = {
        "configuration": f"{args.concurrency} streams, ~{args.input_tokens} prompt tokens, "
                         f"{args.output_tokens} output tokens, a step every {args.step_ms:g} ms",
        "aiperf": AIPERF,
        "aiperf: TTFT p50 / p99, ms": f"{metric(theirs, 'time_to_first_token', 'p50'):.1f} / "
                                      f"{metric(theirs, 'time_to_first_token', 'p99'):.1f}",
        "ours: TTFT p50 / p99, ms": f"{percentile(ttft, 0.5):.1f} / {percentile(ttft, 0.99):.1f}",
        "aiperf: inter-token p50 / p99, ms":
            f"{metric(theirs, 'inter_token_latency', 'p50'):.1f} / "
            f"{metric(theirs, 'inter_token_latency', 'p99'):.1f}",
        "ours: inter-token p50 / p99, ms":
            f"{percentile(gaps, 0.5):.1f} / {percentile(gaps, 0.99):.1f}",
        "aiperf: output tokens/s": round(metric(theirs, "output_token_throughput", "avg")),
        "ours: output tokens/s": round(sum(r.tokens for r in ours.results) / ours.elapsed),
    }
    record("second_opinion", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
