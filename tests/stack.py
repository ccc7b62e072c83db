"""Real peer and daemon processes for integration tests, on ports picked by the kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from dpu_frontend.softroce.harness import RXE_IP

MODEL = "qwen3"
CLI = [sys.executable, "-m", "dpu_frontend.cli"]


@dataclass(frozen=True)
class Stack:
    transport: str
    base_url: str
    peer_port: int
    peer: subprocess.Popen[str]
    daemon: subprocess.Popen[str]


def start_process(argv: list[str], marker: str, timeout: float) -> tuple[subprocess.Popen[str], str]:
    """Start ``argv``; return it and the rest of its first stdout line starting with ``marker``."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(marker):
            return proc, line[len(marker):].strip()
    proc.kill()
    proc.wait()
    proc.stdout.close()
    raise RuntimeError(f"{argv} did not start (exit {proc.poll()})")


def stop_process(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


@contextmanager
def running_stack(transport: str, *, mode: str = "replay", tokens_per_s: float = 0,
                  timeout: float = 600, peer_args: tuple[str, ...] = (),
                  daemon_exit: int = 0) -> Iterator[Stack]:
    """A reference peer and a daemon connected over ``transport``; both stopped at exit.

    The daemon must exit with ``daemon_exit`` (1 after it lost its peer).
    """
    if transport == "verbs":
        net = ["--rdma-ip", RXE_IP]
        host = RXE_IP
    else:
        net = []
        host = "127.0.0.1"
    shm = ["--shm-path", f"/dev/shm/dpu-frontend-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"]
    peer, address = start_process(
        [*CLI, "peer", "--transport", transport, *net, "--host", host, "--port", "0", "--mode", mode,
         "--tokens-per-s", str(tokens_per_s), *(shm if transport == "shm" else []), *peer_args],
        "peer listening on ", timeout)
    try:
        port = int(address.rsplit(":", 1)[1])
        daemon, url = start_process(
            [*CLI, "serve", "--transport", transport, *net, "--peer", f"{host}:{port}",
             "--port", "0", "--model-name", MODEL], "daemon listening on ", timeout)
        try:
            yield Stack(transport, url, port, peer, daemon)
        finally:
            assert stop_process(daemon) == daemon_exit, "daemon exit status"
    finally:
        stop_process(peer)
