"""Process lifecycle shared by ``serve`` and the peers: signals, and the ready line."""

from __future__ import annotations

import asyncio
import signal

#: Each service prints one line on stdout once it listens: what the supervisor of
#: daemon workers, the harness, the tests and the benchmarks wait for.
PEER_READY = "peer listening on "
DAEMON_READY = "daemon listening on "


def announce_ready(marker: str, where: str) -> None:
    print(f"{marker}{where}", flush=True)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT: the loop's own handlers, no thread, no polling."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
