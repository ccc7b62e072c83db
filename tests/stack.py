"""Real peer and daemon processes for integration tests, on ports picked by the kernel."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from dpu_frontend.config import PeerAddress
from dpu_frontend.softroce.harness import RXE_IP
from dpu_frontend.softroce.processes import CLI, DAEMON_READY, PEER_READY
from dpu_frontend.softroce.processes import start as start_process
from dpu_frontend.softroce.processes import stop as stop_process

MODEL = "qwen3"
#: The daemons' --peer-timeout inside the micro-VM (see running_stack).
VM_PEER_TIMEOUT_S = 10
#: Idle, a reference peer polls its rings every tick and a daemon its peer every idle
#: interval: a few percent of a core natively (1 ms and 10 ms), whole vCPUs under the
#: micro-VM's software CPU, taken from the processes a test is waiting for.
VM_TICK_S = 0.01
VM_IDLE_POLL_S = 0.05


@dataclass
class PeerProcess:
    argv: list[str]
    address: str
    proc: subprocess.Popen[str]
    timeout: float

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait()

    def restart(self) -> None:
        """Start it again on the same address (after ``kill``)."""
        stop_process(self.proc)
        port = self.address.rsplit(":", 1)[1]
        argv = [a if a != "0" or self.argv[i - 1] != "--port" else port
                for i, a in enumerate(self.argv)]
        self.proc, self.address = start_process(argv, PEER_READY, self.timeout)


@dataclass
class Stack:
    transport: str
    base_url: str
    peers: list[PeerProcess]
    daemon: subprocess.Popen[str]
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def peer(self) -> subprocess.Popen[str]:
        return self.peers[0].proc

    def peer_address(self, i: int = 0) -> PeerAddress:
        return PeerAddress.parse(self.peers[i].address)


@contextmanager
def running_stack(transport: str, *, mode: str = "replay", tokens_per_s: float = 0,
                  timeout: float = 600, peer_args: tuple[str, ...] = (),
                  serve_args: tuple[str, ...] = (), peers: int = 1,
                  serve_env: dict[str, str] | None = None,
                  daemon_exit: int = 0, peer_command: str = "peer",
                  daemon_prefix: tuple[str, ...] = ()) -> Iterator[Stack]:
    """Peers (``peer_command``: the reference ``peer`` or the CUDA ``gpu-peer``) and a
    daemon connected over ``transport``; all stopped at exit.

    The daemon must exit with ``daemon_exit``; ``daemon_prefix`` goes before its command
    (``taskset -c 0-1`` pins it, as the DPU's cores would).
    """
    if transport == "verbs":
        net = ["--rdma-ip", RXE_IP]
        host = RXE_IP
        # The micro-VM runs soft-RoCE under QEMU's software CPU, 15-20x slower than
        # the host, and a guest starved by other work on the host stalls for
        # seconds: 1 s, then 5 s RDMA deadlines failed healthy operations on a
        # loaded development machine. Failures in these tests are seen by the control
        # connection closing or a completion error; only the stalled-peer test
        # waits for this deadline.
        # A worker's constraint compiler would start at once, and its vocabulary of
        # 150K tokens is seconds of the guest's emulated CPU: the RDMA tests' daemons
        # start it on first use.
        serve_args = ("--peer-timeout", str(VM_PEER_TIMEOUT_S), "--idle-poll-interval",
                      str(VM_IDLE_POLL_S), "--constraint-compiler-at-start", "off",
                      *serve_args)
        peer_pace = ["--tick", str(VM_TICK_S)]
    else:
        net = []
        host = "127.0.0.1"
        peer_pace = []
    started: list[PeerProcess] = []
    try:
        for _ in range(peers):
            shm = ["--shm-path", f"/dev/shm/dpu-frontend-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"]
            rate = ["--tokens-per-s", str(tokens_per_s), *peer_pace] if peer_command == "peer" else []
            argv = [*CLI, peer_command, "--transport", transport, *net, "--host", host,
                    "--port", "0", "--mode", mode, *rate,
                    *(shm if transport == "shm" else []), *peer_args]
            proc, address = start_process(argv, PEER_READY, timeout)
            started.append(PeerProcess(argv, address, proc, timeout))
        addresses = [a for p in started for a in ("--peer", p.address)]
        daemon, url = start_process(
            [*daemon_prefix, *CLI, "serve", "--transport", transport, *net, *addresses,
             "--port", "0", "--model-name", MODEL, *serve_args], DAEMON_READY, timeout,
            env=serve_env)
        try:
            yield Stack(transport, url, started, daemon)
        finally:
            assert stop_process(daemon) == daemon_exit, "daemon exit status"
    finally:
        for peer in started:
            stop_process(peer.proc)
