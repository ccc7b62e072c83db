"""Registering a GPU-memory region for RDMA, and the preconditions it must meet.

Either persistent kernel's region (the CUDA peer's, the GPU scheduler's) goes
the same way, through its library's ``PersistentLibrary`` API. Two ways to let
a NIC reach ``cudaMalloc`` memory:

* **dma-buf** (preferred, upstream kernels): the CUDA driver exports the
  range as a dma-buf fd (``cuMemGetHandleForAddressRange``), registered with
  ``ibv_reg_dmabuf_mr`` (pyverbs ``DmaBufMR``, as rdma-core's
  ``tests/test_cuda_dmabuf.py`` does). pyverbs registers it with
  ``iova = offset``, so the daemon names the region from address 0.
* **nvidia-peermem**: the kernel module lets plain ``ibv_reg_mr`` take the GPU
  virtual address.

Before either, the device must order GPUDirect RDMA writes for its own
threads (``CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`` at least
OWNER): the kernel trusts a record body once it has seen the commit word
written after it, and on a device without that ordering it would need a
``cuFlushGPUDirectRDMAWrites`` from the host between the two, which a
CPU-free design cannot afford. The MR is registered without relaxed
ordering (``resources._access``), and the region has ``SYNC_MEMOPS`` set
(``cuda_driver.cuh``). docs/protocol.md, "Preconditions", lists them.

``check_device`` and ``check_registrable`` need only the device query: the
model peer runs them before its model loads, so that a machine where neither
way exists refuses in seconds, not after minutes of loading.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu.library import DeviceInfo, PersistentLibrary
from dpu_frontend.transport.verbs import compat
from dpu_frontend.transport.verbs.resources import RdmaResources, access_flags

#: CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER: the device's own threads see the
#: NIC's writes in order.
WRITES_ORDERING_OWNER = 100
PEERMEM_MODULE = Path("/sys/module/nvidia_peermem")


def check_device(info: DeviceInfo) -> None:
    """Refuse a device the protocol's ordering rules cannot hold on."""
    name = info.name.decode(errors="replace")
    if not info.gdr_supported:
        raise StartupError(f"{name} does not support GPUDirect RDMA: the NIC cannot write its "
                           "memory (use --transport shm on a host without a NIC)")
    if info.gdr_writes_ordering < WRITES_ORDERING_OWNER:
        raise StartupError(
            f"{name} does not order GPUDirect RDMA writes for its own threads "
            f"(GPU_DIRECT_RDMA_WRITES_ORDERING = {info.gdr_writes_ordering}, needs >= "
            f"{WRITES_ORDERING_OWNER}): the kernel could see a commit word before the record")


def check_registrable(info: DeviceInfo) -> None:
    """Refuse a machine where GPU memory cannot be registered at all: the device exports
    no dma-buf (or pyverbs cannot register one) and nvidia-peermem is not loaded.
    ``register_gpu_region`` may still fail later (an export the driver then refuses);
    this is what can be known before anything is allocated."""
    pyverbs_dmabuf = compat.available() and hasattr(compat.module("mr"), "DmaBufMR")
    if (info.dmabuf_supported and pyverbs_dmabuf) or PEERMEM_MODULE.exists():
        return
    name = info.name.decode(errors="replace")
    dmabuf = (f"{name} exports no dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0)"
              if not info.dmabuf_supported else "this pyverbs cannot register a dma-buf "
              "(no DmaBufMR: an older rdma-core)")
    raise StartupError(f"cannot register GPU memory for RDMA: {dmabuf}; and the nvidia_peermem "
                       "module is not loaded (modprobe nvidia_peermem)")


def register_gpu_region(lib: PersistentLibrary, handle: int, resources: RdmaResources,
                        size: int) -> tuple[Any, int]:
    """The MR of the GPU region of ``lib``'s ``handle`` (either persistent kernel's
    library) and the address the daemon names it by: dma-buf first, nvidia-peermem
    where there is no dma-buf or its registration fails."""
    access = access_flags(remote=True)
    try:
        fd, offset = lib.dmabuf_fd(handle)
    except StartupError as exc:
        dmabuf_error = str(exc)
    else:
        try:
            mr = compat.module("mr").DmaBufMR(resources.pd, size, access, dmabuf=fd,
                                              offset=offset)
            return resources.keep(mr), offset  # pyverbs registers iova = offset
        except (compat.module("errors").PyverbsError, TypeError) as exc:
            dmabuf_error = f"dma-buf registration failed: {exc}"
        finally:
            os.close(fd)  # the MR holds its own reference to the dma-buf
    if not PEERMEM_MODULE.exists():
        raise StartupError(f"cannot register GPU memory for RDMA: {dmabuf_error}; and the "
                           "nvidia_peermem module is not loaded (modprobe nvidia_peermem)")
    address = lib.region_device_ptr(handle)
    try:
        mr = compat.module("mr").MR(resources.pd, size, access, address=address)
        return resources.keep(mr), address
    except compat.module("errors").PyverbsError as exc:
        raise StartupError(f"nvidia-peermem registration of {size} bytes of GPU memory "
                           f"failed: {exc} ({dmabuf_error})") from exc
