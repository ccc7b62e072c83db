"""A ``PeerLink`` on a loopback peer: the asyncio layer in memory, no process, no socket."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dpu_frontend.config import PeerAddress, ServeConfig
from dpu_frontend.engine.link import PeerLink
from dpu_frontend.metrics import Metrics
from tests.engine.loopback import LoopbackPeer

ADDRESS = PeerAddress("gpu0", 1)


def serve_config(**overrides: Any) -> ServeConfig:
    # Fast retries: a reconnect test waits for one, never for a fixed time.
    base = ServeConfig(peers=(ADDRESS,), transport="shm", reconnect_initial_s=0.001,
                       reconnect_max_s=0.002)
    return dataclasses.replace(base, **overrides)


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def peer() -> LoopbackPeer:
    return LoopbackPeer()


@pytest.fixture
async def link(peer: LoopbackPeer, metrics: Metrics) -> AsyncIterator[PeerLink]:
    link = PeerLink(serve_config(), ADDRESS, metrics, peer.connect)
    await link.start()
    yield link
    await link.close()
