"""Faults under open streams over real soft-RoCE, in the one micro-VM boot: the
scenarios of ``tests/integration/faults.py`` (the peer killed mid-stream and the QP
forced into error are in ``test_lifecycle_verbs.py``).

Each stack costs 30-60 s of emulated CPU to start, so the scenarios share two:
one peer process that is stalled, then replaced by a v3 peer, then brought
back; and one test peer that publishes a torn record.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration import faults
from tests.stack import running_stack

pytestmark = pytest.mark.rdma


async def test_a_stalled_peer_then_a_peer_of_another_protocol_version() -> None:
    with running_stack("verbs", tokens_per_s=10) as stack:
        await faults.check_peer_stalled(stack, streams=2)
        await faults.check_peer_speaks_another_version(stack)


async def test_a_torn_response_record_resets_the_session() -> None:
    # One fault per stack: the record of another epoch takes the same path in the
    # daemon (a ProtocolError resets the session) and runs over shm natively. Run
    # after it in the same stack, the third session of one in-process peer once
    # hung on its first RDMA READ in the VM of a loaded machine (docs/reliability.md).
    # The region is anonymous memory under verbs: no file is made there.
    async with faults.faulty_stack("verbs", Path("/dev/shm")) as stack:
        await faults.check_a_broken_record_resets_the_session(stack, "torn")
