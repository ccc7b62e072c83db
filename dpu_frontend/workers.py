"""``serve --workers N``: a supervisor and N worker processes sharing the HTTP port.

Each worker is a whole daemon (``serve --worker-index i``) with its own event
loop, tokenizer threads and, to every GPU peer, its own channel and QP: no
QP, ring or lock is shared between the DPU's cores. The kernel spreads new
connections over the workers (SO_REUSEPORT); the supervisor binds the port
first, so that port 0 becomes one port the kernel chose for all of them and
no other program can take it between two workers' starts. Metrics aggregate through
prometheus-client's multiprocess directory, which the supervisor creates and
removes.

The supervisor reports READY once every worker listens. A worker that dies is
started again; a start that fails (no GPU peer is up, say) is retried with a
growing wait, while the other workers serve on. SIGTERM ends a start under
way at once and has the serving workers drain. Each worker's standard output
is read for its whole life and logged line by line.
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
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from prometheus_client.multiprocess import mark_process_dead

from dpu_frontend.config import ServeConfig
from dpu_frontend.daemon import CLOSE_GRACE_S
from dpu_frontend.errors import StartupError
from dpu_frontend.lifecycle import DAEMON_READY, announce_ready, stop_on_signals
from dpu_frontend.sdnotify import Notifier

log = logging.getLogger("dpu_frontend.workers")

#: A worker that exits is started again after RESTART_DELAY_S; each start that fails
#: (the worker exits before it is ready: no GPU peer is up, say) doubles the wait, up
#: to RESTART_MAX_DELAY_S, so a peer away for minutes costs one attempt per that long.
RESTART_DELAY_S = 1.0
RESTART_MAX_DELAY_S = 10.0

#: prometheus-client's function is untyped: called through this typed name. It removes
#: the dead process's files of live gauges, so a scrape no longer counts it.
_mark_process_dead: Callable[[int, str], None] = mark_process_dead


class Worker:
    """One ``serve --worker-index i`` process at a time: started, restarted, stopped."""

    def __init__(self, index: int, argv: list[str], env: dict[str, str]) -> None:
        self.index = index
        self.argv = [*argv, "--worker-index", str(index)]
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self._stdout: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    async def start(self, ready_within: float) -> None:
        """Start it and wait for its ready line; its logs go to our standard error.

        A worker that exits first, or is not ready in time, fails the start
        (``StartupError``) and is gone when this returns; so is one whose start is
        cancelled (a worker that is not ready serves nothing: SIGKILL).
        """
        try:
            proc = self.proc = await asyncio.create_subprocess_exec(
                *self.argv, env=self.env, stdout=asyncio.subprocess.PIPE)
        except OSError as exc:
            raise StartupError(f"cannot start worker {self.index}: {exc}") from exc
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Read for the worker's whole life, not only up to the ready line: a pipe that
        # nobody reads fills up and blocks the worker at its next write.
        self._stdout = asyncio.create_task(self._read_stdout(proc.stdout, ready),
                                           name=f"worker {self.index} stdout")
        try:
            try:
                async with asyncio.timeout(ready_within):
                    await asyncio.wait({ready, self._stdout}, return_when=asyncio.FIRST_COMPLETED)
            except TimeoutError:
                raise StartupError(f"worker {self.index} (pid {proc.pid}) was not ready within "
                                   f"{ready_within:g} s") from None
            if not ready.done():
                raise StartupError(f"worker {self.index} (pid {proc.pid}) exited with status "
                                   f"{await proc.wait()} before it was ready")
        except BaseException:
            await self.kill()
            raise
        log.info("worker %d (pid %d) ready", self.index, proc.pid)

    async def _read_stdout(self, stdout: asyncio.StreamReader | None,
                           ready: asyncio.Future[None]) -> None:
        """Until it closes: the ready line sets ``ready``; any other line is logged."""
        if stdout is None:
            return
        while True:
            try:
                line = await stdout.readline()
            except ValueError:  # longer than the reader's limit: dropped, reading goes on
                log.warning("worker %d wrote a line too long to forward", self.index)
                continue
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            if not ready.done() and text.startswith(DAEMON_READY):
                ready.set_result(None)
            else:
                log.info("worker %d: %s", self.index, text)

    async def wait(self) -> int:
        """Until the worker exits and its standard output is read to the end: its status.

        The end comes with the exit: a worker starts no process that could hold
        its pipe open.
        """
        if self.proc is None:
            return 0
        status = await self.proc.wait()
        if self._stdout is not None:
            await self._stdout
        return status

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.wait()


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
    # SIGHUP (reload the API keys and the TLS certificate) is for every worker: `systemctl reload` reaches
    # only this process.
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGHUP, lambda: _signal_all(workers, signal.SIGHUP))
    ready_timeout = config.connect_timeout_s * 2 + 60
    try:
        # SIGTERM during a start or a restart ends it at once (its worker is killed);
        # the workers that serve drain, with the whole drain timeout.
        if not await _unless(stop, _together([w.start(ready_timeout) for w in workers])):
            return 0
        announce_ready(DAEMON_READY, f"{config.scheme}://{config.host}:{port}")
        notifier.ready(f"{config.workers} workers serving {config.model_name} on port {port}")
        watchdog = asyncio.create_task(notifier.watchdog())
        try:
            await _unless(stop, _together([_keep(w, metrics_dir, ready_timeout)
                                           for w in workers]))
        finally:
            watchdog.cancel()
        notifier.stopping(f"draining {config.workers} workers")
        return 0
    finally:
        await _stop_all(workers, config.drain_timeout_s + CLOSE_GRACE_S + 5)
        reserved.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _signal_all(workers: list[Worker], sig: int) -> None:
    for worker in workers:
        if worker.proc is not None and worker.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(sig)


async def _keep(worker: Worker, metrics_dir: Path, ready_timeout: float) -> None:
    """Start ``worker`` again whenever it exits, until cancelled.

    A start that fails is retried after a wait that doubles (``RESTART_DELAY_S``
    up to ``RESTART_MAX_DELAY_S``); the other workers go on serving untouched.
    """
    while True:
        status = await worker.wait()
        log.error("worker %d (pid %d) exited with status %s; restarting it in %g s",
                  worker.index, worker.pid, status, RESTART_DELAY_S)
        _mark_process_dead(worker.pid, str(metrics_dir))
        delay = RESTART_DELAY_S
        while True:
            await asyncio.sleep(delay)
            try:
                await worker.start(ready_timeout)
                break
            except StartupError as exc:
                _mark_process_dead(worker.pid, str(metrics_dir))
                delay = min(2 * delay, RESTART_MAX_DELAY_S)
                log.error("%s; next attempt in %g s", exc, delay)


async def _together(work: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``work`` concurrently. The first failure, or a cancellation, cancels the
    rest; every one has ended (a start cancelled has killed its worker) on return."""
    tasks = [asyncio.create_task(w) for w in work]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)


async def _unless(stop: asyncio.Event, work: Coroutine[Any, Any, None]) -> bool:
    """Run ``work`` until it ends (True; what it raised is raised) or ``stop`` is set
    (False: ``work`` is cancelled, and has ended on return)."""
    task = asyncio.create_task(work)
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()
        stopping.cancel()
        await asyncio.wait({task, stopping})
    if task.cancelled():
        return False
    task.result()
    return True


async def _stop_all(workers: list[Worker], grace: float) -> None:
    """SIGTERM (each drains), then SIGKILL for what is left after ``grace`` seconds."""
    running = [w for w in workers if w.proc is not None and w.proc.returncode is None]
    for worker in running:
        if worker.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(grace):
            await asyncio.gather(*(w.wait() for w in running))
    except TimeoutError:
        await asyncio.gather(*(w.kill() for w in running))
