"""Find an RDMA device, port and RoCE v2 GID index from sysfs.

Operators name a device (``rxe0``, ``mlx5_2``) or an IP address; RoCE needs
the GID index whose GID maps that address, of type "RoCE v2". sysfs has it
all without opening the device, so ``dpu-frontend check`` and the tests can
use this module on a machine with no RDMA at all (``root`` is a parameter).
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dpu_frontend.errors import StartupError

SYSFS = Path("/sys/class/infiniband")


def kernel_has_rxe() -> bool:
    """True when this kernel can create a soft-RoCE (``rdma_rxe``) device itself."""
    if Path("/sys/module/rdma_rxe").is_dir():
        return True
    modinfo = shutil.which("modinfo") or "/usr/sbin/modinfo"
    try:
        result = subprocess.run([modinfo, "rdma_rxe"], capture_output=True, check=False)
    except FileNotFoundError:
        return False
    return result.returncode == 0


@dataclass(frozen=True, slots=True)
class GidEntry:
    device: str
    port: int
    index: int
    gid: str  # 32 hex digits with colons, as sysfs prints it
    kind: str  # "RoCE v2", "IB/RoCE v1", ...

    @property
    def ipv4(self) -> str | None:
        address = ipaddress.IPv6Address(self.gid)
        mapped = address.ipv4_mapped
        return str(mapped) if mapped else None


def gid_table(root: Path = SYSFS) -> list[GidEntry]:
    """Every populated GID of every port, in device, port, index order."""
    entries: list[GidEntry] = []
    if not root.is_dir():
        return entries
    for dev in sorted(root.iterdir()):
        for port_dir in sorted((dev / "ports").glob("*")):
            gids = port_dir / "gids"
            for gid_file in sorted(gids.glob("*"), key=lambda p: int(p.name)):
                try:
                    gid = gid_file.read_text().strip()
                    kind = (port_dir / "gid_attrs" / "types" / gid_file.name).read_text().strip()
                except OSError:
                    continue  # an unpopulated entry: the kernel refuses to read its type
                if ipaddress.IPv6Address(gid) == ipaddress.IPv6Address(0):
                    continue
                entries.append(GidEntry(dev.name, int(port_dir.name), int(gid_file.name), gid, kind))
    return entries


def resolve(device: str | None, ip: str | None, root: Path = SYSFS) -> GidEntry:
    """The RoCE v2 GID to use: by IP address, by device name, or the only device present.

    With a device name and no IP, an IPv4-mapped GID is preferred (it is the
    one RDMA CM and the peer's address agree on).
    """
    table = [e for e in gid_table(root) if e.kind == "RoCE v2"]
    if ip is not None:
        matches = [e for e in table if e.ipv4 == ip or ipaddress.ip_address(e.gid) == _as_v6(ip)]
        if device is not None:
            matches = [e for e in matches if e.device == device]
        if not matches:
            raise StartupError(
                f"no RDMA device has a RoCE v2 GID for {ip}"
                + (f" on {device}" if device else "")
                + "; is the address on the netdev an rxe/mlx5 device sits on? (rdma link show)"
            )
        return matches[0]
    if device is not None:
        table = [e for e in table if e.device == device]
        if not table:
            raise StartupError(f"RDMA device {device} not found or has no RoCE v2 GID "
                               "(rdma link show; ibv_devinfo)")
    elif len({e.device for e in table}) > 1:
        names = ", ".join(sorted({e.device for e in table}))
        raise StartupError(f"several RDMA devices ({names}): name one with --rdma-device")
    if not table:
        raise StartupError("no RDMA device with a RoCE v2 GID; see deploy/softroce/ "
                           "to create a soft-RoCE device")
    mapped = [e for e in table if e.ipv4]
    return (mapped or table)[0]


def _as_v6(ip: str) -> ipaddress.IPv6Address | None:
    address = ipaddress.ip_address(ip)
    return address if isinstance(address, ipaddress.IPv6Address) else None
