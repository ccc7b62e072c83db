"""The walking skeleton end to end over real soft-RoCE: a peer and a daemon process on rxe0."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpu_frontend.softroce.harness import RXE_IP
from tests.integration.scenarios import (
    check_chat_stream_sdk,
    check_constrained_sdk,
    check_peer_killed_mid_stream,
    check_stream_equals_full_and_decode,
)
from tests.rdma.test_check_verbs import check
from tests.stack import Stack, running_stack

pytestmark = pytest.mark.rdma


@pytest.fixture(scope="module")
def verbs_stack() -> Iterator[Stack]:
    # Two channels, the daemon on channel 0: the check below takes channel 1.
    with running_stack("verbs", serve_args=("--channel", "0"),
                       peer_args=("--channels", "2")) as stack:
        yield stack


async def test_streamed_equals_full_equals_decode(verbs_stack: Stack) -> None:
    await check_stream_equals_full_and_decode(verbs_stack)


async def test_chat_stream_with_the_async_sdk(verbs_stack: Stack) -> None:
    await check_chat_stream_sdk(verbs_stack)


async def test_a_constrained_answer(verbs_stack: Stack) -> None:
    """Structured output over soft-RoCE: a 3.2 MB automaton in one RDMA WRITE."""
    await check_constrained_sdk(verbs_stack)


def test_check_beside_a_serving_daemon_finds_a_good_deployment(verbs_stack: Stack) -> None:
    result = check("--rdma-ip", RXE_IP, "--peer", verbs_stack.peers[0].address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[ ok ] RDMA device rxe0: port 1 4: ACTIVE" in result.stdout
    assert f"[ ok ] will use rxe0 port 1 GID index 1 ({RXE_IP})" in result.stdout
    assert "[ ok ] RLIMIT_MEMLOCK" in result.stdout
    assert "channel 1 of 2" in result.stdout


async def test_peer_killed_mid_stream() -> None:
    with running_stack("verbs", tokens_per_s=5) as stack:
        await check_peer_killed_mid_stream(stack)
