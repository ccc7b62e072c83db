"""Request lifecycle where it depends on the transport, over real soft-RoCE (small sizes)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from dpu_frontend.config import PeerAddress, PeerConfig, RdmaConfig, ServeConfig
from dpu_frontend.engine.pool import PeerPool
from dpu_frontend.errors import PeerError
from dpu_frontend.metrics import Metrics
from dpu_frontend.peer.region import VerbsRegion
from dpu_frontend.peer.server import PeerServer, reference_model
from dpu_frontend.ring import Geometry, SamplingParams
from dpu_frontend.softroce.harness import RXE_IP
from tests.integration import lifecycle
from tests.stack import running_stack

pytestmark = pytest.mark.rdma


async def test_disconnect_delivers_a_cancel_record() -> None:
    with running_stack("verbs", tokens_per_s=10, peer_args=("--req-slots", "2")) as s:
        await lifecycle.check_disconnect_cancels_on_the_gpu(s)


async def test_fault_reconnect_and_handshake() -> None:
    with running_stack("verbs", tokens_per_s=10) as s:
        await lifecycle.check_fault_and_reconnect(s, streams=3)


async def test_two_peers() -> None:
    with running_stack("verbs", tokens_per_s=50, peers=2) as s:
        await lifecycle.check_two_peers(s, requests=4)


async def test_a_lost_gpu_side_qp_is_a_completion_error() -> None:
    """The peer process lives on and its control connection stays open, but its QP is
    gone: the daemon's next RDMA operation fails, and the open stream ends with it."""
    peer_config = PeerConfig(transport="verbs", rdma=RdmaConfig(ip=RXE_IP), host=RXE_IP, port=0,
                             tokens_per_s=5, geometry=Geometry(req_slots=4, arena_bytes=4096,
                                                               resp_slots=16, max_sequences=8))
    peer = PeerServer(peer_config, *reference_model(peer_config))
    await peer.start()
    serve_config = ServeConfig(peers=(PeerAddress(RXE_IP, peer.port),), transport="verbs",
                               rdma=RdmaConfig(ip=RXE_IP), peer_timeout_s=5.0)
    pool = PeerPool(serve_config, Metrics())
    try:
        await pool.start()
        stream = pool.submit([1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
        await anext(stream)  # generation is under way
        channel = peer._channels[0]
        assert channel.link is not None and isinstance(peer.region, VerbsRegion)
        resources = peer.region.resources
        assert resources is not None
        resources.destroy_qp(channel.link.qp)  # what a GPU-side failure looks like
        channel.link = None
        with pytest.raises(PeerError, match=r"completion error|did not complete"):
            async with asyncio.timeout(60):
                async for _ in stream:
                    pass
    finally:
        await pool.close()
        await peer.close()
        gc.collect()  # any verbs object left unclosed fails this test, not the next one
