"""The GPU side's refusals, checked without a GPU: device preconditions, memory registration."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu import registration
from dpu_frontend.gpu.options import GpuPeerConfig
from dpu_frontend.gpu.runtime import PEER_SOURCES, DeviceInfo, Library, build_command, find_nvcc
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


class NoDmaBuf:
    """A library whose region cannot be exported as a dma-buf."""

    class lib:  # mirrors Library.lib
        @staticmethod
        def dpuf_peer_dmabuf_fd(peer: int, fd: Any, offset: Any) -> int:
            return -1

    @staticmethod
    def error() -> str:
        return "the region is host memory"


def test_without_dma_buf_or_peermem_registration_is_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(registration, "PEERMEM_MODULE", tmp_path / "nvidia_peermem")
    with pytest.raises(StartupError, match=r"no dma-buf .* nvidia_peermem module is not loaded"):
        # NoDmaBuf stands in for the ctypes library; the refusal comes before the
        # (never opened) resources are touched.
        registration.register_gpu_region(cast(Library, NoDmaBuf()), 1, RdmaResources(), 4096)


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
