"""The host side of a persistent CUDA kernel, behind the peer's control plane.

Both GPU kernels are driven the same way (docs/gpu.md): the launcher loads
their library, makes the region and the mailbox area, writes the layout
record, launches once, waits for the kernel to say RUNNING, and from then on
only reads the mailbox's counters and watches for a failure; a stop request
and the library's destroy end it. ``PersistentKernel`` does all of that once.
The CUDA peer (``gpu/launcher.py``, ``CudaKernel``) and the scheduler inside
the GPU (``model/gpu_scheduler.py``, ``GpuSchedulerKernel``) subclass it and
differ only where they must: the library they load, the parameters they create
it with, what they add once it exists (the scheduler's step graphs), and how
they read its end.

Where the region lives is the transport's decision (``peer/region.py``): the
shm transport's file, mapped into the GPU by the library; or, for a NIC, GPU
memory that the library allocates and ``gpu/registration.py`` registers
(dma-buf or nvidia-peermem), after the device's GPUDirect RDMA checks
(``check_region``, which the model peer also runs before its model loads).
"""

from __future__ import annotations

import abc
import asyncio
import ctypes
import logging
import mmap
from typing import Any, ClassVar, Generic, TypeVar

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu import registration
from dpu_frontend.gpu.library import DeviceInfo, PersistentLibrary
from dpu_frontend.peer.kernel import PeerKernel
from dpu_frontend.peer.region import Region, RegionAddress
from dpu_frontend.ring import Layout
from dpu_frontend.ring.mailbox import KERNEL_BLOCK, KernelState, mailbox_area_size
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.transport.verbs.resources import RdmaResources

log = logging.getLogger("dpu_frontend.gpu")

LibraryT = TypeVar("LibraryT", bound=PersistentLibrary)

#: How long ``close`` waits for the kernels to return after the stop request.
STOP_TIMEOUT_MS = 5000
#: How long ``start`` waits for RUNNING: every block of the kernel resident.
START_TIMEOUT_S = 10.0
START_POLL_S = 0.001


def describe(device: int, info: DeviceInfo) -> str:
    return (f"GPU {device}: {info.name.decode(errors='replace')}, {info.sm_count} SMs, "
            f"sm_{info.major}{info.minor}, GPUDirect RDMA {'yes' if info.gdr_supported else 'no'} "
            f"(writes ordering {info.gdr_writes_ordering}), dma-buf "
            f"{'yes' if info.dmabuf_supported else 'no'}")


def check_region(region: Region, library: PersistentLibrary, device: int) -> DeviceInfo:
    """Refuse, with the reason and before anything is allocated, a machine this
    transport's region cannot work on: the transport's own needs (an RDMA device) and,
    for a region in GPU memory, the device's GPUDirect RDMA and its write ordering, and
    a way to register the memory (dma-buf or nvidia-peermem). Cheap, nothing allocated:
    the model peer runs it before its model loads."""
    region.check()
    info = library.device_info(device)
    if region.gpu_memory:
        registration.check_device(info)
        registration.check_registrable(info)
    return info


