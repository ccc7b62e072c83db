"""The systemd notification protocol: a few lines over the ``NOTIFY_SOCKET`` datagram socket.

``READY=1`` once the peers are connected and HTTP listens, ``STOPPING=1``
when the drain starts, and ``WATCHDOG=1`` from a task of the event loop
itself every half ``WatchdogSec``: a stuck loop stops the pings and systemd
restarts the service. Without ``NOTIFY_SOCKET`` (not under systemd) every
call is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("dpu_frontend.systemd")


class Notifier:
    def __init__(self, address: str | None, watchdog_s: float | None) -> None:
        self.address = address
        self.watchdog_s = watchdog_s

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> Notifier:
        address = env.get("NOTIFY_SOCKET") or None
        if address and address.startswith("@"):  # an abstract socket
            address = "\0" + address[1:]
        watchdog_s = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            watchdog_s = int(usec) / 1e6
        return cls(address, watchdog_s)

    def notify(self, *states: str) -> None:
        if self.address is None:
            return
        message = "\n".join(states).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            try:
                sock.sendto(message, self.address)
            except OSError as exc:
                log.warning("sd_notify %s failed: %s", states, exc)

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    async def watchdog(self) -> None:
        """Ping at half the watchdog interval, from the event loop, until cancelled."""
        if self.address is None or self.watchdog_s is None:
            return
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s / 2)
