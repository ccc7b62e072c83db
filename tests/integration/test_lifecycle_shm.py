"""The outer ring of the request lifecycle: real processes over shm, real signals.

The behaviours themselves (cancel on disconnect, overload, drain and its
timeout, two peers, reconnect with a new layout) are tested in memory in
``tests/engine/`` and ``tests/http/``; what only processes can show stays
here: a peer killed with SIGKILL and restarted, and a daemon that drains on
SIGTERM and exits 0. ``tests/rdma/`` runs the transport-dependent cases over
verbs.
"""

from __future__ import annotations

from tests.integration import lifecycle
from tests.stack import running_stack


async def test_fault_and_reconnect() -> None:
    with running_stack("shm", tokens_per_s=20, timeout=60) as s:
        await lifecycle.check_fault_and_reconnect(s)


async def test_drain_lets_streams_finish() -> None:
    with running_stack("shm", tokens_per_s=50, timeout=60) as s:
        await lifecycle.check_drain(s)
