"""PNG plots of the frontend benchmarks (matplotlib, the ``bench`` extra).

``frontend_plots`` draws a ``frontend_load`` run: latency against the offered rate
(open loop) and CPU per token against the streams held open (closed loop), beside
the bare pipeline's. ``scaling_plot`` draws throughput against worker processes
(``benchmarks.frontend_scaling``), beside linear. ``blink_plot`` draws Blink's
experiment (``benchmarks.blink``): latency against the request rate for each
scheduler, quiet and under interference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.ticker import ScalarFormatter


def frontend_plots(runs: list[dict[str, Any]], into: Path) -> list[Path]:
    into.mkdir(parents=True, exist_ok=True)
    written = []
    open_loop = [r for r in runs if r["loop"] == "open" and r["load"] != "inf"]
    if open_loop:
        fig, ax = plt.subplots(figsize=(6, 4))
        rates = [r["load"] for r in open_loop]
        for key, style in (("TTFT p50 ms", "o-"), ("TTFT p99 ms", "o--"),
                           ("ITL p50 ms", "s-"), ("ITL p99 ms", "s--")):
            ax.plot(rates, [r[key] for r in open_loop], style, label=key.removesuffix(" ms"))
        ax.set_xlabel("offered load, requests/s (Poisson)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title("Latency against rate (one daemon worker)")
        ax.legend()
        written.append(_save(fig, into / "latency_vs_rate.png"))
    closed = [r for r in runs if r["loop"] == "closed"]
    if closed:
        fig, ax = plt.subplots(figsize=(6, 4))
        streams = [r["load"] for r in closed]
        ax.plot(streams, [r["CPU us per token"] for r in closed], "o-", label="daemon")
        for name in ("paced", "unpaced"):
            key = f"bare {name} events per CPU s"
            if all(r.get(key) for r in closed):
                ax.plot(streams, [1e6 / r[key] for r in closed], "s--",
                        label=f"bare pipeline, {name}")
        ax.set_xlabel("streams held open (closed loop)")
        ax.set_ylabel("CPU µs per token")
        ax.set_ylim(bottom=0)
        ax.set_title("CPU per token against streams")
        ax.legend()
        written.append(_save(fig, into / "cpu_per_token_vs_streams.png"))
    return written


def scaling_plot(points: list[dict[str, Any]], into: Path) -> Path:
    """``points``: one per worker count, with "workers" and "events/s"."""
    into.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    workers = [p["workers"] for p in points]
    events = [p["events/s"] for p in points]
    ax.plot(workers, events, "o-", label="measured")
    one = events[0] / workers[0]
    ax.plot(workers, [one * w for w in workers], "--", label="linear from the first")
    ax.set_xlabel("daemon worker processes")
    ax.set_ylabel("SSE events/s")
    ax.set_title("Throughput against workers")
    ax.legend()
    return _save(fig, into / "throughput_vs_workers.png")


def blink_plot(runs: list[dict[str, Any]], into: Path) -> Path:
    """``runs``: ``benchmarks.blink`` results, one per scheduler mode."""
    into.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("tpot_p99_ms", "TPOT p99, ms"), ("ttft_p99_ms", "TTFT p99, ms"),
              ("output_tokens_per_s", "output tokens/s"))
    for run in runs:
        for setting, style in (("quiet", "-"), ("interference", "--")):
            points = sorted((p for p in run["points"] if p["setting"] == setting),
                            key=lambda p: p["rate"])
            rates = [p["rate"] for p in points]
            color = "tab:blue" if run["mode"] == "gpu" else "tab:red"
            for ax, (key, _) in zip(axes, panels, strict=True):
                ax.plot(rates, [p[key] for p in points], style, marker="o", color=color,
                        label=f"--scheduler {run['mode']}, {setting}")
            if setting == "quiet" and all("own_steps_bound_tokens_per_s" in p for p in points):
                axes[2].plot(rates, [p["own_steps_bound_tokens_per_s"] for p in points], ":",
                             color=color, label=f"--scheduler {run['mode']}: bound of its steps")
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.set_xscale("log", base=2)
        if key != "output_tokens_per_s":
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.set_xlabel("offered rate, requests/s (ShareGPT)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=7)
    # A run of one of Blink's models (benchmarks/configs/NAME.json) is named after it.
    config = str(runs[0].get("model config", ""))
    name = Path(config).stem if config.endswith(".json") else ""
    fig.suptitle("Scheduler inside the GPU vs host-driven loop, quiet and beside a CPU "
                 f"co-tenant{': ' + name if name else ''}")
    return _save(fig, into / f"blink_latency_vs_rate{'-' + name if name else ''}.png")


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
