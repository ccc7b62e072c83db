"""The GPU side's refusals, checked without a GPU: device preconditions, and the memory
registration of either persistent kernel's GPU region (the CUDA peer's, the GPU
scheduler's) through dma-buf or nvidia-peermem."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import Any, cast

import pytest

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu import registration
from dpu_frontend.gpu.library import DeviceInfo, PersistentLibrary
from dpu_frontend.gpu.options import GpuPeerConfig
from dpu_frontend.gpu.runtime import PEER_SOURCES, PeerLibrary, build_command, find_nvcc
from dpu_frontend.model.device.sched_core import SchedulerLibrary
from dpu_frontend.transport.verbs import compat
from dpu_frontend.transport.verbs.resources import RdmaResources


def device(**fields: int) -> DeviceInfo:
    info = DeviceInfo(name=b"NVIDIA H100 80GB HBM3", sm_count=132, major=9, minor=0,
                      gdr_writes_ordering=100, gdr_supported=1, dmabuf_supported=1,
                      can_map_host=1)
    for name, value in fields.items():
        setattr(info, name, value)
    return info


def test_a_device_that_orders_gpudirect_writes_is_accepted() -> None:
    registration.check_device(device())


@pytest.mark.parametrize(("fields", "message"), [
    ({"gdr_writes_ordering": 0}, "does not order GPUDirect RDMA writes"),
    ({"gdr_supported": 0}, "does not support GPUDirect RDMA"),
])
def test_a_device_the_ordering_rules_cannot_hold_on_is_refused(fields: dict[str, int],
                                                                message: str) -> None:
    with pytest.raises(StartupError, match=message):
        registration.check_device(device(**fields))


class FakeLibrary:
    """Stands in for a loaded persistent-kernel library (the ``ctypes.CDLL`` under a
    ``PersistentLibrary``): its region's dma-buf export (``fd``, or None: refused) and
    device address, under the library's own names."""

    def __init__(self, library: type[PersistentLibrary], fd: int | None) -> None:
        self.exported: list[int] = []
        self.fd = fd

        def dmabuf_fd(handle: int, fd_out: Any, offset_out: Any) -> int:
            self.exported.append(handle)
            if self.fd is None:
                return -1
            fd_out._obj.value, offset_out._obj.value = self.fd, 0
            return 0

        prefix = library.prefix
        assert library.last_error is not None
        setattr(self, f"{prefix}_dmabuf_fd", dmabuf_fd)
        setattr(self, f"{prefix}_region_device_ptr", lambda handle: DEVICE_ADDRESS)
        setattr(self, library.last_error, lambda: b"the region is host memory")


class FakeVerbs:
    """pyverbs' ``mr`` and ``errors`` modules: the MRs registered, or a registration that
    fails (``refuse``: "dmabuf", "peermem")."""

    class PyverbsError(Exception):
        pass

    def __init__(self, refuse: str = "") -> None:
        self.refuse = refuse
        self.registered: list[dict[str, Any]] = []

    def module(self, name: str) -> FakeVerbs:
        assert name in ("mr", "errors")
        return self

    def DmaBufMR(self, pd: Any, size: int, access: int, *, dmabuf: int,
                 offset: int) -> dict[str, Any]:
        if self.refuse == "dmabuf":
            raise self.PyverbsError("ibv_reg_dmabuf_mr: Operation not supported")
        self.registered.append({"kind": "dma-buf", "size": size, "fd": dmabuf, "offset": offset})
        return self.registered[-1]

    def MR(self, pd: Any, size: int, access: int, *, address: int) -> dict[str, Any]:
        if self.refuse == "peermem":
            raise self.PyverbsError("ibv_reg_mr: Bad address")
        self.registered.append({"kind": "peermem", "size": size, "address": address})
        return self.registered[-1]


DEVICE_ADDRESS = 0x7F00_0020_0000
HANDLE = 0x5150
#: Both persistent kernels' libraries go through the one registration.
LIBRARIES = [PeerLibrary, SchedulerLibrary]


@pytest.fixture
def verbs(monkeypatch: pytest.MonkeyPatch) -> FakeVerbs:
    fake = FakeVerbs()
    monkeypatch.setattr(compat, "module", fake.module)
    monkeypatch.setattr(registration, "access_flags", lambda *, remote: 7)
    return fake


def bound(library: type[PersistentLibrary], fd: int | None) -> PersistentLibrary:
    return library(cast(ctypes.CDLL, FakeLibrary(library, fd)), Path("/nowhere/lib.so"))


def closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


