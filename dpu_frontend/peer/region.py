"""Where a peer's ring region lives and how a daemon reaches it: one provider per transport.

The transport decides both, and nothing else on the GPU side asks for its name.

``ShmRegion`` (development; the GPU machine, which has no NIC):

* a kernel the CPU runs (the reference peer, ``model-peer --scheduler host``)
  serves the shared-memory file; a kernel on the GPU (the CUDA peer,
  ``--scheduler gpu``) serves the same file, mapped into the GPU by its library;
* the welcome names the file; a session's end waits a grace period (there is
  no QP to destroy).

``VerbsRegion`` (the product):

* before anything slow: an RDMA device and pyverbs must be there;
* a kernel the CPU runs serves an anonymous mapping, registered as host
  memory; a kernel on the GPU serves GPU memory that its library allocates,
  registered through dma-buf or nvidia-peermem (``gpu/registration.py``);
* the welcome carries the MR's address and rkey, and a QP per channel; a
  session's end destroys its QP.

The control plane (``server.py``) owns the provider: it lends it to the kernel's
``open`` (the memory), then links each channel through it. The kernel frees the
memory it took; the provider what is left around it (the file, the MR).
"""

from __future__ import annotations

import abc
import asyncio
import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from dpu_frontend.config import PeerConfig, RdmaConfig
from dpu_frontend.errors import PeerError, StartupError
from dpu_frontend.transport.shm import map_file
from dpu_frontend.transport.verbs import compat
from dpu_frontend.transport.verbs.device import resolve
from dpu_frontend.transport.verbs.resources import QpInfo, RdmaResources

#: shm has no QP to destroy: after a session's control connection closes, the
#: channel waits this long before it can be attached again, so that a poll the
#: old daemon had under way cannot land in the next attachment.
SHM_DETACH_GRACE_S = 0.2


@dataclass(frozen=True, slots=True)
class RegionAddress:
    """Where a kernel put the region, for memory registration (verbs)."""

    host_address: int = 0  # a host mapping's virtual address (0: none, GPU memory)


class Registers(Protocol):
    """What registers the region for a NIC: the kernel, which knows where its memory is
    (``PeerKernel.register``)."""

    def register(self, resources: RdmaResources, region: RegionAddress,
                 size: int) -> tuple[Any, int]: ...


@dataclass(frozen=True, slots=True)
class Link:
    """One attachment's way in: what the welcome tells the daemon (``region``, and the
    peer's ``qp_info`` under verbs), and the QP that serves it."""

    region: dict[str, Any]
    qp_info: dict[str, Any] | None = None
    qp: Any = None


class Region(abc.ABC):
    """One transport's region: the kernel's memory, then each channel's link."""

    #: The transport's name (``PeerConfig.transport``).
    transport: ClassVar[str]
    #: Where a kernel on the GPU keeps the region: True, GPU memory (its library
    #: allocates it, a NIC registers it); False, host memory mapped into the GPU.
    gpu_memory: ClassVar[bool]

    @classmethod
    @abc.abstractmethod
    def for_peer(cls, config: PeerConfig) -> Region:
        """The provider of ``config`` (no side effect: nothing is opened yet)."""

    def check(self) -> None:
        """Refuse now what ``open`` would refuse on this machine, before anything slow
        (a model's load) has run."""
        return  # nothing to check by default

    # -- the kernel's memory ------------------------------------------------------

    @abc.abstractmethod
    def host_memory(self, size: int) -> mmap.mmap:
        """The region in host memory, for a kernel the CPU runs. The kernel closes it."""

    def kernel_memory(self, size: int) -> mmap.mmap | None:
        """For a kernel on the GPU: host memory to map into it, or None: GPU memory,
        which the kernel's library allocates."""
        return None if self.gpu_memory else self.host_memory(size)

    # -- the control plane --------------------------------------------------------

    def open(self, kernel: Registers, address: RegionAddress, size: int) -> None:
        """The kernel has the region: make it reachable."""
        return  # reachable as it is by default

    @abc.abstractmethod
    def link(self, qp: Mapping[str, Any] | None) -> Link:
        """A channel attached: how the daemon, whose hello described ``qp``, reaches it."""

    @abc.abstractmethod
    async def unlink(self, link: Link) -> None:
        """The session ended: once this returns, nothing it sent can land in the region
        (the next ATTACH's reset is final)."""

    def close(self) -> None:
        """Before the kernel frees its memory: what made it reachable."""
        return  # nothing by default

    def release(self) -> None:
        """After the kernel freed its memory: what is left of the region."""
        return  # nothing by default


class ShmRegion(Region):
    """The shm transport's file: the daemon on the same host maps it too."""

    transport = "shm"
    gpu_memory = False

    def __init__(self, path: Path) -> None:
        self.path = path
        self._created = False

    @classmethod
    def for_peer(cls, config: PeerConfig) -> ShmRegion:
        return cls(config.shm_path)

    def host_memory(self, size: int) -> mmap.mmap:
        self._created = True
        return map_file(str(self.path), size, create=True)

    def link(self, qp: Mapping[str, Any] | None) -> Link:
        return Link({"path": str(self.path)})

    async def unlink(self, link: Link) -> None:
        await asyncio.sleep(SHM_DETACH_GRACE_S)

    def release(self) -> None:
        if self._created:
            self.path.unlink(missing_ok=True)
            self._created = False


class VerbsRegion(Region):
    """Memory a NIC reaches with RDMA: the region registered once, a QP per channel."""

    transport = "verbs"
    gpu_memory = True

    def __init__(self, rdma: RdmaConfig) -> None:
        self.rdma = rdma
        self._resources: RdmaResources | None = None
        self._mr: Any = None
        self._remote_address = 0

    @classmethod
    def for_peer(cls, config: PeerConfig) -> VerbsRegion:
        return cls(config.rdma)

    @property
    def resources(self) -> RdmaResources | None:
        """The device, PD, the region's MR and the channels' QPs, once opened."""
        return self._resources

    def check(self) -> None:
        if not compat.available():
            raise StartupError(compat.IMPORT_ERROR or "pyverbs is not available")
        resolve(self.rdma.device, self.rdma.ip)  # StartupError: no such RDMA device

    def host_memory(self, size: int) -> mmap.mmap:
        return mmap.mmap(-1, size)

    def open(self, kernel: Registers, address: RegionAddress, size: int) -> None:
        self._resources = RdmaResources(self.rdma.device, self.rdma.ip)
        self._resources.open()
        self._mr, self._remote_address = kernel.register(self._resources, address, size)

    def link(self, qp: Mapping[str, Any] | None) -> Link:
        resources = self._resources
        if resources is None or qp is None:
            raise PeerError("verbs hello without a QP description")
        ours = resources.create_qp()
        try:
            local = resources.local_info(ours)
            resources.to_rts(ours, local, QpInfo.from_dict(qp))
        except BaseException:
            resources.destroy_qp(ours)
            raise
        return Link({"addr": self._remote_address, "rkey": self._mr.rkey}, local.to_dict(), ours)

    async def unlink(self, link: Link) -> None:
        if self._resources is not None:
            self._resources.destroy_qp(link.qp)

    def close(self) -> None:
        if self._resources is not None:
            self._resources.close()  # QPs and the region's MR before the memory goes
            self._resources = None


#: Each transport's provider, by the name the configuration gives.
PROVIDERS: dict[str, type[Region]] = {r.transport: r for r in (ShmRegion, VerbsRegion)}


def region_for(config: PeerConfig) -> Region:
    return PROVIDERS[config.transport].for_peer(config)