class PersistentKernel(PeerKernel, Generic[LibraryT]):
    """A persistent kernel's library behind the ``PeerKernel`` interface."""

    #: What the messages call the kernel ("the persistent kernel", "the GPU scheduler").
    what: ClassVar[str]

    def __init__(self, device: int) -> None:
        self.device = device
        self._lib: LibraryT | None = None
        self._handle: int | None = None
        self._map: mmap.mmap | None = None
        self._mailbox: AtomicMemory | None = None
        self._mailbox_buffer: Any = None
        self._keep: list[Any] = []  # what the library reads during create, and the map's anchor
        self._failure: str | None = None

    # -- what a subclass says -------------------------------------------------

    @abc.abstractmethod
    def _load_library(self) -> LibraryT:
        """Build (or take the prebuilt) library and load it."""

    @abc.abstractmethod
    def _params(self, layout: Layout, region_host: int | None) -> ctypes.Structure:
        """The create parameters. ``region_host``: the host mapping to map into the GPU,
        or None: the library allocates the region in GPU memory. Whatever the library
        reads during create goes into ``self._keep``."""

    def _created(self, lib: LibraryT, handle: int, layout: Layout) -> None:
        """What the kernel adds once the library made it, before the layout record."""

    def _returned(self) -> str:
        """Why the kernels returned without a fault (the poll said 0)."""
        return f"{self.what} returned"

    def _running(self) -> None:
        """The kernel said RUNNING."""

    # -- the PeerKernel interface ---------------------------------------------

    def library(self) -> LibraryT:
        if self._lib is None:
            self._lib = self._load_library()
        return self._lib

    def open(self, layout: Layout, region: Region) -> RegionAddress:
        lib = self.library()
        info = check_region(region, lib, self.device)  # refuse before allocating anything
        log.info("%s", describe(self.device, info))
        region_host = None
        self._map = region.kernel_memory(layout.region_size)
        if self._map is not None:  # host memory, which the library maps into the GPU
            anchor = ctypes.c_char.from_buffer(self._map)
            self._keep.append(anchor)
            region_host = ctypes.addressof(anchor)
        handle = lib.create(self._params(layout, region_host))
        if not handle:
            raise StartupError(f"cannot create {self.what}: {lib.error()}")
        self._handle = handle
        self._created(lib, handle, layout)
        header = layout.encode()
        lib.check(lib.write_region(handle, 0, header), "writing the layout record")
        size = mailbox_area_size(len(layout.channels))
        self._mailbox_buffer = (ctypes.c_char * size).from_address(lib.mailbox(handle))
        self._mailbox = AtomicMemory(self._mailbox_buffer)
        return RegionAddress()  # registered by the library's handle, not an address

    def register(self, resources: RdmaResources, region: RegionAddress,
                 size: int) -> tuple[Any, int]:
        return registration.register_gpu_region(self.library(), self.handle(), resources, size)

    @property
    def mailbox(self) -> AtomicMemory:
        if self._mailbox is None:
            raise RuntimeError("kernel not opened")
        return self._mailbox

    def handle(self) -> int:
        if self._handle is None:
            raise RuntimeError("kernel not opened")
        return self._handle

    async def start(self) -> None:
        lib, handle = self.library(), self.handle()
        lib.check(lib.launch(handle), f"launching {self.what}")
        for _ in range(int(START_TIMEOUT_S / START_POLL_S)):
            if self.mailbox.load_acquire(KERNEL_BLOCK.offset("state")) == KernelState.RUNNING:
                self._running()
                return
            if self.failure() is not None:
                break
            await asyncio.sleep(START_POLL_S)
        raise StartupError(f"{self.what} did not start: {self.failure() or 'timeout'}")

    def failure(self) -> str | None:
        if self._failure is None and self._handle is not None and self._lib is not None:
            rc = self._lib.poll(self._handle)
            if rc == 0:
                self._failure = self._returned()
            elif rc < 0:
                self._failure = f"{self.what} failed: {self._lib.error()}"
        return self._failure

    def channel_stats(self, channel: int) -> dict[str, Any]:
        block = self.mailbox
        return {"kernel_steps": block.load_acquire(KERNEL_BLOCK.offset("steps")),
                "kernel_heartbeats": block.load_acquire(KERNEL_BLOCK.offset("heartbeats"))}

    async def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the kernels, free what the library holds, unmap the region (blocks up to
        ``STOP_TIMEOUT_MS``: the library waits for the kernels); idempotent."""
        lib, handle = self._lib, self._handle
        if handle is not None and lib is not None:
            if lib.stop(handle, STOP_TIMEOUT_MS) != 0:
                # destroy leaves the kernels' memory to them; so is the region they map:
                # unmapping it under a running kernel would pull it from under it.
                log.error("%s did not stop: %s; its region stays mapped", self.what, lib.error())
                self._handle = None
                return
            if self._mailbox is not None:
                self._mailbox.release()  # the pinned area goes with the library's handle
            self._mailbox = self._mailbox_buffer = None
            lib.destroy(handle)
            self._handle = None
        self._keep.clear()  # the map's anchor first: an exported buffer cannot be closed
        if self._map is not None:
            self._map.close()  # the provider removes what is left (the shm file)
            self._map = None
