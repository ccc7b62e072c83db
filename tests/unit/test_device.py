"""RDMA device and GID resolution from a sysfs tree (built here, no RDMA needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpu_frontend.errors import StartupError
from dpu_frontend.transport.verbs.device import gid_table, resolve

LINK_LOCAL = "fe80:0000:0000:0000:f84a:a1ff:fe5b:d764"
MAPPED = "0000:0000:0000:0000:0000:ffff:0adf:0001"  # 10.223.0.1
EMPTY = "0000:0000:0000:0000:0000:0000:0000:0000"


def make(root: Path, device: str, gids: list[tuple[str, str | None]]) -> None:
    port = root / device / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    for i, (gid, kind) in enumerate(gids):
        (port / "gids" / str(i)).write_text(gid + "\n")
        if kind is not None:
            (port / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    make(tmp_path, "rxe0", [(LINK_LOCAL, "RoCE v2"), (MAPPED, "RoCE v2"), (EMPTY, None)])
    return tmp_path


def test_table_skips_empty_entries(sysfs: Path) -> None:
    assert [(e.device, e.index) for e in gid_table(sysfs)] == [("rxe0", 0), ("rxe0", 1)]


def test_resolve_by_ip(sysfs: Path) -> None:
    entry = resolve(None, "10.223.0.1", sysfs)
    assert (entry.device, entry.port, entry.index, entry.ipv4) == ("rxe0", 1, 1, "10.223.0.1")


def test_resolve_by_name_prefers_the_ipv4_mapped_gid(sysfs: Path) -> None:
    assert resolve("rxe0", None, sysfs).index == 1


def test_unknown_ip_is_a_clear_startup_error(sysfs: Path) -> None:
    with pytest.raises(StartupError, match=r"no RDMA device has a RoCE v2 GID for 10\.0\.0\.9"):
        resolve(None, "10.0.0.9", sysfs)


def test_several_devices_need_a_name(sysfs: Path) -> None:
    make(sysfs, "mlx5_0", [(MAPPED.replace("0001", "0002"), "RoCE v2")])
    with pytest.raises(StartupError, match="several RDMA devices"):
        resolve(None, None, sysfs)
    assert resolve("mlx5_0", None, sysfs).device == "mlx5_0"


def test_no_device_at_all(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="no RDMA device"):
        resolve(None, None, tmp_path / "missing")
