"""The walking skeleton end to end over the shm transport, natively."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.scenarios import check_stream_equals_full_and_decode
from tests.stack import Stack, running_stack


@pytest.fixture(scope="module")
def shm_stack() -> Iterator[Stack]:
    with running_stack("shm", timeout=60) as stack:
        yield stack


async def test_streamed_equals_full_equals_decode(shm_stack: Stack) -> None:
    await check_stream_equals_full_and_decode(shm_stack)
