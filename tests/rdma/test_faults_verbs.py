"""Faults under open streams over real soft-RoCE, in the one micro-VM boot: the
scenarios of ``tests/integration/faults.py`` (the peer killed mid-stream and the QP
forced into error are in ``test_lifecycle_verbs.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration import faults
from tests.stack import running_stack

pytestmark = pytest.mark.rdma


async def test_a_stalled_peer_fails_its_streams_and_comes_back() -> None:
    with running_stack("verbs", tokens_per_s=10) as stack:
        await faults.check_peer_stalled(stack, streams=2)


async def test_a_peer_of_another_protocol_version_is_refused_cleanly() -> None:
    with running_stack("verbs", tokens_per_s=10) as stack:
        await faults.check_peer_speaks_another_version(stack)


@pytest.mark.parametrize("fault", ["epoch", "torn"])
async def test_a_broken_response_record_resets_the_session(fault: str) -> None:
    # The region is anonymous memory under verbs: no file is made there.
    async with faults.faulty_stack("verbs", Path("/dev/shm")) as stack:
        await faults.check_a_broken_record_resets_the_session(stack, fault)
