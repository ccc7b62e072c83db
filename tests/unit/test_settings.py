"""Configuration sources: file < environment < flags, and errors that name the key."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dpu_frontend.config import PeerAddress
from dpu_frontend.logs import JsonFormatter, RequestIdFilter, request_id
from dpu_frontend.settings import build

TOML = """
[serve]
port = 9000
model_name = "from-file"
peers = ["10.0.0.2:18515", "10.0.0.3:18515"]
peer_timeout_s = 2
drain_timeout_s = 12.5

[serve.rdma]
ip = "10.0.0.1"
"""


def config_file(tmp_path: Path, text: str = TOML) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = config_file(tmp_path)
    config, logging_ = build({"port": None, "model_name": "from-flag"}, config_path=path,
                             env={"DPU_FRONTEND_PORT": "9100", "DPU_FRONTEND_LOG_FORMAT": "json",
                                  "DPU_FRONTEND_IN_VM": "1"})
    assert config.port == 9100  # environment over file; the flag was not given
    assert config.model_name == "from-flag"
    assert config.peers == (PeerAddress("10.0.0.2", 18515), PeerAddress("10.0.0.3", 18515))
    assert config.peer_timeout_s == 2.0 and config.drain_timeout_s == 12.5
    assert config.rdma.ip == "10.0.0.1"
    assert logging_ == {"log_format": "json"}


def test_defaults_without_any_file(tmp_path: Path) -> None:
    config, _ = build({}, config_path=None, env={"DPU_FRONTEND_PEERS": "1.2.3.4:5, 1.2.3.4:6"})
    assert config.port == 8000 and config.transport == "verbs"
    assert [p.port for p in config.peers] == [5, 6]


@pytest.mark.parametrize(("text", "env", "message"), [
    ("[serve]\nprot = 1\n", {}, r"config.toml: serve.prot: unknown setting 'prot'"),
    ("[serve]\nport = 'x'\n", {}, r"serve.port: invalid literal"),
    ("[serve]\nport = true\n", {}, r"serve.port: expected int, got bool"),
    ("[serving]\n", {}, r"unknown table \[serving\]"),
    ("[serve]\n", {"DPU_FRONTEND_PEER_TIMEOUT_S": "soon"}, r"DPU_FRONTEND_PEER_TIMEOUT_S"),
    ("[serve]\npeer_timeout_s = -1\n", {}, r"peer_timeout_s must be > 0"),
    ("[serve]\nport = 1\n[serve.rdma]\nip = 'nope'\n", {}, r"rdma ip"),
    ("[serve\n", {}, r"config.toml"),
])
def test_errors_name_the_key(tmp_path: Path, text: str, env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build({}, config_path=config_file(tmp_path, text), env=env)


def test_an_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        build({}, config_path=tmp_path / "none.toml", env={})


def test_json_log_lines_carry_the_request_id() -> None:
    record = logging.LogRecord("dpu_frontend.http", logging.INFO, __file__, 1, "hello %s",
                               ("world",), None)
    token = request_id.set("abc123")
    try:
        RequestIdFilter().filter(record)
    finally:
        request_id.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "abc123" and line["message"] == "hello world"
    assert line["logger"] == "dpu_frontend.http" and line["level"] == "INFO"
