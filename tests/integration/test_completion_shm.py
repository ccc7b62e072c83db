"""The walking skeleton end to end over the shm transport, natively."""

from __future__ import annotations

from tests.integration.scenarios import check_stream_equals_full_and_decode
from tests.stack import Stack


async def test_streamed_equals_full_equals_decode(stack: Stack) -> None:
    await check_stream_equals_full_and_decode(stack)
