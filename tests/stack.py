"""Real peer and daemon processes for integration tests, on ports picked by the kernel."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from dpu_frontend.softroce.harness import RXE_IP
from dpu_frontend.softroce.processes import CLI, DAEMON_READY, PEER_READY
from dpu_frontend.softroce.processes import start as start_process
from dpu_frontend.softroce.processes import stop as stop_process

MODEL = "qwen3"


@dataclass(frozen=True)
class Stack:
    transport: str
    base_url: str
    peer_port: int
    peer: subprocess.Popen[str]
    daemon: subprocess.Popen[str]


@contextmanager
def running_stack(transport: str, *, mode: str = "replay", tokens_per_s: float = 0,
                  timeout: float = 600, peer_args: tuple[str, ...] = (),
                  serve_args: tuple[str, ...] = (), daemon_exit: int = 0) -> Iterator[Stack]:
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
        PEER_READY, timeout)
    try:
        port = int(address.rsplit(":", 1)[1])
        daemon, url = start_process(
            [*CLI, "serve", "--transport", transport, *net, "--peer", f"{host}:{port}",
             "--port", "0", "--model-name", MODEL, *serve_args], DAEMON_READY, timeout)
        try:
            yield Stack(transport, url, port, peer, daemon)
        finally:
            assert stop_process(daemon) == daemon_exit, "daemon exit status"
    finally:
        stop_process(peer)
