"""Start and stop the project's processes the way the demo, tests and benchmarks need.

Each service prints one ready line on stdout once it listens (``peer
listening on HOST:PORT``, ``daemon listening on URL``); ``start`` waits for
it, so nothing races a process that is still loading its tokenizer (seconds
under the micro-VM's emulated CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from dpu_frontend.lifecycle import DAEMON_READY, PEER_READY

CLI = [sys.executable, "-m", "dpu_frontend.cli"]
__all__ = ["CLI", "DAEMON_READY", "PEER_READY", "start", "stop"]


def start(argv: list[str], marker: str, timeout: float,
          env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """Start ``argv``; return it and the rest of its first stdout line starting with ``marker``."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env})
    deadline = time.monotonic() + timeout
    if proc.stdout is not None:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(marker):
                return proc, line[len(marker):].strip()
    stop(proc)
    raise RuntimeError(f"{' '.join(argv)} did not become ready (exit status {proc.returncode})")


def stop(proc: subprocess.Popen[str], timeout: float = 30) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; return the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode
