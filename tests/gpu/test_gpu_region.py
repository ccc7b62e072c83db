"""The persistent kernels' libraries on a GPU without a NIC: the device query of both, and
the ring region in GPU memory (what ``--transport verbs`` allocates) of the CUDA peer and
of the scheduler inside the GPU, which no end-to-end test reaches on a machine without
an RDMA device.

The region's registration for a NIC is not tested here (no NIC): only that the library
allocates it, writes the layout record into it, runs the kernels over it, and gives its
device address and (where the driver can) a dma-buf of it. The test stands in for the
NIC: it copies what the DPU would RDMA-WRITE into the region with the library's own
write (``cudaMemcpy``), and reads what the DPU would RDMA-READ with CuPy's.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import secrets
import time
from typing import Any, cast

import cupy
import pytest

from dpu_frontend.config import RdmaConfig
from dpu_frontend.errors import StartupError
from dpu_frontend.gpu import persistent
from dpu_frontend.gpu.launcher import CudaKernel
from dpu_frontend.gpu.library import DeviceInfo, PersistentLibrary
from dpu_frontend.gpu.options import GPU_GEOMETRY, GpuPeerConfig
from dpu_frontend.gpu.persistent import PersistentKernel
from dpu_frontend.gpu.runtime import PEER_SOURCES, PeerLibrary, build
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.device import SCHEDULER
from dpu_frontend.model.device.sched_core import SchedulerLibrary
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.model.gpu_scheduler import GpuSchedulerKernel, sampler_reserve
from dpu_frontend.model.options import RunnerOptions
from dpu_frontend.model.runner import ModelRunner
from dpu_frontend.peer.region import Region, VerbsRegion
from dpu_frontend.ring import DpuChannel, Geometry, Layout, ResponseRecord, SamplingParams
from dpu_frontend.ring.layout import GPU_CTRL_STRUCT
from dpu_frontend.ring.mailbox import ChannelState, Command, HostMailbox, MailboxError

pytestmark = pytest.mark.gpu

CONFIG = GpuPeerConfig()  # sm_90, the default build directory
SEED = 20261127
#: The host-driven engine's sizes (conftest's ``offline``, on the scheduler's weights).
OFFLINE = {"num_blocks": 128, "max_seqs": 16, "max_model_len": 512}


class GpuMemory(VerbsRegion):
    """Verbs' region without its NIC: GPU memory for a kernel on the GPU, nothing opened."""

    def check(self) -> None:
        return


def device_only(region: Region, library: PersistentLibrary, device: int) -> DeviceInfo:
    """``check_region`` without this machine's GPUDirect and dma-buf (it has no NIC)."""
    return library.device_info(device)


def region_bytes(kernel: PersistentKernel[Any], offset: int, n: int) -> bytes:
    """``n`` bytes of a kernel's GPU region from ``offset``, as an RDMA READ would fetch
    them. The copy is on the legacy stream, which does not wait for the kernels' own."""
    out = (ctypes.c_char * n)()
    device = kernel.library().region_device_ptr(kernel.handle())
    cupy.cuda.runtime.memcpy(ctypes.addressof(out), device + offset, n,
                             cupy.cuda.runtime.memcpyDeviceToHost)
    return bytes(out)


def gpu_ctrl(kernel: PersistentKernel[Any], layout: Layout, channel: int) -> dict[str, int]:
    """Channel ``channel``'s GPU control block, read back from the region."""
    ctrl = region_bytes(kernel, layout.channels[channel].gpu_ctrl_offset, GPU_CTRL_STRUCT.size)
    names = [name for name, _ in GPU_CTRL_STRUCT.fields]
    return {n: cast(int, v) for n, v in zip(names, GPU_CTRL_STRUCT.unpack_from(ctrl), strict=True)}


async def attach(kernel: PersistentKernel[Any], epoch: int) -> None:
    """ATTACH channel 0 in ``epoch`` through the mailbox, as the control plane does."""
    mailbox = HostMailbox(kernel.mailbox, 0)
    seq = mailbox.post(Command.ATTACH, epoch)
    async with asyncio.timeout(10):
        while (ack := mailbox.acked(seq)) is None:  # noqa: ASYNC110 - the GPU writes it
            await asyncio.sleep(0.001)
    assert (ack.state, ack.error) == (ChannelState.ATTACHED, MailboxError.OK)


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
    monkeypatch.setattr(persistent, "check_region", device_only)
    kernel = CudaKernel(CONFIG, [[5, 6, 7, 8]], (0,), vocab_size=151_936)
    layout = GPU_GEOMETRY.plan(instance=secrets.randbits(63) | 1)
    kernel.open(layout, GpuMemory(RdmaConfig()))
    try:
        lib, handle = kernel.library(), kernel.handle()
        assert lib.region_device_ptr(handle) != 0
        header = layout.encode()
        assert region_bytes(kernel, 0, len(header)) == header
        try:
            fd, offset = lib.dmabuf_fd(handle)
        except StartupError as exc:
            print(f"no dma-buf on this machine: {exc}")
        else:
            assert fd >= 0 and offset == 0
            os.close(fd)
        await kernel.start()
        await attach(kernel, 1)
        ctrl = gpu_ctrl(kernel, layout, 0)
        assert (ctrl["epoch"], ctrl["resp_produced"], ctrl["req_consumed"]) == (1, 0, 0)
        beats = kernel.channel_stats(0)["kernel_heartbeats"]
        await asyncio.sleep(0.05)
        assert kernel.channel_stats(0)["kernel_heartbeats"] > beats
        assert gpu_ctrl(kernel, layout, 0)["heartbeat"] > ctrl["heartbeat"]  # beaten in GPU memory
        assert kernel.failure() is None
    finally:
        await kernel.close()  # stop, then destroy: the region freed once the kernels returned
    assert "did not stop" not in caplog.text


async def test_the_gpu_scheduler_serves_from_a_region_in_gpu_memory(
        monkeypatch: pytest.MonkeyPatch, offline: ModelEngine) -> None:
    """``--scheduler gpu --transport verbs`` short of the NIC: the scheduler's library
    allocates the region in GPU memory and copies the layout record there, an ATTACH
    resets the channel there, and a request written there as a NIC's RDMA WRITEs would
    land (prompt, then commit word) is answered there: the records, read back as a DPU's
    READs would fetch them, carry the host engine's tokens."""
    monkeypatch.setattr(persistent, "check_region", device_only)
    runner = ModelRunner(ModelConfig.default(), RunnerOptions(
        weight_seed=SEED, num_blocks=64, max_seqs=16, max_model_len=512,
        vocab_limit=offline.runner.options.vocab_limit))
    runner.load(keep_graphs=True, reserve=sampler_reserve(runner))
    library = SchedulerLibrary.load(build(CONFIG.build_dir, SCHEDULER, arch=CONFIG.cuda_arch))
    kernel = GpuSchedulerKernel(runner, runner.config.eos_token_ids, library, max_batched_tokens=256)
    kernel.capture()
    layout = Geometry().plan(instance=secrets.randbits(63) | 1)
    kernel.open(layout, GpuMemory(RdmaConfig()))
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    records: list[ResponseRecord] = []
    try:
        header = layout.encode()
        assert region_bytes(kernel, 0, len(header)) == header
        await kernel.start()
        await attach(kernel, 7)
        assert gpu_ctrl(kernel, layout, 0)["epoch"] == 7
        dpu = DpuChannel(layout.channels[0], 7)
        dpu.submit(1, [41, 42, 43, 44], params)
        async with asyncio.timeout(60):
            while not any(r.final for r in records):
                poll = dpu.begin_poll()
                for write in poll.writes:  # in order: the commit word last
                    kernel.library().check(kernel.library().write_region(
                        kernel.handle(), write.offset, bytes(write.data)), "an RDMA WRITE's stand-in")
                found, more = dpu.end_poll(poll, [region_bytes(kernel, read.offset, read.length)
                                                  for read in poll.reads], time.monotonic())
                for read in more:
                    found += dpu.on_records(read, region_bytes(kernel, read.offset, read.length))
                records += found
                await asyncio.sleep(0.001)
        assert kernel.failure() is None
    finally:
        await kernel.close()
        del kernel, runner
    want = offline.generate([[41, 42, 43, 44]], [params])[0].tokens
    assert [t for r in records for t in r.tokens] == want and len(want) == 12
    print(f"the GPU scheduler served {len(records)} records from a region in GPU memory, "
          "the host engine's tokens")
