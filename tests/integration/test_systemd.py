"""systemd integration: sd_notify over a real unix datagram socket, and the unit files verify."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import running_stack

UNITS = Path(__file__).parent.parent.parent / "systemd"


def receive(sock: socket.socket, until: str, limit: float = 60) -> list[str]:
    """Datagrams received until one contains ``until``."""
    sock.settimeout(limit)
    got: list[str] = []
    while not any(until in m for m in got):
        got.append(sock.recv(4096).decode())
    return got


async def test_ready_watchdog_and_stopping(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}
        with running_stack("shm", timeout=60, serve_env=env) as stack:
            ready = await asyncio.to_thread(receive, sock, "READY=1")
            assert "STATUS=serving qwen3" in ready[-1]
            assert "1/1 GPU peers up" in ready[-1]
            pings = await asyncio.to_thread(receive, sock, "WATCHDOG=1")
            pings += await asyncio.to_thread(receive, sock, "WATCHDOG=1")
            assert sum(m == "WATCHDOG=1" for m in pings) >= 2  # the loop keeps pinging
            stack.daemon.send_signal(signal.SIGTERM)
            stopping = await asyncio.to_thread(receive, sock, "STOPPING=1")
            assert "STATUS=draining" in stopping[-1]
            # Its exit, before the stack's own SIGTERM: a second one landing after the
            # loop closed (its handlers gone) would kill it, exit status -15 (seen once
            # in CI on a loaded machine).
            assert await asyncio.to_thread(stack.daemon.wait, 30) == 0


@pytest.mark.parametrize("unit", ["dpu-frontend.service", "dpu-frontend-peer.service"])
def test_unit_files_pass_systemd_analyze_verify(tmp_path: Path, unit: str) -> None:
    """The units as shipped, pointed at this venv's binary (verify checks that it exists)."""
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is part of the systemd package"
    binary = str(Path(sys.executable).parent / "dpu-frontend")
    text = (UNITS / unit).read_text().replace("/opt/dpu-frontend/venv/bin/dpu-frontend", binary)
    (tmp_path / unit).write_text(text)
    result = subprocess.run([analyze, "verify", str(tmp_path / unit)], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Type=notify" in text and "TimeoutStopSec=" in (UNITS / unit).read_text()
