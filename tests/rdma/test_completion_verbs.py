"""The walking skeleton end to end over real soft-RoCE: a peer and a daemon process on rxe0."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.scenarios import (
    check_chat_stream_sdk,
    check_peer_killed_mid_stream,
    check_stream_equals_full_and_decode,
)
from tests.stack import Stack, running_stack

pytestmark = pytest.mark.rdma


@pytest.fixture(scope="module")
def verbs_stack() -> Iterator[Stack]:
    with running_stack("verbs") as stack:
        yield stack


async def test_streamed_equals_full_equals_decode(verbs_stack: Stack) -> None:
    await check_stream_equals_full_and_decode(verbs_stack)


async def test_chat_stream_with_the_async_sdk(verbs_stack: Stack) -> None:
    await check_chat_stream_sdk(verbs_stack)


async def test_peer_killed_mid_stream() -> None:
    with running_stack("verbs", tokens_per_s=5) as stack:
        await check_peer_killed_mid_stream(stack)
