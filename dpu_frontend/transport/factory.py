"""The transport a configuration asks for, before the handshake.

The session calls this and then only the ``Transport`` interface: whether
bytes move by RDMA or by copies into a shared mapping is decided here, once.
"""

from __future__ import annotations

from dpu_frontend.config import ServeConfig
from dpu_frontend.ring.layout import HEADER_SIZE
from dpu_frontend.transport.base import Transport
from dpu_frontend.transport.shm import ShmTransport
from dpu_frontend.transport.verbs.transport import VerbsTransport


def open_transport(config: ServeConfig) -> Transport:
    """A transport for one session: verbs opens the RDMA device now (its staging
    buffer starts at the size of the layout header, the first thing read)."""
    if config.transport == "verbs":
        return VerbsTransport.open(config.rdma, staging_bytes=HEADER_SIZE)
    return ShmTransport()
