"""What serves the rings behind a peer's control plane: the reference token generator or the
CUDA kernel.

A ``PeerKernel`` owns the region (the memory the daemon READs and WRITEs), which
it takes where the transport's provider says (``peer/region.py``), and the
mailbox area (host memory only the launcher and the kernel touch). The control
plane (``peer/server.py``) never touches a ring: it attaches and detaches
channels by mailbox commands (``ring/mailbox.py``) and reads the kernel's
counters, exactly as a launcher drives a persistent GPU kernel.
"""

from __future__ import annotations

import abc
from typing import Any

from dpu_frontend.peer.region import Region, RegionAddress
from dpu_frontend.ring import Layout
from dpu_frontend.ring.gpu import RingMemory
from dpu_frontend.transport.verbs.resources import RdmaResources


class PeerKernel(abc.ABC):
    """The GPU half of every channel, behind one mailbox area.

    A kernel that stops serving one channel on its own stores DETACHED in its
    mailbox (``KernelMailbox.detached``); one that stops serving at all says
    why in ``failure``. Either way the control plane closes the control
    connections concerned at once (docs/protocol.md, section 8).
    """

    @abc.abstractmethod
    def open(self, layout: Layout, region: Region) -> RegionAddress:
        """Take the region's memory from ``region`` (the transport's provider), allocate the
        mailbox area, write the layout record at offset 0."""

    @property
    @abc.abstractmethod
    def mailbox(self) -> RingMemory:
        """The mailbox area: one kernel block, then one mailbox per channel."""

    def register(self, resources: RdmaResources, region: RegionAddress,
                 size: int) -> tuple[Any, int]:
        """Register the region for remote READ and WRITE (verbs); return the MR and the
        address the daemon's operations name. This one registers host memory; a kernel
        whose region is GPU memory overrides it."""
        if not region.host_address:
            raise ValueError("the region has no host mapping to register")
        return resources.register(region.host_address, size, remote=True), region.host_address

    @abc.abstractmethod
    async def start(self) -> None:
        """Start serving (launch the kernel, or the engine loop)."""

    @abc.abstractmethod
    def failure(self) -> str | None:
        """Why the kernel stopped serving, or None while it runs. Each control session
        polls it every few milliseconds (``server.KERNEL_WATCH_S``): it must be cheap."""

    def kernel_stats(self) -> dict[str, Any]:
        """Counters of the kernel as a whole (the model engine's); none by default."""
        return {}

    @abc.abstractmethod
    def channel_stats(self, channel: int) -> dict[str, Any]:
        """Counters beyond the mailbox's (the reference generator's request ids, ...)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop the kernel and release the region; idempotent."""
