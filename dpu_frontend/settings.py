"""Where ``ServeConfig`` comes from: a TOML file, ``DPU_FRONTEND_*`` variables, CLI flags.

Later sources win: defaults < ``/etc/dpu-frontend/config.toml`` (or
``--config``) < environment < flags given on the command line. Every key is
a ``ServeConfig`` field name, an ``RdmaConfig`` one as ``rdma_*`` or a
``LoggingConfig`` one as ``log_*`` (``[serve]`` table of the file, with
``[serve.rdma]``; upper-cased with the ``DPU_FRONTEND_`` prefix in the
environment). The keys, their parsers, flags and defaults are all derived
from the dataclass fields (``SETTINGS``). A bad value is an error that names
its key and where it came from; nothing reads the environment anywhere else.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from types import UnionType
from typing import Any, get_args, get_origin, get_type_hints

from dpu_frontend.config import LoggingConfig, PeerAddress, RdmaConfig, ServeConfig
from dpu_frontend.flags import Doc, doc, flag_name

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
    parse.__name__ = kind.__name__  # argparse names a flag's type in its errors: "invalid int value"
    return parse


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def optional(value: Any) -> Any:
        return None if value in ("", None) else parse(value)
    optional.__name__ = parse.__name__
    return optional


def _parser(kind: Any) -> Callable[[Any], Any]:
    """The parser of a field's type: the types the config dataclasses use, and no others."""
    if kind == tuple[PeerAddress, ...]:
        return _peers
    if get_origin(kind) is UnionType and type(None) in get_args(kind):
        (inner,) = (a for a in get_args(kind) if a is not type(None))
        return _optional(_parser(inner))
    if kind in (str, int, float, bool, Path):
        return _typed(kind)
    raise TypeError(f"no settings parser for {kind!r}")


@dataclass(frozen=True, slots=True)
class Setting:
    """One key of the file, the environment and the flags, derived from a config field."""

    key: str  # serve.KEY in the file (rdma_*: serve.rdma.*), DPU_FRONTEND_KEY, the flag's dest
    owner: type  # the dataclass whose field it is
    name: str  # the field's name there
    default: Any
    doc: Doc
    parse: Callable[[Any], Any]

    @property
    def flag(self) -> str:
        return flag_name(self.key, self.doc)

    @property
    def repeated(self) -> bool:
        """A tuple setting: its flag is given once per item."""
        return isinstance(self.default, tuple)


def _settings(cls: type, prefix: str = "") -> dict[str, Setting]:
    """``cls``'s fields as settings; a nested config's fields as ``<field>_<name>``."""
    hints = get_type_hints(cls)
    out: dict[str, Setting] = {}
    for config_field in fields(cls):
        kind, key = hints[config_field.name], prefix + config_field.name
        if isinstance(kind, type) and is_dataclass(kind):
            out |= _settings(kind, f"{key}_")
        else:
            out[key] = Setting(key, cls, config_field.name, config_field.default,
                               doc(config_field), _parser(kind))
    return out


#: Every setting, in ``--help`` order. Logging is set up by the CLI, so its
#: settings (``log_*``) are read with the daemon's but kept out of ``ServeConfig``.
SETTINGS: dict[str, Setting] = _settings(ServeConfig) | _settings(LoggingConfig, "log_")
#: Every setting: its parser.
PARSERS: dict[str, Callable[[Any], Any]] = {key: s.parse for key, s in SETTINGS.items()}


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


def _where_flag(key: str) -> str:
    setting = SETTINGS.get(key)
    return f"flag {setting.flag if setting else key}"


def _fields_of(owner: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The values that belong to ``owner``'s fields, by field name."""
    return {SETTINGS[key].name: value for key, value in values.items()
            if SETTINGS[key].owner is owner}


def build(flags: Mapping[str, Any], *, config_path: Path | None,
          env: Mapping[str, str]) -> tuple[ServeConfig, LoggingConfig]:
    """The daemon's config, and the logging settings (not part of it).

    ``flags`` maps keys to what the command line gave (None: not given); they
    are parsed like the environment's strings, so all three sources agree.
    """
    sources: dict[str, tuple[str, Any]] = {}
    sources |= read_file(config_path)
    sources |= read_environment(env)
    sources |= {_where_flag(k): (k, v) for k, v in flags.items() if v is not None}
    values: dict[str, Any] = {}
    for where, (key, raw) in sources.items():
        parse = PARSERS.get(key)
        if parse is None:
            raise ValueError(f"{where}: unknown setting {key!r}")
        try:
            values[key] = parse(raw)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    rdma = RdmaConfig(**_fields_of(RdmaConfig, values))
    try:
        config = ServeConfig(rdma=rdma, **_fields_of(ServeConfig, values))
        logging = LoggingConfig(**_fields_of(LoggingConfig, values))
    except ValueError as exc:
        raise ValueError(f"configuration: {exc}") from exc
    return config, logging
