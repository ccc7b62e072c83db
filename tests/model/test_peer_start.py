"""``model-peer --scheduler gpu``: what the region needs of the machine is refused before the
model loads (no GPU: the library and the RDMA device are stand-ins).

The model peer's module imports the model's torch modules (absent in CI), so it is
loaded here over stand-ins of them (``runner``, ``gpu_scheduler``) whose every use
raises ``ModelLoaded``: a refusal that comes after the model's first touch fails
the test.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import pytest

from dpu_frontend.config import PeerConfig
from dpu_frontend.errors import StartupError
from dpu_frontend.gpu import registration
from dpu_frontend.gpu.library import DeviceInfo
from dpu_frontend.model.device.sched_core import SchedulerLibrary
from dpu_frontend.model.options import ModelPeerOptions, RunnerOptions
from dpu_frontend.peer import region as region_mod
from dpu_frontend.transport.verbs import compat
from dpu_frontend.transport.verbs.device import GidEntry

ORDERING_OWNER = registration.WRITES_ORDERING_OWNER


class ModelLoaded(Exception):
    """The peer went on to the model."""


def reached(*args: Any, **kwargs: Any) -> Any:
    raise ModelLoaded


def stand_in(name: str, **attributes: Any) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(attributes)
    return module


@pytest.fixture
def model_peer(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``dpu_frontend.model.peer``, loaded under a name of its own (nothing else sees it)
    over stand-ins of the modules that hold the model."""
    monkeypatch.setitem(sys.modules, "dpu_frontend.model.runner",
                        stand_in("dpu_frontend.model.runner", ModelRunner=reached))
    monkeypatch.setitem(sys.modules, "dpu_frontend.model.gpu_scheduler",
                        stand_in("dpu_frontend.model.gpu_scheduler", GpuSchedulerKernel=reached,
                                 sampler_reserve=reached))
    spec = importlib.util.find_spec("dpu_frontend.model.peer")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Machine:
    """What the checks see of this machine: the GPU (its device query, through the
    scheduler's library), the RDMA device, and nvidia-peermem."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.gpu = DeviceInfo(name=b"NVIDIA H100 80GB HBM3", sm_count=132, major=9, minor=0,
                              gdr_writes_ordering=ORDERING_OWNER, gdr_supported=1,
                              dmabuf_supported=1, can_map_host=1)
        self.rdma_device = True
        self.queried: list[int] = []
        self.loaded: list[Path] = []
        peermem = tmp_path / "nvidia_peermem"
        self.peermem = peermem
        monkeypatch.setattr(registration, "PEERMEM_MODULE", peermem)
        monkeypatch.setattr(compat, "available", lambda: True)  # pyverbs, with DmaBufMR
        monkeypatch.setattr(compat, "module", lambda name: stand_in(name, DmaBufMR=object))
        monkeypatch.setattr(region_mod, "resolve", self._resolve)
        monkeypatch.setattr(SchedulerLibrary, "load", classmethod(self._load))

    def _resolve(self, device: str | None, ip: str | None) -> GidEntry:
        if not self.rdma_device:
            raise StartupError("no RDMA device with a RoCE v2 GID; see deploy/softroce/")
        return cast(GidEntry, object())

    def _load(self, cls: type[SchedulerLibrary], path: Path) -> SchedulerLibrary:
        self.loaded.append(path)
        machine = self

        class Lib:
            @staticmethod
            def dpuf_model_device_info_get(device: int, out: Any) -> int:
                machine.queried.append(device)
                ctypes.memmove(out, ctypes.byref(machine.gpu), ctypes.sizeof(DeviceInfo))
                return 0

        return cls(cast(ctypes.CDLL, Lib()), path)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Machine:
    return Machine(monkeypatch, tmp_path)


def start(model_peer: ModuleType, transport: str, tmp_path: Path) -> None:
    options = ModelPeerOptions(runner=RunnerOptions(device=1), scheduler="gpu",
                               scheduler_library=tmp_path / "libdpuf_sched.so")
    peer = PeerConfig(transport=transport, shm_path=tmp_path / "region")
    asyncio.run(model_peer.run_model_peer(peer, options))


def no_rdma_device(m: Machine) -> None:
    m.rdma_device = False


def no_gpudirect(m: Machine) -> None:
    m.gpu.gdr_supported = 0


def unordered_writes(m: Machine) -> None:
    m.gpu.gdr_writes_ordering = 0


def no_dmabuf_no_peermem(m: Machine) -> None:
    m.gpu.dmabuf_supported = 0


@pytest.mark.parametrize(("lacking", "message"), [
    (no_rdma_device, "no RDMA device"),
    (no_gpudirect, "does not support GPUDirect RDMA"),
    (unordered_writes, "does not order GPUDirect RDMA writes"),
    (no_dmabuf_no_peermem, r"cannot register GPU memory for RDMA: NVIDIA H100 80GB HBM3 "
                           r"exports no dma-buf .* nvidia_peermem module is not loaded"),
], ids=lambda v: getattr(v, "__name__", None))
def test_verbs_refuses_before_the_model_loads(model_peer: ModuleType, machine: Machine,
                                              tmp_path: Path, lacking: Any,
                                              message: str) -> None:
    lacking(machine)
    with pytest.raises(StartupError, match=message):
        start(model_peer, "verbs", tmp_path)


@pytest.mark.parametrize("registration_way", ["dma-buf", "nvidia-peermem"])
def test_verbs_goes_on_to_the_model_where_gpu_memory_can_be_registered(
        model_peer: ModuleType, machine: Machine, tmp_path: Path, registration_way: str) -> None:
    """No refusal for the transport's sake: the model loads next, then the region goes
    into GPU memory (the kernel's open) and is registered (the control plane)."""
    if registration_way == "nvidia-peermem":
        machine.gpu.dmabuf_supported = 0
        machine.peermem.mkdir()
    with pytest.raises(ModelLoaded):
        start(model_peer, "verbs", tmp_path)
    assert machine.loaded == [tmp_path / "libdpuf_sched.so"] and machine.queried == [1]


def test_shm_needs_no_gpudirect(model_peer: ModuleType, machine: Machine,
                                tmp_path: Path) -> None:
    """The GPU machine's mode: host memory mapped into the GPU, no NIC."""
    machine.rdma_device = False
    machine.gpu.gdr_supported = machine.gpu.dmabuf_supported = 0
    with pytest.raises(ModelLoaded):
        start(model_peer, "shm", tmp_path)
    assert machine.queried == [1]  # the library loads (and answers) before the model
