"""Where a peer's region lives, per transport (``peer/region.py``): the memory each kind of
kernel gets, what the welcome says, and the refusals that come before anything slow."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dpu_frontend.config import TRANSPORTS, PeerConfig, RdmaConfig
from dpu_frontend.errors import PeerError, StartupError
from dpu_frontend.peer import region as region_mod
from dpu_frontend.peer.reference import ReferenceKernel
from dpu_frontend.peer.region import PROVIDERS, ShmRegion, VerbsRegion, region_for
from dpu_frontend.peer.server import PeerServer
from dpu_frontend.ring import Geometry
from dpu_frontend.transport.verbs import compat
from dpu_frontend.transport.verbs.device import GidEntry


def test_every_transport_has_a_provider() -> None:
    assert set(PROVIDERS) == set(TRANSPORTS)
    assert isinstance(region_for(PeerConfig(transport="shm")), ShmRegion)
    assert isinstance(region_for(PeerConfig(transport="verbs")), VerbsRegion)


def test_shm_serves_one_file_to_either_kernel_and_removes_it(tmp_path: Path) -> None:
    path = tmp_path / "region"
    region = ShmRegion(path)
    region.check()  # nothing to refuse
    for memory in (region.host_memory(4096), region.kernel_memory(4096)):
        assert memory is not None and len(memory) == 4096  # a GPU kernel maps the same file
        memory.close()
    assert region.link(None).region == {"path": str(path)}
    region.release()
    assert not path.exists()


def test_shm_leaves_a_file_it_did_not_create(tmp_path: Path) -> None:
    """A peer that failed before taking its memory must not remove another one's file."""
    path = tmp_path / "region"
    path.write_bytes(b"another peer's")
    ShmRegion(path).release()
    assert path.exists()


async def test_shm_waits_out_a_poll_under_way_at_a_sessions_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    monkeypatch.setattr(asyncio, "sleep", sleep)  # the module the provider calls
    region = ShmRegion(Path("/unused"))
    await region.unlink(region.link(None))
    assert slept == [region_mod.SHM_DETACH_GRACE_S]


def test_verbs_puts_a_gpu_kernels_region_in_gpu_memory() -> None:
    region = VerbsRegion(RdmaConfig())
    assert region.kernel_memory(4096) is None  # the kernel's library allocates it
    memory = region.host_memory(4096)  # a CPU kernel's: anonymous, registered as it is
    assert len(memory) == 4096
    memory.close()


def test_verbs_refuses_before_anything_slow_without_an_rdma_device(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(compat, "available", lambda: True)

    def no_device(device: str | None, ip: str | None) -> GidEntry:
        raise StartupError("no RDMA device with a RoCE v2 GID")

    monkeypatch.setattr(region_mod, "resolve", no_device)
    with pytest.raises(StartupError, match="no RDMA device"):
        VerbsRegion(RdmaConfig()).check()
    monkeypatch.setattr(compat, "available", lambda: False)
    with pytest.raises(StartupError, match="pyverbs"):
        VerbsRegion(RdmaConfig()).check()


def test_a_verbs_hello_needs_a_qp() -> None:
    with pytest.raises(PeerError, match="without a QP description"):
        VerbsRegion(RdmaConfig()).link(None)


async def test_the_peer_removes_its_shm_file_when_it_closes(tmp_path: Path) -> None:
    config = PeerConfig(transport="shm", port=0, shm_path=tmp_path / "region",
                        geometry=Geometry(max_sequences=4, resp_slots=8))
    peer = PeerServer(config, ReferenceKernel(config, [[5, 6, 7]], (0,)), {})
    await peer.start()
    try:
        assert peer.layout is not None
        assert config.shm_path.stat().st_size == peer.layout.region_size
    finally:
        await peer.close()
    assert not config.shm_path.exists()
