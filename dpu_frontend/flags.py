"""A config dataclass's fields as command-line flags: their metadata, and the parser's side.

A field that is a setting carries a ``Doc`` (``field(metadata=about(...))``): what
it means, and how its flag differs from the field where it does (spelling,
choices, unit). Its default is the field's, written once, there. ``settings``
derives the daemon's keys and flags from the Docs of ``ServeConfig``; ``Flags``
derives a peer command's flags from its option dataclasses, nested ones
included, and builds them back from what the parser read.

It imports nothing of the package: the ring's ``Geometry``, the configs and the
GPU side's options all describe their fields with it, so it sits below them all.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import Field, dataclass, fields, is_dataclass, replace
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


@dataclass(frozen=True, slots=True)
class Doc:
    """What a setting means and how it is spelled as a flag: its field's metadata."""

    help: str
    none: str = ""  # what a None default means (shown as the default)
    #: "": the key with dashes, less a unit suffix _s (poll_interval_s: --poll-interval).
    #: A bool is --name and --no-name; spelled "--no-name", only that flag, which turns
    #: the field off (the help then says what turning it off does).
    flag: str = ""
    choices: tuple[str | int, ...] = ()
    hidden: bool = False  # set by the program (the worker supervisor), not by people
    metavar: str = ""  # the value's name in --help; "": the flag's, upper-cased
    #: The flag's unit per the field's: 1e3 for a field in seconds given in milliseconds.
    scale: float = 1.0
    #: A peer flag's text to the value; None: the field's type (X of ``X | None``: a flag
    #: that is given has a value, never None). The daemon's settings read an empty value
    #: as None (settings._optional); a flag both sides take says so with ``none_if_empty``.
    parse: Callable[[str], Any] | None = None


_DOC = "dpu_frontend.doc"
_FLAT = "dpu_frontend.flat"


def about(help: str, *, none: str = "", flag: str = "", choices: tuple[str | int, ...] = (),
          hidden: bool = False, metavar: str = "", scale: float = 1.0,
          parse: Callable[[str], Any] | None = None) -> dict[str, Doc]:
    """A setting field's metadata: ``field(default=..., metadata=about(...))``."""
    return {_DOC: Doc(help, none, flag, choices, hidden, metavar, scale, parse)}


def flat() -> dict[str, bool]:
    """A nested config field's metadata: its fields' flags keep their own names. Without
    it they take the field's name as a prefix (``rdma.device``: ``--rdma-device``)."""
    return {_FLAT: True}


def doc(config_field: Field[Any]) -> Doc:
    found = config_field.metadata.get(_DOC)
    if not isinstance(found, Doc):
        raise TypeError(f"{config_field.name} is not a setting: its metadata has no Doc")
    return found


def flag_name(key: str, found: Doc) -> str:
    """The flag of setting ``key``: its Doc's spelling, else the key by the rule."""
    return found.flag or "--" + key.removesuffix("_s").replace("_", "-")


