"""The CLI's exit statuses: 2 only for a bad flag, file or environment value; 1 for a
failure while running, a bug included, with its traceback (issue 10, defect 11)."""

from __future__ import annotations

import pytest

from dpu_frontend import cli, daemon
from dpu_frontend.config import PeerConfig, ServeConfig
from dpu_frontend.peer import server


@pytest.fixture(autouse=True)
def _root_logger(restored_root_logger: None) -> None:
    """``main`` configures the root logger: conftest puts it back after each test."""


async def _serve_fails(config: ServeConfig) -> int:
    raise ValueError("a value went wrong while serving")


async def _peer_fails(config: PeerConfig) -> int:
    raise ValueError("a value went wrong in the peer")


# The CLI imports a command's module when the command runs: patched there.
@pytest.mark.parametrize(("argv", "module", "target", "fails", "message"), [
    (["serve", "--peer", "127.0.0.1:1"], daemon, "serve", _serve_fails,
     "a value went wrong while serving"),
    (["peer", "--port", "0"], server, "run_peer", _peer_fails, "a value went wrong in the peer"),
])
def test_a_value_error_while_running_is_a_crash_not_a_usage_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str],
        module: object, target: str, fails: object, message: str) -> None:
    monkeypatch.setattr(module, target, fails)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"dpu-frontend {argv[0]} crashed" in err
    assert "Traceback (most recent call last)" in err and f"ValueError: {message}" in err
    assert "usage:" not in err


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "not-a-port"],  # parsed by the settings, not by argparse
    ["serve", "--workers", "0"],  # refused by ServeConfig
    ["peer", "--channels", "0"],  # refused by the geometry
])
def test_a_bad_value_is_a_usage_error_and_runs_nothing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str]) -> None:
    ran: list[str] = []

    async def run(config: object) -> int:
        ran.append(argv[0])
        return 0

    monkeypatch.setattr(daemon, "serve", run)
    monkeypatch.setattr(server, "run_peer", run)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: dpu-frontend" in err and "error:" in err
    assert ran == []
