"""Faults under open streams, natively over shm (the same scenarios run over soft-RoCE
in ``tests/rdma/test_faults_verbs.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration import faults
from tests.stack import running_stack


async def test_a_stalled_peer_fails_its_streams_and_comes_back() -> None:
    with running_stack("shm", tokens_per_s=20, timeout=60) as stack:
        await faults.check_peer_stalled(stack)


async def test_a_peer_of_another_protocol_version_is_refused_cleanly() -> None:
    with running_stack("shm", tokens_per_s=20, timeout=60) as stack:
        await faults.check_peer_speaks_another_version(stack)


@pytest.mark.parametrize("fault", ["epoch", "torn"])
async def test_a_broken_response_record_resets_the_session(fault: str) -> None:
    async with faults.faulty_stack("shm", Path("/dev/shm")) as stack:
        await faults.check_a_broken_record_resets_the_session(stack, fault)
