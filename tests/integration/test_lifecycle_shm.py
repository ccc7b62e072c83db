"""Request lifecycle under real conditions, natively over shm (real processes)."""

from __future__ import annotations

from tests.integration import lifecycle
from tests.stack import running_stack


async def test_disconnect_cancels_on_the_gpu() -> None:
    with running_stack("shm", tokens_per_s=20, timeout=60, peer_args=("--req-slots", "4")) as s:
        await lifecycle.check_disconnect_cancels_on_the_gpu(s)


async def test_fault_and_reconnect() -> None:
    with running_stack("shm", tokens_per_s=20, timeout=60) as s:
        await lifecycle.check_fault_and_reconnect(s)


async def test_two_peers() -> None:
    with running_stack("shm", tokens_per_s=200, timeout=60, peers=2) as s:
        await lifecycle.check_two_peers(s)


async def test_overload() -> None:
    # One request slot on the GPU side and a queue of two in front of it.
    with running_stack("shm", tokens_per_s=100, timeout=60, peer_args=("--req-slots", "1"),
                       serve_args=("--max-queued-requests", "2")) as s:
        await lifecycle.check_overload(s)


async def test_drain_lets_streams_finish() -> None:
    with running_stack("shm", tokens_per_s=50, timeout=60) as s:
        await lifecycle.check_drain(s)


async def test_drain_timeout_ends_streams_with_an_error() -> None:
    with running_stack("shm", tokens_per_s=20, timeout=60,
                       serve_args=("--drain-timeout", "0.5")) as s:
        await lifecycle.check_drain_timeout_ends_streams(s)
