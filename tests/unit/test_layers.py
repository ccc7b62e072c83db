"""Product code never imports the development harness: only the CLI reaches softroce/."""

from __future__ import annotations

import ast
from pathlib import Path

import dpu_frontend

PACKAGE = Path(dpu_frontend.__file__).parent
HARNESS = "dpu_frontend.softroce"
ALLOWED = {"cli.py"}  # the CLI offers `dpu-frontend softroce` and `demo`


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_product_module_imports_the_softroce_harness() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "softroce" or str(relative) in ALLOWED:
            continue
        if any(name == HARNESS or name.startswith(HARNESS + ".") for name in imported(path)):
            offenders.append(str(relative))
    assert offenders == []


def test_the_rule_sees_an_offender(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("from dpu_frontend.softroce.harness import RXE_IP\n")
    assert HARNESS + ".harness" in imported(module)
