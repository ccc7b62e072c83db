"""Pin every runtime dependency of pyproject.toml to its lower bound.

    python -m tests.tools.lower_bounds [--pyproject pyproject.toml] > build/lower-bounds.txt

prints one ``name==X`` line per entry of ``[project] dependencies``, where X is
the version its ``>=`` names. ``deploy/dev.sh test`` installs the project with
these lines as pip constraints into a second venv and runs the in-memory tiers
there, so a lower bound that the code has outgrown fails CI. The pins are read
from pyproject.toml on every run: they cannot drift from it.

A dependency without a ``>=`` bound is an error: every one must name the
oldest release the code works with.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement


def lower_bounds(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    pins = []
    for line in project["dependencies"]:
        req = Requirement(line)
        floors = [spec.version for spec in req.specifier if spec.operator == ">="]
        if len(floors) != 1:
            raise ValueError(f"{pyproject}: dependency {line!r} needs exactly one '>=' lower bound")
        pins.append(f"{req.name}=={floors[0]}")
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pyproject", type=Path, default=Path(__file__).parents[2] / "pyproject.toml")
    args = parser.parse_args(argv)
    try:
        pins = lower_bounds(args.pyproject)
    except ValueError as exc:
        print(f"lower-bounds: {exc}", file=sys.stderr)
        return 1
    print("\n".join(pins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
