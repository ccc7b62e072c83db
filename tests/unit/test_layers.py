"""The import rule of docs/architecture.md, enforced the way import-linter enforces layers.

Each top-level module or package of ``dpu_frontend`` has a rank; a module may
import only from a lower rank (or from its own package). The daemon's side
(``engine``, ``http``, ``daemon``, ...) and the GPU's side (``peer``, ``gpu``, ``model``)
never import each other: they meet only in the ring protocol and the control
messages below them. Only the CLI reaches the development harness
(``softroce``), and the ring protocol does no I/O.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dpu_frontend

PACKAGE = Path(dpu_frontend.__file__).parent

#: Lowest first. Same rank: neither may import the other.
RANKS: dict[str, int] = {
    "__init__": 0, "errors": 0, "flags": 0,
    "ring": 1,
    "config": 2, "metrics": 2, "logs": 2, "sdnotify": 2, "lifecycle": 2, "private": 2,
    "gguf": 2,
    "control": 3, "text": 3, "transport": 3, "settings": 3,
    "engine": 4, "peer": 4,
    "http": 5, "gpu": 5,
    "daemon": 6, "model": 6,
    "check": 7, "workers": 7,
    "softroce": 8,
    "cli": 9,
}
DAEMON_SIDE = {"engine", "http", "daemon", "check", "workers"}
GPU_SIDE = {"peer", "gpu", "model"}
#: Sans-I/O: the ring protocol is handed bytes and the time, never a socket or a QP.
NO_IO_IN_RING = {"asyncio", "socket", "aiohttp", "pyverbs", "selectors", "subprocess"}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def part(module: str) -> str:
    """``dpu_frontend.engine.link`` -> ``engine``; ``dpu_frontend`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def violations(source: str, names: set[str]) -> list[str]:
    found = []
    for name in sorted(names):
        if name.split(".")[0] != "dpu_frontend":
            if source == "ring" and name.split(".")[0] in NO_IO_IN_RING:
                found.append(f"ring imports {name}: the protocol is sans-I/O")
            continue
        target = part(name)
        if target == source:
            continue
        if target not in RANKS:
            found.append(f"{source} imports {name}, which has no rank in RANKS")
        elif RANKS[target] >= RANKS[source]:
            found.append(f"{source} (rank {RANKS[source]}) imports {name} "
                         f"(rank {RANKS[target]})")
        elif {source, target} <= DAEMON_SIDE | GPU_SIDE and (
                (source in DAEMON_SIDE) != (target in DAEMON_SIDE)):
            found.append(f"{source} imports {name}: the daemon and the GPU side meet only "
                         "in the ring protocol and the control messages")
    return found


#: Inside ``model``: the pure parts (no torch: scheduling, step metadata, sampling's
#: specification, the device code's twins), the layers, what names a model (its spec,
#: config, checkpoint, weights, the decoders), then what drives the GPU. A module imports
#: only from its own rank or below: the layers never name a model, a model never reaches
#: the runner that drives it.
MODEL_RANKS: dict[str, int] = {
    "__init__": 0, "sampling": 0, "blocks": 0, "scheduler": 0, "options": 0,
    "metadata": 0, "device": 0, "automata": 0,
    "layers": 1,
    "config": 2, "registry": 2, "checkpoint": 2, "gguf_checkpoint": 2, "weights": 2,
    "models": 2, "tensor_parallel": 2,
    "runner": 3, "graphs": 3, "engine": 3, "events": 3, "gpu_scheduler": 3, "publish": 3, "source": 3,
    "peer": 3,
}


def model_part(module: str) -> str | None:
    """``dpu_frontend.model.layers.linear`` -> ``layers``; None outside ``model``."""
    parts = module.split(".")
    if parts[:2] != ["dpu_frontend", "model"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def model_violations(source: str, names: set[str]) -> list[str]:
    """``source``: a part of ``model`` (``MODEL_RANKS``' keys)."""
    found = []
    for name in sorted(names):
        target = model_part(name)
        if target is None:
            continue
        if target not in MODEL_RANKS:
            found.append(f"model.{source} imports {name}, which has no rank in MODEL_RANKS")
        elif MODEL_RANKS[target] > MODEL_RANKS[source]:
            found.append(f"model.{source} (rank {MODEL_RANKS[source]}) imports {name} "
                         f"(rank {MODEL_RANKS[target]})")
    return found


def test_inside_the_model_the_layers_are_below_the_models() -> None:
    model = PACKAGE / "model"
    parts = {path.relative_to(model).parts[0].removesuffix(".py"): path
             for path in sorted(model.rglob("*.py"))}
    assert set(parts) <= set(MODEL_RANKS)
    found = [f"{path.relative_to(PACKAGE)}: {v}" for path in sorted(model.rglob("*.py"))
             for v in model_violations(path.relative_to(model).parts[0].removesuffix(".py"),
                                       imported(path))]
    assert found == []
    assert model_violations("layers", {"dpu_frontend.model.models.qwen3"}) != []
    assert model_violations("models", {"dpu_frontend.model.runner"}) != []


def modules() -> list[tuple[str, Path]]:
    return [(path.relative_to(PACKAGE).parts[0].removesuffix(".py"), path)
            for path in sorted(PACKAGE.rglob("*.py"))]


def test_every_part_of_the_package_has_a_rank() -> None:
    assert {source for source, _ in modules()} <= set(RANKS)


def test_every_import_goes_down_the_layers() -> None:
    found = [f"{path.relative_to(PACKAGE)}: {v}" for source, path in modules()
             for v in violations(source, imported(path))]
    assert found == []


@pytest.mark.parametrize(("source", "name"), [
    ("engine", "dpu_frontend.http.errors"),  # upwards
    ("text", "dpu_frontend.transport.base"),  # sideways, same rank
    ("daemon", "dpu_frontend.softroce.harness"),  # the dev harness
    ("http", "dpu_frontend.gpu.runtime"),  # across to the GPU side
    ("gpu", "dpu_frontend.engine.link"),  # and back
    ("ring", "asyncio"),  # I/O in the protocol
])
def test_the_rule_sees_an_offender(source: str, name: str) -> None:
    assert violations(source, {name}) != []


def test_an_import_inside_a_function_is_seen(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("def f() -> None:\n    from dpu_frontend.softroce.harness import RXE_IP\n")
    assert violations("daemon", imported(module)) != []
