"""Shared by the benchmarks: timing and recording of figures."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dpu_frontend.config import PeerAddress
from dpu_frontend.control.stats import peer_report

RESULTS = Path(os.environ.get("DPU_FRONTEND_BENCH_OUT", "build/benchmarks.jsonl"))


def cpu_seconds(pid: int) -> float:
    """User + system seconds of a process and, recursively, its live children (a
    daemon's workers), from /proc; 0 for a process that is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return 0.0
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(cpu_seconds(int(child)) for child in children)


def engine_counters(address: PeerAddress) -> dict[str, Any]:
    """A model peer's engine counters (its ``peer-stats`` report's ``kernel``)."""
    kernel: dict[str, Any] = asyncio.run(peer_report(address))["kernel"]
    return kernel


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


def best_of(fn: Callable[[], None], *, repeat: int = 5) -> float:
    """The fastest of ``repeat`` runs, in seconds: the least disturbed by the machine."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def record(name: str, figures: dict[str, Any]) -> None:
    """Print the figures and append them, with the machine, to the results file."""
    entry = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_version()}",
             **figures}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as out:
        out.write(json.dumps(entry) + "\n")
    width = max(len(k) for k in figures)
    print(f"{name}:")
    for key, value in figures.items():
        print(f"  {key:<{width}}  {value}")


@contextlib.contextmanager
def py_spy(pid: int, out: Path | None, *, idle: bool = True) -> Iterator[None]:
    """With ``out``: ``py-spy`` samples the process (and its children) while the block
    runs, into ``out`` as folded stacks: every thread, idle ones too (``idle``: so that a
    wait on the GPU shows), or only where the CPU goes."""
    if out is None:
        yield
        return
    exe = shutil.which("py-spy")
    if exe is None:
        raise SystemExit("--py-spy: no py-spy on PATH (pip install py-spy)")
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--threads",
                             *(["--idle"] if idle else []), "--subprocesses", "--nonblocking",
                             "--rate", "200", "--output", str(out)],
                            stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        proc.wait(timeout=60)