@pytest.mark.parametrize("library", LIBRARIES, ids=lambda lib: lib.prefix)
def test_the_region_is_registered_through_its_dma_buf(
        library: type[PersistentLibrary], verbs: FakeVerbs, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """dma-buf first, even where nvidia-peermem is loaded; the fd is closed once the MR
    holds the dma-buf, and the daemon names the region from its offset (iova = offset)."""
    monkeypatch.setattr(registration, "PEERMEM_MODULE", tmp_path)  # loaded
    fd = os.open(os.devnull, os.O_RDONLY)
    resources = RdmaResources()
    mr, address = registration.register_gpu_region(bound(library, fd), HANDLE, resources, 4 << 20)
    assert verbs.registered == [{"kind": "dma-buf", "size": 4 << 20, "fd": fd, "offset": 0}]
    assert (mr, address) == (verbs.registered[0], 0)
    assert resources._mrs == [mr]  # closed with the resources, before the memory goes
    assert closed(fd)


@pytest.mark.parametrize("library", LIBRARIES, ids=lambda lib: lib.prefix)
@pytest.mark.parametrize("dmabuf", ["refused", "unregistrable"])
def test_without_a_dma_buf_nvidia_peermem_registers_the_device_address(
        library: type[PersistentLibrary], dmabuf: str, verbs: FakeVerbs,
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(registration, "PEERMEM_MODULE", tmp_path)
    fd = None if dmabuf == "refused" else os.open(os.devnull, os.O_RDONLY)
    verbs.refuse = "dmabuf"
    mr, address = registration.register_gpu_region(bound(library, fd), HANDLE, RdmaResources(),
                                                    4 << 20)
    assert verbs.registered == [{"kind": "peermem", "size": 4 << 20, "address": DEVICE_ADDRESS}]
    assert (mr, address) == (verbs.registered[0], DEVICE_ADDRESS)
    assert fd is None or closed(fd)


@pytest.mark.parametrize("library", LIBRARIES, ids=lambda lib: lib.prefix)
def test_without_dma_buf_or_peermem_registration_is_refused(
        library: type[PersistentLibrary], verbs: FakeVerbs, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setattr(registration, "PEERMEM_MODULE", tmp_path / "nvidia_peermem")
    lib = bound(library, None)
    with pytest.raises(StartupError, match=r"no dma-buf for the region: the region is host "
                                           r"memory; and the nvidia_peermem module is not loaded"):
        registration.register_gpu_region(lib, HANDLE, RdmaResources(), 4096)
    assert verbs.registered == []
    assert cast(FakeLibrary, lib.lib).exported == [HANDLE]  # the library's own export, asked


@pytest.mark.parametrize("library", LIBRARIES, ids=lambda lib: lib.prefix)
def test_a_peermem_registration_that_fails_says_both_reasons(
        library: type[PersistentLibrary], verbs: FakeVerbs, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setattr(registration, "PEERMEM_MODULE", tmp_path)
    verbs.refuse = "peermem"
    with pytest.raises(StartupError, match=r"nvidia-peermem registration of 4096 bytes .*Bad "
                                           r"address \(no dma-buf for the region"):
        registration.register_gpu_region(bound(library, None), HANDLE, RdmaResources(), 4096)


@pytest.mark.parametrize(("dmabuf", "pyverbs_dmabuf", "peermem", "refusal"), [
    (1, True, False, None),
    (0, True, True, None),
    (1, False, True, None),
    (0, True, False, r"H100 80GB HBM3 exports no dma-buf .* nvidia_peermem module is not loaded"),
    (1, False, False, r"this pyverbs cannot register a dma-buf .* nvidia_peermem module is not"),
])
def test_a_machine_that_cannot_register_gpu_memory_is_refused_before_any_allocation(
        dmabuf: int, pyverbs_dmabuf: bool, peermem: bool, refusal: str | None,
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """From the device query alone (the model peer asks before its model loads)."""
    class Mr:
        pass

    if pyverbs_dmabuf:
        Mr.DmaBufMR = object  # type: ignore[attr-defined]
    monkeypatch.setattr(compat, "available", lambda: True)
    monkeypatch.setattr(compat, "module", lambda name: Mr)
    monkeypatch.setattr(registration, "PEERMEM_MODULE", tmp_path if peermem else tmp_path / "no")
    if refusal is None:
        registration.check_registrable(device(dmabuf_supported=dmabuf))
    else:
        with pytest.raises(StartupError, match=refusal):
            registration.check_registrable(device(dmabuf_supported=dmabuf))


def test_the_build_is_nvcc_for_the_configured_arch(tmp_path: Path) -> None:
    command = build_command("/opt/cuda/bin/nvcc", "sm_90", tmp_path / "lib.so", PEER_SOURCES)
    assert command[:4] == ["/opt/cuda/bin/nvcc", "-O3", "-std=c++17", "-arch=sm_90"]
    assert command[-1] == str(tmp_path / "lib.so")
    with pytest.raises(StartupError, match="nvcc not found"):
        find_nvcc(str(tmp_path / "missing-nvcc"))


def test_gpu_peer_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="heartbeat_us"):
        GpuPeerConfig(heartbeat_us=0)
    with pytest.raises(ValueError, match="step_us"):
        GpuPeerConfig(step_us=-1)


def test_a_library_of_another_release_is_refused_at_load(tmp_path: Path) -> None:
    """A stale ``--library``: refused when it is loaded, naming the function it lacks,
    rather than when a call first fails."""
    libc = ctypes.util.find_library("c")
    assert libc is not None
    with pytest.raises(StartupError, match=r"is not the CUDA peer library of this release: it "
                                           r"has no dpuf_last_error"):
        PeerLibrary.load(Path(libc))
    with pytest.raises(StartupError, match="cannot load the GPU scheduler library"):
        SchedulerLibrary.load(tmp_path / "libdpuf_sched.so")
