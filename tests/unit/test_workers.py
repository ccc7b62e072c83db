"""The supervisor of ``serve --workers N``: restarts with backoff, starts that end at
once, a standard output read for a worker's whole life (issue 10, defect 5).

The restart loop runs against fake workers; a worker's start and its pipe run
against real, tiny Python processes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import pytest

from dpu_frontend import workers
from dpu_frontend.errors import StartupError
from dpu_frontend.lifecycle import DAEMON_READY
from dpu_frontend.workers import Worker


class FakeWorker(Worker):
    """Serves until the test ends its life; its next starts succeed or fail as told."""

    def __init__(self, index: int, starts: list[bool]) -> None:
        super().__init__(index, [], {})
        self.starts = starts
        self.attempts: list[float] = []  # the loop's time at each start
        self.serving = asyncio.Event()
        self._pid = 100 * (index + 1)
        self._life: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def pid(self) -> int:
        return self._pid

    def exit(self, status: int) -> None:
        self._life.set_result(status)

    async def start(self, ready_within: float) -> None:
        self.attempts.append(asyncio.get_running_loop().time())
        self._pid += 1
        if not self.starts.pop(0):
            raise StartupError(f"worker {self.index} exited with status 1 before it was ready")
        self._life = asyncio.get_running_loop().create_future()
        self.serving.set()

    async def wait(self) -> int:
        return await self._life


async def test_a_failed_restart_is_retried_with_backoff_and_the_others_serve_on(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(workers, "RESTART_DELAY_S", 0.01)
    monkeypatch.setattr(workers, "RESTART_MAX_DELAY_S", 0.04)
    dead: list[int] = []
    monkeypatch.setattr(workers, "_mark_process_dead", lambda pid, path: dead.append(pid))
    lost = FakeWorker(0, [False, False, False, False, True])  # no peer for four attempts
    other = FakeWorker(1, [])
    keep = asyncio.create_task(workers._together(
        [workers._keep(w, tmp_path, 60) for w in (lost, other)]))
    try:
        lost.exit(-signal.SIGKILL)
        async with asyncio.timeout(10):
            await lost.serving.wait()
        assert not keep.done()  # no failed start escaped the loop
        gaps = [b - a for a, b in zip(lost.attempts, lost.attempts[1:], strict=False)]
        # 0.01 s before the first attempt, then 0.02, 0.04, and at most 0.04 s.
        assert all(g >= d * 0.9 for g, d in zip(gaps, (0.02, 0.04, 0.04, 0.04), strict=True)), gaps
        assert dead == [100, 101, 102, 103, 104]  # the lost process, each failed attempt
        assert other.attempts == []  # never restarted, never stopped
    finally:
        keep.cancel()
        await asyncio.wait({keep})


def python(code: str) -> list[str]:
    """A worker command line: ``--worker-index i`` lands in ``sys.argv``, unread."""
    return [sys.executable, "-c", code]


async def test_a_start_cancelled_kills_the_worker_at_once() -> None:
    worker = Worker(0, python("import time; time.sleep(600)"), {})
    start = asyncio.create_task(worker.start(600))
    async with asyncio.timeout(30):
        while worker.proc is None:  # noqa: ASYNC110 - until the process exists
            await asyncio.sleep(0.01)
    start.cancel()
    async with asyncio.timeout(30):
        await asyncio.wait({start})
    assert start.cancelled()
    assert worker.proc.returncode == -signal.SIGKILL


async def test_a_worker_that_exits_before_it_is_ready_fails_its_start() -> None:
    worker = Worker(3, python("import sys; sys.exit(7)"), {})
    with pytest.raises(StartupError, match=r"worker 3 \(pid \d+\) exited with status 7 before"):
        await worker.start(600)


async def test_a_worker_that_is_never_ready_is_killed() -> None:
    worker = Worker(0, python("import time; time.sleep(600)"), {})
    with pytest.raises(StartupError, match=r"was not ready within 0\.2 s"):
        await worker.start(0.2)
    assert worker.proc is not None and worker.proc.returncode == -signal.SIGKILL


async def test_standard_output_is_read_for_the_whole_life(
        caplog: pytest.LogCaptureFixture) -> None:
    """Far more than a pipe holds after the ready line, and a line past the reader's
    limit: the worker is never blocked, every other line is logged."""
    caplog.set_level(logging.INFO, logger="dpu_frontend.workers")
    code = (f"print({DAEMON_READY!r} + 'http://x', flush=True)\n"
            "print('x' * 200_000, flush=True)\n"
            "for i in range(5000): print(f'line {i:04} ' + '.' * 90)\n")
    worker = Worker(0, python(code), {})
    await worker.start(600)
    async with asyncio.timeout(60):
        assert await worker.wait() == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("worker 0: line")]
    assert len(lines) == 5000 and lines[-1].startswith("worker 0: line 4999 ")
    assert "worker 0 wrote a line too long to forward" in caplog.messages
