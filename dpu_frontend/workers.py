"""``serve --workers N``: a supervisor and N worker processes sharing the HTTP port.

Each worker is a whole daemon (``serve --worker-index i``) with its own event
loop, tokenizer threads and, to every GPU peer, its own channel and QP: no
QP, ring or lock is shared between the DPU's cores. The kernel spreads new
connections over the workers (SO_REUSEPORT); the supervisor binds the port
first, so that port 0 becomes one port the kernel chose for all of them and
no other program can take it between two workers' starts. Metrics aggregate through
prometheus-client's multiprocess directory, which the supervisor creates and
removes. The supervisor reports READY once every worker listens, restarts a
worker that dies, and on SIGTERM has all of them drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from prometheus_client.multiprocess import mark_process_dead

from dpu_frontend.config import ServeConfig
from dpu_frontend.daemon import CLOSE_GRACE_S
from dpu_frontend.errors import StartupError
from dpu_frontend.lifecycle import DAEMON_READY, announce_ready, stop_on_signals
from dpu_frontend.sdnotify import Notifier

log = logging.getLogger("dpu_frontend.workers")

RESTART_DELAY_S = 1.0


class Worker:
    def __init__(self, index: int, argv: list[str], env: dict[str, str]) -> None:
        self.index = index
        self.argv = [*argv, "--worker-index", str(index)]
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, ready_within: float) -> None:
        """Start it and wait for its ready line (its logs go to our standard error)."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, env=self.env, stdout=asyncio.subprocess.PIPE)
        stdout = self.proc.stdout
        async with asyncio.timeout(ready_within):
            while stdout is not None:
                line = await stdout.readline()
                if not line:
                    raise RuntimeError(f"worker {self.index} exited before it was ready")
                if line.decode().startswith(DAEMON_READY):
                    break
        log.info("worker %d (pid %d) ready", self.index, self.proc.pid)

    async def wait(self) -> int:
        if self.proc is None:
            return 0
        return await self.proc.wait()


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (never listen on) ``host:port`` with SO_REUSEPORT: the workers bind beside
    it, and the kernel hands connections only to listening sockets."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot bind {host}:{port}: {exc}") from exc
    return sock


async def supervise(config: ServeConfig, argv: list[str]) -> int:
    """Run ``config.workers`` copies of ``argv`` (a ``serve`` command line) until SIGTERM."""
    metrics_dir = Path(tempfile.mkdtemp(prefix="dpu-frontend-metrics-"))
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    env |= {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}  # read by prometheus-client on import
    reserved = reserve_port(config.host, config.port)
    port = reserved.getsockname()[1]
    # The last --port wins: the workers all take the one reserved here.
    base = [sys.executable, "-m", "dpu_frontend.cli", *argv, "--metrics-dir", str(metrics_dir),
            "--port", str(port)]
    workers = [Worker(i, base, env) for i in range(config.workers)]
    notifier = Notifier.from_environment()
    stop = stop_on_signals()
    ready_timeout = config.connect_timeout_s * 2 + 60
    try:
        await asyncio.gather(*(w.start(ready_timeout) for w in workers))
        announce_ready(DAEMON_READY, f"http://{config.host}:{port}")
        notifier.ready(f"{config.workers} workers serving {config.model_name} on port {port}")
        watchdog = asyncio.create_task(notifier.watchdog())
        try:
            await _keep_alive(workers, stop, metrics_dir, ready_timeout)
        finally:
            watchdog.cancel()
        notifier.stopping(f"draining {config.workers} workers")
        await _stop_all(workers, config.drain_timeout_s + CLOSE_GRACE_S + 5)
        return 0
    finally:
        await _stop_all(workers, 5)
        reserved.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


async def _keep_alive(workers: list[Worker], stop: asyncio.Event, metrics_dir: Path,
                      ready_timeout: float) -> None:
    """Until ``stop``: a worker that exits is replaced after a short delay."""
    stopping = asyncio.create_task(stop.wait())
    exits = {asyncio.create_task(w.wait()): w for w in workers}
    try:
        while True:
            done, _ = await asyncio.wait({stopping, *exits}, return_when=asyncio.FIRST_COMPLETED)
            if stopping in done:
                return
            for task in done:
                worker = exits.pop(task)
                pid = worker.proc.pid if worker.proc is not None else 0
                log.error("worker %d (pid %d) exited with %s; restarting it", worker.index, pid,
                          task.result())
                mark_process_dead(pid, str(metrics_dir))  # type: ignore[no-untyped-call]
                await asyncio.sleep(RESTART_DELAY_S)
                await worker.start(ready_timeout)
                exits[asyncio.create_task(worker.wait())] = worker
    finally:
        for task in [stopping, *exits]:
            task.cancel()


async def _stop_all(workers: list[Worker], grace: float) -> None:
    """SIGTERM (each drains), then SIGKILL for what is left after ``grace`` seconds."""
    running = [w.proc for w in workers if w.proc is not None and w.proc.returncode is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(grace):
            await asyncio.gather(*(p.wait() for p in running))
    except TimeoutError:
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await asyncio.gather(*(p.wait() for p in running))
