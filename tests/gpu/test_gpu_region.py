"""The persistent kernels' libraries on a GPU without a NIC: the device query of both, and
the CUDA peer's ring region in GPU memory (what ``--transport verbs`` allocates), which
no end-to-end test reaches on a machine without an RDMA device.

The region's registration for a NIC is not tested here (no NIC): only that the library
allocates it, writes the layout record into it, runs the kernel over it, and gives its
device address and (where the driver can) a dma-buf of it.
"""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest

from dpu_frontend.config import RdmaConfig
from dpu_frontend.errors import StartupError
from dpu_frontend.gpu import persistent
from dpu_frontend.gpu.launcher import CudaKernel
from dpu_frontend.gpu.library import DeviceInfo, PersistentLibrary
from dpu_frontend.gpu.options import GPU_GEOMETRY, GpuPeerConfig
from dpu_frontend.gpu.runtime import PEER_SOURCES, PeerLibrary, build
from dpu_frontend.model.device import SCHEDULER
from dpu_frontend.model.device.sched_core import SchedulerLibrary
from dpu_frontend.peer.region import Region, VerbsRegion
from dpu_frontend.ring.mailbox import ChannelState, Command, HostMailbox, MailboxError

pytestmark = pytest.mark.gpu

CONFIG = GpuPeerConfig()  # sm_90, the default build directory


class GpuMemory(VerbsRegion):
    """Verbs' region without its NIC: GPU memory for a kernel on the GPU, nothing opened."""

    def check(self) -> None:
        return


def test_both_libraries_query_the_device_alike() -> None:
    """The scheduler's device query (what the model peer asks before its model loads) is
    the CUDA peer's: the same answers."""
    peer = PeerLibrary.load(build(CONFIG.build_dir, PEER_SOURCES, arch=CONFIG.cuda_arch))
    sched = SchedulerLibrary.load(build(CONFIG.build_dir, SCHEDULER, arch=CONFIG.cuda_arch))
    infos: list[DeviceInfo] = [lib.device_info(0) for lib in (peer, sched)]
    assert infos[0].name and infos[0].sm_count > 0 and infos[0].major >= 8
    for name, _ in DeviceInfo._fields_:
        assert getattr(infos[0], name) == getattr(infos[1], name), name
    print(persistent.describe(0, infos[0]))


async def test_the_cuda_peer_serves_from_a_region_in_gpu_memory(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Allocated by the library (2 MiB pages, SYNC_MEMOPS), the layout record copied in,
    the kernels running over it: an ATTACH resets a channel's rings there, the heartbeat
    beats there; its device address and dma-buf are what a NIC would register."""

    def device_only(region: Region, library: PersistentLibrary, device: int) -> DeviceInfo:
        return library.device_info(device)  # this machine's GPUDirect and dma-buf aside

    monkeypatch.setattr(persistent, "check_region", device_only)
    kernel = CudaKernel(CONFIG, [[5, 6, 7, 8]], (0,))
    layout = GPU_GEOMETRY.plan(instance=secrets.randbits(63) | 1)
    kernel.open(layout, GpuMemory(RdmaConfig()))
    try:
        lib, handle = kernel.library(), kernel.handle()
        assert lib.region_device_ptr(handle) != 0
        try:
            fd, offset = lib.dmabuf_fd(handle)
        except StartupError as exc:
            print(f"no dma-buf on this machine: {exc}")
        else:
            assert fd >= 0 and offset == 0
            os.close(fd)
        await kernel.start()
        mailbox = HostMailbox(kernel.mailbox, 0)
        seq = mailbox.post(Command.ATTACH, 1)
        async with asyncio.timeout(10):
            while (ack := mailbox.acked(seq)) is None:  # noqa: ASYNC110 - the GPU writes it
                await asyncio.sleep(0.001)
        assert (ack.state, ack.error) == (ChannelState.ATTACHED, MailboxError.OK)
        beats = kernel.channel_stats(0)["kernel_heartbeats"]
        await asyncio.sleep(0.05)
        assert kernel.channel_stats(0)["kernel_heartbeats"] > beats
        assert kernel.failure() is None
    finally:
        await kernel.close()  # stop, then destroy: the region freed once the kernels returned
    assert "did not stop" not in caplog.text
