"""Two minutes of soak (tests/soak.py) in CI: 70% of the capacity measured in the same run,
a fifth of the clients walking away mid-stream; no unexpected error, no fd growth, RSS
flat after the warm-up. ``benchmarks/soak.py`` runs the 30-minute form."""

from __future__ import annotations

import pytest

from tests.soak import soak
from tests.stack import running_stack

DURATION_S = 120
WARMUP_S = 30
RSS_LIMIT = 0.05


# The stack's start, 8 s of capacity, the two minutes, the clients that left: 3 minutes.
@pytest.mark.timeout(600)
async def test_two_minutes_at_70_percent_lose_nothing_and_leak_nothing() -> None:
    with running_stack("shm", timeout=120) as stack:
        report = await soak(stack.base_url, stack.daemon.pid, duration_s=DURATION_S,
                            warmup_s=WARMUP_S)
    print(report.figures())
    assert report.problems(RSS_LIMIT) == [], report.figures()
    assert report.disconnected > 0 and report.finished > 100
