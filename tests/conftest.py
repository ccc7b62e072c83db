"""Every test's time bound (pytest-timeout), by tier.

pyproject.toml's ``timeout`` bounds a test natively and on the arm64 lane. The tiers
that run far slower get their bound here, keyed by the marker that already names
them; a test that needs more than its tier's says so with ``pytest.mark.timeout``,
which wins. When the bound fires in an asyncio test, the stacks of the event loop's
tasks are printed first: the failure's own traceback stops in the loop's
``select``, not at the ``await`` that never returned.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Generator
from types import FrameType
from typing import Any

import pytest

#: rdma: in the micro-VM, whose software CPU is 15-20x slower than the host; a test
#: there starts a peer and a daemon (25-45 s of emulated CPU each), some two or a
#: restart, and the whole lane has taken 200-600 s for 15 tests. gpu: nvcc builds and
#: model loads on a GPU machine, under the tests' own 600 s bounds on a stack's start.
TIER_TIMEOUT_S = {"rdma": 900.0, "gpu": 1800.0}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            continue
        for marker, seconds in TIER_TIMEOUT_S.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.timeout(seconds))
                break


@pytest.hookimpl(hookwrapper=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> Generator[None, None, None]:
    """Wrap pytest-timeout's SIGALRM handler: the tasks' stacks, then its failure."""
    yield
    if settings.method != "signal":
        return
    fail = signal.getsignal(signal.SIGALRM)
    if not callable(fail):
        return

    def tasks_first(signum: int, frame: FrameType | None) -> None:
        __tracebackhide__ = True
        try:
            tasks = asyncio.all_tasks()
        except RuntimeError:  # no event loop runs: not an asyncio test
            tasks = set()
        for task in tasks:
            task.print_stack(file=sys.stderr)
        fail(signum, frame)

    signal.signal(signal.SIGALRM, tasks_first)
