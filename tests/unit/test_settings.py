"""Configuration sources: file < environment < flags, and errors that name the key."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

import dpu_frontend.cli
import dpu_frontend.settings
from dpu_frontend.cli import PEER, build_parser, gpu_peer_flags, serve_config
from dpu_frontend.config import (
    DEFAULT_PEER,
    REFERENCE_GEOMETRY,
    LoggingConfig,
    PeerAddress,
    PeerConfig,
    RdmaConfig,
    ServeConfig,
)
from dpu_frontend.flags import doc
from dpu_frontend.gpu.options import GPU_GEOMETRY, GpuPeerConfig
from dpu_frontend.logs import JsonFormatter, RequestIdFilter, request_id
from dpu_frontend.model.options import EngineOptions, ModelPeerOptions
from dpu_frontend.ring import Geometry
from dpu_frontend.settings import PARSERS, SETTINGS, build

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
    assert logging_ == LoggingConfig(format="json")


def test_defaults_without_any_file(tmp_path: Path) -> None:
    config, _ = build({}, config_path=None, env={"DPU_FRONTEND_PEERS": "1.2.3.4:5, 1.2.3.4:6"})
    assert config.port == 8000 and config.transport == "verbs"
    assert [p.port for p in config.peers] == [5, 6]
    config, logging_ = build({}, config_path=None, env={})
    assert config == ServeConfig() and config.peers == (DEFAULT_PEER,)
    assert logging_ == LoggingConfig()


@pytest.mark.parametrize(("text", "env", "message"), [
    ("[serve]\nprot = 1\n", {}, r"config.toml: serve.prot: unknown setting 'prot'"),
    ("[serve]\nport = 'x'\n", {}, r"serve.port: invalid literal"),
    ("[serve]\nport = true\n", {}, r"serve.port: expected int, got bool"),
    ("[serving]\n", {}, r"unknown table \[serving\]"),
    ("[serve]\n", {"DPU_FRONTEND_PEER_TIMEOUT_S": "soon"}, r"DPU_FRONTEND_PEER_TIMEOUT_S"),
    ("[serve]\npeer_timeout_s = -1\n", {}, r"peer_timeout_s must be > 0"),
    ("[serve]\nlog_format = 'xml'\n", {}, r"log_format must be one of text, json"),
    ("[serve]\nport = 1\n[serve.rdma]\nip = 'nope'\n", {}, r"rdma ip"),
    ("[serve\n", {}, r"config.toml"),
])
def test_errors_name_the_key(tmp_path: Path, text: str, env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build({}, config_path=config_file(tmp_path, text), env=env)


def test_an_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        build({}, config_path=tmp_path / "none.toml", env={})


# The keys, parsers and flags are derived from the config dataclasses, where
# each default is written once (issue 9). These tests read the dataclasses
# directly, so a field the derivation misses, or a default copied into the
# CLI, fails here.

#: The flags tests, docs and deployments use: they keep working.
SERVE_FLAGS = {
    "--transport": "transport", "--rdma-device": "rdma_device", "--rdma-ip": "rdma_ip",
    "--peer": "peers", "--host": "host", "--port": "port", "--model-name": "model_name",
    "--tokenizer": "tokenizer", "--chat-template": "chat_template",
    "--max-model-len": "max_model_len", "--channel": "channel", "--poll-interval": "poll_interval_s",
    "--peer-timeout": "peer_timeout_s", "--reconnect-max": "reconnect_max_s",
    "--max-queued-requests": "max_queued_requests",
    "--max-queued-prompt-tokens": "max_queued_prompt_tokens",
    "--stream-buffer-records": "stream_buffer_records", "--drain-timeout": "drain_timeout_s",
    "--tokenizer-threads": "tokenizer_threads", "--workers": "workers",
    "--worker-index": "worker_index", "--metrics-dir": "metrics_dir",
    "--log-level": "log_level", "--log-format": "log_format",
}
HIDDEN = {"worker_index", "metrics_dir"}  # set by the worker supervisor


def dataclass_settings() -> dict[str, Any]:
    """Every setting key and its field, read from the dataclasses themselves."""
    keys: dict[str, Any] = {f.name: f for f in fields(ServeConfig) if f.name != "rdma"}
    keys |= {f"rdma_{f.name}": f for f in fields(RdmaConfig)}
    keys |= {f"log_{f.name}": f for f in fields(LoggingConfig)}
    return keys


def subcommand(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen: argparse.ArgumentParser = sub.choices[command]
    return chosen


def test_parsers_cover_exactly_the_fields() -> None:
    assert set(PARSERS) == set(SETTINGS) == set(dataclass_settings())


@pytest.mark.parametrize("command", ["serve", "check"])
def test_every_setting_has_its_flag(command: str) -> None:
    """No setting is file-only: each field is a flag, named by the rule or its Doc."""
    actions = {a.dest: a for a in subcommand(command)._actions}
    for key in dataclass_settings():
        assert actions[key].option_strings == [SETTINGS[key].flag]
        assert (actions[key].help == argparse.SUPPRESS) == (key in HIDDEN), key
    for flag, key in SERVE_FLAGS.items():
        assert actions[key].option_strings == [flag]


def test_serve_help_shows_each_dataclass_default(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: argparse breaks lines at hyphens
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for key, config_field in dataclass_settings().items():
        default = config_field.default
        if key in HIDDEN:
            assert SETTINGS[key].flag not in text
        elif default is None:  # the Doc says what None means
            assert doc(config_field).none and f"(default: {doc(config_field).none}) [{key}]" in text
        elif isinstance(default, tuple):
            assert f"(default {', '.join(map(str, default))}) [{key}]" in text
        elif isinstance(default, bool):  # a value as the environment's: on, off, true...
            assert f"(default {'on' if default else 'off'}) [{key}]" in text, key
        else:
            assert f"(default {default}) [{key}]" in text, key


def test_flags_are_parsed_like_the_environment(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("DPU_FRONTEND_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DPU_FRONTEND_PORT", "9100")
    path = config_file(tmp_path)
    args = build_parser().parse_args([
        "serve", "--config", str(path), "--port", "9200", "--peer", "10.0.0.4:1",
        "--peer", "10.0.0.5:2", "--poll-interval", "0.002", "--idle-poll-interval", "0.05",
        "--log-format", "json", "--rdma-device", "rxe0"])
    config, logging_ = serve_config(args)
    assert config.port == 9200 and config.model_name == "from-file"
    assert config.peers == (PeerAddress("10.0.0.4", 1), PeerAddress("10.0.0.5", 2))
    assert config.poll_interval_s == 0.002 and config.idle_poll_interval_s == 0.05
    assert config.rdma == RdmaConfig(device="rxe0", ip="10.0.0.1")
    assert logging_ == LoggingConfig(format="json")
    with pytest.raises(ValueError, match=r"flag --poll-interval: could not convert"):
        serve_config(build_parser().parse_args(["serve", "--config", str(path),
                                                "--poll-interval", "soon"]))


def test_peer_flags_default_to_the_peer_config() -> None:
    assert PEER.build(build_parser().parse_args(["peer"])) == PeerConfig(
        geometry=REFERENCE_GEOMETRY)
    gpu = gpu_peer_flags().build(build_parser().parse_args(["gpu-peer"]))
    assert gpu == GpuPeerConfig(peer=PeerConfig(geometry=GPU_GEOMETRY))
    assert build_parser().parse_args(["peer-stats"]).peer == str(DEFAULT_PEER)
    assert build_parser().parse_args(["demo"]).port == ServeConfig().port
    assert PeerConfig().geometry == Geometry()


def test_defaults_are_written_once() -> None:
    """No default of a config field is copied, as a literal, into the CLI or the loader."""
    defaults = {f.default for cls in (ServeConfig, RdmaConfig, LoggingConfig, PeerConfig,
                                      Geometry, GpuPeerConfig, EngineOptions, ModelPeerOptions)
                for f in fields(cls) if isinstance(f.default, int | float | str)}
    defaults |= {DEFAULT_PEER.host, DEFAULT_PEER.port}
    # Small integers are everywhere (exit codes, indices): too common to tell.
    defaults = {d for d in defaults if not isinstance(d, int) or abs(d) > 2}
    assert {8000, 18515, 0.001, 0.05, "INFO", "127.0.0.1"} <= defaults
    for module in (dpu_frontend.cli, dpu_frontend.settings):
        source = Path(module.__file__ or "").read_text()
        for default in defaults:
            if isinstance(default, str):
                pattern = f"[\"']{re.escape(default)}[\"']"
            else:
                pattern = rf"(?<![\w.]){re.escape(repr(default))}(?![\w.])"
            assert not re.search(pattern, source), f"{module.__name__} repeats {default!r}"


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
