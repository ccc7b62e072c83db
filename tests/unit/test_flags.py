"""``flags``: a config dataclass's fields as flags, and the config built back from them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dpu_frontend.flags import Flags, about, flat, none_if_empty


@dataclass(frozen=True, slots=True)
class Inner:
    size: int = field(default=4, metadata=about("slots, 50% spare"))
    label: str | None = field(default=None, metadata=about(
        "a label", none="unnamed", parse=none_if_empty(str)))

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("size must be >= 1")


@dataclass(frozen=True, slots=True)
class Outer:
    inner: Inner = field(default_factory=Inner, metadata=flat())
    named: Inner = field(default_factory=Inner)  # flags --named-size, --named-label
    period_s: float = field(default=0.25, metadata=about("period, seconds"))
    step_s: float = field(default=0.002, metadata=about(
        "step, milliseconds", flag="--step-ms", metavar="MS", scale=1e3))
    fast: bool = field(default=True, metadata=about("go fast"))
    graphs: bool = field(default=True, metadata=about("no graphs", flag="--no-graphs"))
    mode: str = field(default="a", metadata=about("a mode", choices=("a", "b")))
    file: Path | None = field(default=None, metadata=about("a file", none="no file"))
    internal: int = 7  # no Doc: no flag


def parsed(flags: Flags[Outer], *argv: str) -> Outer:
    parser = argparse.ArgumentParser()
    flags.add_to(parser)
    return flags.build(parser.parse_args(list(argv)))


def test_every_field_with_a_doc_is_a_flag_named_by_the_rule() -> None:
    names = [f.name for f in Flags(Outer()).flags()]
    assert names == ["--size", "--label", "--named-size", "--named-label", "--period",
                     "--step-ms", "--fast", "--no-graphs", "--mode", "--file"]


def test_no_flag_builds_the_defaults_and_each_flag_its_field() -> None:
    flags = Flags(Outer())
    assert parsed(flags) == Outer()
    assert parsed(flags, "--size", "2", "--named-label", "x", "--period", "1", "--step-ms", "5",
                  "--no-fast", "--no-graphs", "--mode", "b", "--file", "/f") == Outer(
        inner=Inner(size=2), named=Inner(label="x"), period_s=1.0, step_s=0.005, fast=False,
        graphs=False, mode="b", file=Path("/f"))


def test_the_defaults_are_the_given_configs() -> None:
    flags = Flags(Outer(inner=Inner(size=9), internal=3, step_s=0.0))
    assert parsed(flags) == Outer(inner=Inner(size=9), internal=3, step_s=0.0)
    assert parsed(flags, "--size", "1").internal == 3


def test_an_omitted_field_has_no_flag_and_keeps_its_default() -> None:
    flags = Flags(Outer(period_s=0.5), omit=frozenset({"period_s", "named.size"}))
    assert [f.path for f in flags.flags()] == [
        "inner.size", "inner.label", "named.label", "step_s", "fast", "graphs", "mode", "file"]
    parser = argparse.ArgumentParser()
    flags.add_to(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--period", "1"])
    assert flags.build(parser.parse_args([])).period_s == 0.5
    with pytest.raises(TypeError, match="no flag"):
        Flags(Outer(), omit=frozenset({"periods"}))


def test_a_prefix_names_every_flag_and_dest() -> None:
    flags = Flags(Inner(), prefix="log_")
    assert [(f.name, f.dest) for f in flags.flags()] == [("--log-size", "log_size"),
                                                          ("--log-label", "log_label")]


def test_empty_values() -> None:
    """An optional field's flag gives its type's value, "" included; a Doc's parse may read
    "" as not set (the flags the daemon shares)."""
    flags = Flags(Outer())
    assert parsed(flags, "--file", "").file == Path("")
    assert parsed(flags, "--label", "").inner.label is None


def test_help_shows_each_default_in_the_flags_unit(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")
    parser = argparse.ArgumentParser()
    Flags(Outer()).add_to(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    for line in ("--size SIZE slots, 50% spare (default 4)",
                 "--label LABEL a label (default: unnamed)",
                 "--step-ms MS step, milliseconds (default 2.0)",
                 "--fast, --no-fast go fast (default on)", "--no-graphs no graphs",
                 "--mode {a,b} a mode (default a)", "--file FILE a file (default: no file)"):
        assert line in " ".join(text.split()), line


def test_bad_values() -> None:
    flags = Flags(Outer())
    with pytest.raises(ValueError, match="size must be >= 1"):  # the dataclass's own check
        parsed(flags, "--named-size", "0")
    with pytest.raises(SystemExit):  # argparse's: not an int, not a choice
        parsed(flags, "--size", "x")
    with pytest.raises(SystemExit):
        parsed(flags, "--mode", "c")


def test_a_field_that_cannot_be_a_flag_is_refused() -> None:
    @dataclass(frozen=True)
    class NoNone:
        path: Path | None = field(default=None, metadata=about("a path"))

    @dataclass(frozen=True)
    class ScaledInt:
        n: int = field(default=1, metadata=about("n", scale=1e3))

    @dataclass(frozen=True)
    class Tuple:
        items: tuple[str, ...] = field(default=(), metadata=about("items"))

    @dataclass(frozen=True)
    class OffByDefault:
        on: bool = field(default=False, metadata=about("turn it off", flag="--no-on"))

    for config, why in ((NoNone(), "none text"), (ScaledInt(), "float"),
                        (Tuple(), "no flag parser"), (OffByDefault(), "on by default")):
        with pytest.raises(TypeError, match=why):
            Flags(config).add_to(argparse.ArgumentParser())
