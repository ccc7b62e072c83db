"""The transport a configuration asks for, before the handshake.

The session calls this and then only the ``Transport`` interface: whether
bytes move by RDMA or by copies into a shared mapping is decided here, once,
from the transport's name (``check.py`` asks its class what it needs).
"""

from __future__ import annotations

from dpu_frontend.config import ServeConfig
from dpu_frontend.transport.base import Transport
from dpu_frontend.transport.shm import ShmTransport
from dpu_frontend.transport.verbs.transport import VerbsTransport

#: Each transport's class, by the name the configuration gives.
CLASSES: dict[str, type[Transport]] = {"verbs": VerbsTransport, "shm": ShmTransport}


def transport_class(config: ServeConfig) -> type[Transport]:
    return CLASSES[config.transport]


def open_transport(config: ServeConfig) -> Transport:
    """A transport for one session (verbs opens the RDMA device now)."""
    return transport_class(config).for_config(config)
