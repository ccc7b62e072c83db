"""Where ``ServeConfig`` comes from: a TOML file, ``DPU_FRONTEND_*`` variables, CLI flags.

Later sources win: defaults < ``/etc/dpu-frontend/config.toml`` (or
``--config``) < environment < flags given on the command line. Every key is
a ``ServeConfig`` field name (``[serve]`` table of the file; upper-cased with
the ``DPU_FRONTEND_`` prefix in the environment). A bad value is an error
that names its key and where it came from; nothing reads the environment
anywhere else.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from dpu_frontend.config import PeerAddress, RdmaConfig, ServeConfig

DEFAULT_PATH = Path("/etc/dpu-frontend/config.toml")
ENV_PREFIX = "DPU_FRONTEND_"


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (true/false)")


def _peers(value: Any) -> tuple[PeerAddress, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ValueError("peers must be a list of HOST:PORT strings")
    return tuple(PeerAddress.parse(i.strip()) for i in items if i.strip())


def _typed(kind: type) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if isinstance(value, str) and kind is not str:
            if kind is bool:
                return _bool(value)
            return kind(value)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is Path and isinstance(value, str):
            return Path(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value
    return parse


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value in ("", None) else parse(value)


#: Every setting: its parser. ``rdma_device``/``rdma_ip`` fill ``ServeConfig.rdma``.
PARSERS: dict[str, Callable[[Any], Any]] = {
    "peers": _peers,
    "transport": _typed(str),
    "rdma_device": _optional(_typed(str)),
    "rdma_ip": _optional(_typed(str)),
    "host": _typed(str),
    "port": _typed(int),
    "model_name": _typed(str),
    "tokenizer": _optional(_typed(Path)),
    "chat_template": _optional(_typed(Path)),
    "max_model_len": _optional(_typed(int)),
    "channel": _typed(int),
    "poll_interval_s": _typed(float),
    "idle_poll_interval_s": _typed(float),
    "connect_timeout_s": _typed(float),
    "peer_timeout_s": _typed(float),
    "reconnect_initial_s": _typed(float),
    "reconnect_max_s": _typed(float),
    "max_queued_requests": _typed(int),
    "max_queued_prompt_tokens": _typed(int),
    "stream_buffer_records": _typed(int),
    "drain_timeout_s": _typed(float),
    "tokenizer_threads": _typed(int),
    "workers": _typed(int),
    "worker_index": _optional(_typed(int)),
    "metrics_dir": _optional(_typed(Path)),
    "log_format": _typed(str),
    "log_level": _typed(str),
}
_FIELDS = {f.name for f in fields(ServeConfig)}


def read_file(path: Path | None) -> dict[str, Any]:
    """The ``[serve]`` table, flattened (``[serve.rdma]`` keys become ``rdma_*``)."""
    explicit = path is not None
    path = path or DEFAULT_PATH
    if not path.is_file():
        if explicit:
            raise ValueError(f"config file {path} does not exist")
        return {}
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    unknown_tables = set(document) - {"serve"}
    if unknown_tables:
        raise ValueError(f"{path}: unknown table [{sorted(unknown_tables)[0]}] (expected [serve])")
    serve = dict(document.get("serve", {}))
    rdma = serve.pop("rdma", {})
    if not isinstance(rdma, dict):
        raise ValueError(f"{path}: serve.rdma must be a table")
    entries = {f"{path}: serve.{k}": (k, v) for k, v in serve.items()}
    entries |= {f"{path}: serve.rdma.{k}": (f"rdma_{k}", v) for k, v in rdma.items()}
    return entries


def read_environment(env: Mapping[str, str]) -> dict[str, Any]:
    """``DPU_FRONTEND_<SETTING>`` variables (others with the prefix belong to the tools)."""
    out = {}
    for name, text in env.items():
        key = name.removeprefix(ENV_PREFIX).lower()
        if name.startswith(ENV_PREFIX) and key in PARSERS:
            out[f"environment {name}"] = (key, text)
    return out


def build(flags: Mapping[str, Any], *, config_path: Path | None,
          env: Mapping[str, str]) -> tuple[ServeConfig, dict[str, Any]]:
    """The daemon's config, and the logging settings (not part of it)."""
    sources: dict[str, tuple[str, Any]] = {}
    sources |= read_file(config_path)
    sources |= read_environment(env)
    sources |= {f"flag --{k.replace('_', '-')}": (k, v) for k, v in flags.items()
                if v is not None}
    values: dict[str, Any] = {}
    for where, (key, raw) in sources.items():
        parse = PARSERS.get(key)
        if parse is None:
            raise ValueError(f"{where}: unknown setting {key!r}")
        try:
            values[key] = parse(raw)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    logging: dict[str, Any] = {k: values.pop(k) for k in ("log_format", "log_level") if k in values}
    rdma = RdmaConfig(device=values.pop("rdma_device", None), ip=values.pop("rdma_ip", None))
    values.setdefault("peers", (PeerAddress("127.0.0.1", 18515),))
    try:
        config = ServeConfig(rdma=rdma, **{k: v for k, v in values.items() if k in _FIELDS})
    except ValueError as exc:
        raise ValueError(f"configuration: {exc}") from exc
    return config, logging
