"""A peer the daemon cannot trust stops it at start-up with a message, never later."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from dpu_frontend.control import messages
from dpu_frontend.ring import Geometry
from dpu_frontend.softroce.processes import CLI


async def serve_against(welcome: dict[str, object]) -> subprocess.CompletedProcess[str]:
    """Run ``dpu-frontend serve`` against a fake peer that answers ``welcome``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await messages.receive(reader)
        await messages.send(writer, welcome)
        await reader.read()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        *CLI, "serve", "--transport", "shm", "--peer", f"127.0.0.1:{port}", "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    server.close()
    await server.wait_closed()
    return subprocess.CompletedProcess([], proc.returncode or 0, out.decode(), err.decode())


def region(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "region"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda b: b.__setitem__(slice(0, 8), b"GARBAGE!"), "bad magic"),
    (lambda b: b.__setitem__(slice(8, 10), (3).to_bytes(2, "little")), "protocol v3"),
])
async def test_bad_layout_record_is_a_startup_error(
        tmp_path: Path, mutate: Callable[[bytearray], None], message: str) -> None:
    layout = Geometry(req_slots=4, arena_bytes=256, resp_slots=4, max_sequences=2).plan(instance=42)
    data = bytearray(layout.region_size)
    data[:layout.header_size] = layout.encode()
    mutate(data)
    welcome = messages.Welcome(0, 42, layout.region_size, {"path": region(tmp_path, bytes(data))},
                                epoch=1)
    result = await serve_against(welcome.to_dict())
    assert result.returncode == 1
    assert message in result.stderr
    assert "daemon listening" not in result.stdout


async def test_instance_mismatch_is_a_startup_error(tmp_path: Path) -> None:
    layout = Geometry(req_slots=4, arena_bytes=256, resp_slots=4, max_sequences=2).plan(instance=42)
    data = bytearray(layout.region_size)
    data[:layout.header_size] = layout.encode()
    welcome = messages.Welcome(0, 43, layout.region_size, {"path": region(tmp_path, bytes(data))},
                                epoch=1)
    result = await serve_against(welcome.to_dict())
    assert result.returncode == 1 and "stale or foreign region" in result.stderr


async def test_other_protocol_version_in_the_handshake(tmp_path: Path) -> None:
    welcome = messages.Welcome(0, 42, 4096, {"path": "/nonexistent"}, epoch=1).to_dict()
    result = await serve_against(welcome | {"protocol": 3})
    assert result.returncode == 1 and "ring protocol v3" in result.stderr


async def test_a_v1_peer_stops_the_daemon_with_a_clear_message(tmp_path: Path) -> None:
    """A v1 peer refuses a v2 hello in its own words: the daemon exits, it does not retry."""
    result = await serve_against(messages.refuse("daemon speaks ring protocol v2, this peer v1"))
    assert result.returncode == 1
    assert "peer speaks ring protocol v1" in result.stderr and "upgrade" in result.stderr


async def test_refused_channel(tmp_path: Path) -> None:
    result = await serve_against(messages.refuse("no free channel"))
    assert result.returncode == 1 and "no free channel" in result.stderr