def none_if_empty(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A flag's parser that reads an empty value as None (not set), as the daemon does."""
    def optional(text: str) -> Any:
        return None if text == "" else parse(text)
    optional.__name__ = getattr(parse, "__name__", "value")  # argparse: "invalid str value"
    return optional


def help_text(found: Doc, default: Any, suffix: str = "") -> str:
    """A flag's help: the Doc's, the default (what None means, for a None default), and
    ``suffix``; %-escaped, since argparse %-formats it."""
    if isinstance(default, bool) and found.flag.startswith("--no-"):
        shown = ""  # the flag is the change from the default
    elif default is None:
        shown = f" (default: {found.none})"
    elif isinstance(default, bool):
        shown = f" (default {'on' if default else 'off'})"
    elif isinstance(default, tuple):
        shown = f" (default {', '.join(map(str, default))})"
    elif found.scale != 1:
        shown = f" (default {default * found.scale})"
    else:
        shown = f" (default {default})"
    return f"{found.help}{shown}{' ' if suffix else ''}{suffix}".replace("%", "%%")


@dataclass(frozen=True, slots=True)
class Flag:
    """One field as a flag: where the field is, and the parser's dest for it."""

    path: str  # dotted from the top config: "peer.geometry.channels"
    dest: str  # the prefixes and the field's name: "rdma_device"
    doc: Doc
    kind: Any  # the field's type
    default: Any

    @property
    def name(self) -> str:
        return flag_name(self.dest, self.doc)

    def parse(self) -> Callable[[str], Any]:
        """The flag's text to the field's value, in the field's unit."""
        base = self.doc.parse or _parser(self.kind, self.path)
        scale = self.doc.scale
        if scale == 1:
            return base
        if self.kind is not float:
            raise TypeError(f"{self.path}: only a float field is given in another unit")

        def scaled(text: str) -> Any:
            return base(text) / scale
        scaled.__name__ = getattr(base, "__name__", "value")
        return scaled

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        text = help_text(self.doc, self.default)
        if self.kind is bool and self.doc.flag.startswith("--no-"):
            if self.default is not True:
                raise TypeError(f"{self.path}: {self.doc.flag} turns off what is on by default")
            parser.add_argument(self.doc.flag, dest=self.dest, action="store_false", help=text)
        elif self.kind is bool:
            parser.add_argument(self.name, dest=self.dest, action=argparse.BooleanOptionalAction,
                                default=self.default, help=text)
        else:
            if self.default is None and not self.doc.none:
                raise TypeError(f"{self.path}: a None default needs its Doc's none text")
            # argparse would name the value after the dest, a field's name (--kv-blocks
            # NUM_BLOCKS): named after the flag instead.
            metavar = self.doc.metavar or self.name.removeprefix("--").replace("-", "_").upper()
            parser.add_argument(self.name, dest=self.dest, type=self.parse(),
                                default=self.default, choices=self.doc.choices or None,
                                metavar=None if self.doc.choices else metavar, help=text)


def _parser(kind: Any, path: str) -> Callable[[str], Any]:
    if get_origin(kind) is UnionType and type(None) in get_args(kind):
        (kind,) = (a for a in get_args(kind) if a is not type(None))
    if kind in (str, int, float, Path):
        parse: Callable[[str], Any] = kind
        return parse
    raise TypeError(f"{path}: no flag parser for {kind!r}; give its Doc a parse")


def _walk(config: DataclassInstance, prefix: str, path: str) -> Iterator[Flag]:
    """``config``'s fields that have a Doc, nested configs' included, with their values."""
    hints = get_type_hints(type(config))
    for config_field in fields(config):
        kind, value = hints[config_field.name], getattr(config, config_field.name)
        here = path + config_field.name
        if isinstance(kind, type) and is_dataclass(kind):
            inner = prefix if config_field.metadata.get(_FLAT) else f"{prefix}{config_field.name}_"
            yield from _walk(value, inner, here + ".")
        elif _DOC in config_field.metadata:
            yield Flag(here, prefix + config_field.name, doc(config_field), kind, value)


def _rebuilt(config: C, values: Mapping[str, Any], path: str = "") -> C:
    """``config`` with ``values`` (by dotted path) in its fields, nested configs rebuilt
    first: each validates itself in its ``__post_init__``."""
    changes: dict[str, Any] = {}
    for config_field in fields(config):
        here = path + config_field.name
        if here in values:
            changes[config_field.name] = values[here]
        elif any(p.startswith(here + ".") for p in values):
            changes[config_field.name] = _rebuilt(getattr(config, config_field.name), values,
                                                  here + ".")
    return replace(config, **changes)


@dataclass(frozen=True, slots=True)
class Flags(Generic[C]):
    """One command's flags for a config dataclass, and the config built back from them.

    Every field with a Doc is a flag, nested configs' fields included, unless the
    command ``omit``s it (dotted paths: ``peer.tick_s``). ``defaults`` is the config
    the command starts from: each flag's default, and the value of every field that
    is not a flag. ``prefix`` goes before each dest and flag (``log_``: --log-level).
    """

    defaults: C
    omit: frozenset[str] = frozenset()
    prefix: str = ""

    def __post_init__(self) -> None:
        unknown = self.omit - {f.path for f in _walk(self.defaults, self.prefix, "")}
        if unknown:
            raise TypeError(f"{type(self.defaults).__name__} has no flag {sorted(unknown)}")

    def flags(self) -> list[Flag]:
        return [f for f in _walk(self.defaults, self.prefix, "") if f.path not in self.omit]

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        for flag in self.flags():
            flag.add_to(parser)

    def build(self, args: argparse.Namespace) -> C:
        """The config from the parsed flags; a ``ValueError`` from a ``__post_init__``
        says what is wrong (the CLI: a usage error)."""
        return _rebuilt(self.defaults, {f.path: getattr(args, f.dest) for f in self.flags()})
