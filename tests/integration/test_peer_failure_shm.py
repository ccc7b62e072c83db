"""A GPU peer that dies ends every affected request explicitly (shm transport)."""

from __future__ import annotations

from tests.integration.scenarios import check_peer_killed_mid_stream
from tests.stack import running_stack


async def test_peer_killed_mid_stream() -> None:
    with running_stack("shm", tokens_per_s=20, timeout=60) as stack:
        await check_peer_killed_mid_stream(stack)
