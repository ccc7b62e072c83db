"""``PeerLink`` driven in memory: every outcome is decided by what the loopback GPU does."""

from __future__ import annotations

import asyncio

import pytest

from dpu_frontend.config import ServeConfig
from dpu_frontend.engine.link import LinkState, PeerLink
from dpu_frontend.engine.pool import PeerPool
from dpu_frontend.engine.request import RingRequest
from dpu_frontend.errors import (
    ClientTooSlow,
    LayoutMismatch,
    Overloaded,
    PeerError,
    ProtocolError,
    TransportError,
    Unavailable,
)
from dpu_frontend.metrics import Metrics
from dpu_frontend.ring import FinishReason, Geometry, ResponseRecord, SamplingParams
from dpu_frontend.ring.automaton import Constraint
from tests.engine.conftest import ADDRESS, serve_config
from tests.engine.loopback import LoopbackPeer, within

PARAMS = SamplingParams(max_tokens=16)


async def read_all(request: RingRequest) -> list[ResponseRecord]:
    """Every record of ``request`` through its final one, or its error; bounded: a record
    the link should have refused lets the stream run on."""
    async def records() -> list[ResponseRecord]:
        return [record async for record in request]

    return await within(records(), f"request {request.request_id}: its end")


def aborted(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("dpu_frontend_aborted_requests_total",
                                              {"reason": reason})
    return value or 0.0


def state(link: PeerLink) -> LinkState:
    return link.state  # read afresh (mypy narrows an attribute across awaits)


async def started(peer: LoopbackPeer, metrics: Metrics, config: ServeConfig) -> PeerLink:
    link = PeerLink(config, ADDRESS, metrics, peer.connect)
    await link.start()
    return link


async def test_records_reach_their_request_in_order(link: PeerLink, peer: LoopbackPeer) -> None:
    first = link.submit([1, 2, 3], PARAMS)
    second = link.submit([4], PARAMS)
    arrivals = await peer.gpu.wait_for(2)
    assert [a.prompt for a in arrivals] == [(1, 2, 3), (4,)]
    gpu = peer.gpu
    gpu.emit(second.request_id, (40,))
    gpu.emit(first.request_id, (10, 11))
    gpu.finish(first.request_id, (12,))
    gpu.finish(second.request_id, (41,), FinishReason.LENGTH)
    assert [r.tokens for r in await read_all(first)] == [(10, 11), (12,)]
    assert [(r.tokens, r.finish) for r in await read_all(second)] == [
        ((40,), FinishReason.NONE), ((41,), FinishReason.LENGTH)]
    assert link.in_flight == 0 and link.outstanding == 0 and link.idle.is_set()


async def test_a_cancel_reaches_the_gpu_and_nothing_more_is_delivered(
        link: PeerLink, peer: LoopbackPeer) -> None:
    request = link.submit([1, 2], PARAMS)
    await peer.gpu.wait_for(1)
    peer.gpu.emit(request.request_id, (5,))
    assert (await anext(request)).tokens == (5,)
    request.cancel()  # what a handler's cleanup does when its client went away
    await peer.gpu.wait_for(1, cancels=1)
    assert peer.gpu.cancels == [request.request_id]
    assert link.in_flight == 1  # until the GPU's final record, its slot is not free
    peer.gpu.emit(request.request_id, (6,))
    peer.gpu.finish(request.request_id, finish=FinishReason.CANCELLED)
    await link.idle.wait()
    assert await read_all(request) == []  # abandoned: what came after is dropped


async def test_a_request_cancelled_before_it_was_written_ends_at_once(
        peer: LoopbackPeer, metrics: Metrics) -> None:
    peer.geometry = Geometry(req_slots=1, arena_bytes=4096, resp_slots=4, max_sequences=1)
    link = await started(peer, metrics, serve_config())
    try:
        running = link.submit([1], PARAMS)
        waiting = link.submit([2], PARAMS)  # max_sequences 1: it stays queued
        await peer.gpu.wait_for(1)
        await peer.gpu.wait_exchanges(2)
        assert link.channel is not None and link.channel.queued == 1
        waiting.cancel()
        assert link.in_flight == 1  # ended without a word to the GPU
        peer.gpu.finish(running.request_id, (9,))
        assert [r.tokens for r in await read_all(running)] == [(9,)]
        await link.idle.wait()
        assert peer.gpu.cancels == [] and list(peer.gpu.arrivals) == [running.request_id]
    finally:
        await link.close()


async def test_a_client_a_whole_buffer_behind_is_cut_off(
        peer: LoopbackPeer, metrics: Metrics) -> None:
    link = await started(peer, metrics, serve_config(stream_buffer_records=3))
    try:
        request = link.submit([1], PARAMS)
        await peer.gpu.wait_for(1)
        for token in range(4):  # nobody reads: the fourth does not fit
            peer.gpu.emit(request.request_id, (token,))
        await peer.gpu.wait_for(1, cancels=1)
        with pytest.raises(ClientTooSlow) as caught:
            await read_all(request)
        assert caught.value.code == "stream_buffer_overflow"
        assert aborted(metrics, "client_too_slow") == 1
    finally:
        await link.close()


async def test_a_failed_transport_ends_every_open_request_then_reconnects(
        link: PeerLink, peer: LoopbackPeer, metrics: Metrics) -> None:
    requests = [link.submit([n], PARAMS) for n in (1, 2)]
    gpu = peer.gpu
    await gpu.wait_for(2)
    gpu.emit(requests[0].request_id, (7,))
    assert (await anext(requests[0])).tokens == (7,)
    gpu.failure = TransportError("RDMA completion error IBV_WC_RETRY_EXC_ERR", opcode="read")
    for request in requests:
        with pytest.raises(TransportError, match="RETRY_EXC"):
            await read_all(request)
    assert aborted(metrics, "peer_failed") == 2
    assert metrics.registry.get_sample_value("dpu_frontend_rdma_errors_total",
                                             {"peer": str(ADDRESS), "opcode": "read"}) == 1
    await (await peer.wait_sessions(2)).wait_exchanges(1)  # the new session polls
    assert peer.sessions[0].closed and link.up
    assert link.reconnects == 1 and link.error is None
    again = link.submit([3], PARAMS)
    await peer.gpu.wait_for(1)
    peer.gpu.finish(again.request_id, (8,))
    assert [r.tokens for r in await read_all(again)] == [(8,)]


async def test_the_peer_hanging_up_fails_its_requests(link: PeerLink, peer: LoopbackPeer) -> None:
    request = link.submit([1], PARAMS)
    await peer.gpu.wait_for(1)
    peer.gpu.hung_up.set()
    with pytest.raises(PeerError, match="closed its control connection"):
        await read_all(request)


async def test_a_stopped_heartbeat_fails_the_link(peer: LoopbackPeer, metrics: Metrics) -> None:
    link = await started(peer, metrics, serve_config(peer_timeout_s=0.02))
    try:
        request = link.submit([1], PARAMS)
        await peer.gpu.wait_for(1)
        peer.gpu.beating = False
        with pytest.raises(PeerError, match="heartbeat stopped"):
            await read_all(request)
    finally:
        await link.close()


async def test_a_reconnect_may_bring_a_new_layout(link: PeerLink, peer: LoopbackPeer) -> None:
    before = link.channel
    assert before is not None and before.layout.resp_slots == 16
    peer.geometry = Geometry(req_slots=2, arena_bytes=1024, resp_slots=6, max_sequences=3)
    peer.gpu.hung_up.set()
    await (await peer.wait_sessions(2)).wait_exchanges(1)
    after = link.channel
    assert after is not None and after is not before
    assert after.layout.resp_slots == 6 and after.epoch == 2
    requests = [link.submit([n], PARAMS) for n in range(5)]  # more than the new slots
    await peer.gpu.wait_for(3)
    for request in requests[:3]:
        peer.gpu.finish(request.request_id, (request.request_id,))
    await peer.gpu.wait_for(5)
    for request in requests[3:]:
        peer.gpu.finish(request.request_id, (request.request_id,))
    for request in requests:
        assert [r.tokens for r in await read_all(request)] == [(request.request_id,)]


async def test_admission_counts_what_waits_for_the_ring(
        peer: LoopbackPeer, metrics: Metrics) -> None:
    link = await started(peer, metrics, serve_config(max_queued_requests=2,
                                                     max_queued_prompt_tokens=5))
    try:
        # Submitted back to back, before the poll loop runs: all of them wait.
        link.submit([1, 2], PARAMS)
        link.submit([3], PARAMS)
        with pytest.raises(Overloaded, match="2 requests already wait"):
            link.submit([4], PARAMS)
        assert link.in_flight == 2
        await peer.gpu.wait_for(2)  # written: the queue is empty again
        with pytest.raises(Overloaded, match="prompt tokens"):
            link.submit([0] * 6, PARAMS)
        link.submit([0] * 5, PARAMS)
    finally:
        await link.close()


async def test_a_fatal_first_answer_stops_the_link(peer: LoopbackPeer, metrics: Metrics) -> None:
    peer.refusal = LayoutMismatch("peer speaks ring protocol v1")
    link = PeerLink(serve_config(), ADDRESS, metrics, peer.connect)
    with pytest.raises(LayoutMismatch):
        await link.start()
    assert link.state is LinkState.DOWN
    await asyncio.sleep(0)  # the supervisor's last step
    assert link._task is not None and link._task.done()  # no retry: the daemon exits
    await link.close()
    assert state(link) is LinkState.CLOSED


async def test_an_unreachable_peer_is_retried_until_it_answers(
        peer: LoopbackPeer, metrics: Metrics) -> None:
    peer.refusal = PeerError("cannot reach GPU peer gpu0:1: connection refused")
    link = PeerLink(serve_config(), ADDRESS, metrics, peer.connect)
    with pytest.raises(PeerError, match="cannot reach"):
        await link.start()
    with pytest.raises(Unavailable, match=r"is (down|connecting)"):
        link.submit([1], PARAMS)
    peer.refusal = None
    await (await peer.wait_sessions(1)).wait_exchanges(1)
    assert link.up
    assert link.reconnects == 0  # the first session, however late
    await link.close()


async def test_closing_ends_open_requests_as_shutdown(
        link: PeerLink, peer: LoopbackPeer, metrics: Metrics) -> None:
    request = link.submit([1], PARAMS)
    await peer.gpu.wait_for(1)
    await link.close()
    with pytest.raises(PeerError, match="shutting down"):
        await read_all(request)
    assert aborted(metrics, "shutdown") == 1
    assert state(link) is LinkState.CLOSED and peer.sessions[0].closed


def test_the_state_machine_refuses_a_transition_it_does_not_have(metrics: Metrics) -> None:
    link = PeerLink(serve_config(), ADDRESS, metrics, LoopbackPeer().connect)
    with pytest.raises(RuntimeError, match="connecting -> connecting"):
        link._enter(LinkState.CONNECTING)
    link._enter(LinkState.CLOSED)
    with pytest.raises(RuntimeError, match="closed -> up"):
        link._enter(LinkState.UP)


async def test_a_queued_cancel_is_not_a_waiting_request(
        link: PeerLink, peer: LoopbackPeer, metrics: Metrics) -> None:
    """The running and waiting gauges count requests: a cancel record queued for the
    ring is neither (it once made a running request look waiting)."""
    request = link.submit([1], PARAMS)
    await peer.gpu.wait_for(1)
    request.cancel()
    channel = link.channel
    assert channel is not None and channel.queued == 1 and channel.waiting == 0
    pool = PeerPool(serve_config(), metrics)
    pool.links = [link]
    pool.update_gauges()
    assert metrics.registry.get_sample_value("dpu_frontend_num_requests_running") == 1
    assert metrics.registry.get_sample_value("dpu_frontend_num_requests_waiting") == 0


def bad_records(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value(
        "dpu_frontend_peer_bad_records_total", {"peer": str(ADDRESS), "reason": reason}) or 0.0


async def test_a_record_for_an_unknown_request_is_counted_and_dropped(
        link: PeerLink, peer: LoopbackPeer, metrics: Metrics) -> None:
    request = link.submit([1], PARAMS)
    await peer.gpu.wait_for(1)
    peer.gpu.emit(request.request_id + 1000, (5,))
    peer.gpu.finish(request.request_id, (6,))
    assert [r.tokens for r in await read_all(request)] == [(6,)]
    assert bad_records(metrics, "unknown_request") == 1 and link.up


async def test_a_token_id_outside_the_vocabulary_fails_only_its_request(
        link: PeerLink, peer: LoopbackPeer, metrics: Metrics) -> None:
    link.vocab_size = 100
    bad, good = link.submit([1], PARAMS), link.submit([2], PARAMS)
    await peer.gpu.wait_for(2)
    peer.gpu.emit(bad.request_id, (7, 100))  # 100 is not an id of a 100-id vocabulary
    peer.gpu.finish(good.request_id, (99,))
    with pytest.raises(PeerError, match="token id 100, outside the vocabulary"):
        await read_all(bad)
    assert [r.tokens for r in await read_all(good)] == [(99,)]
    await peer.gpu.wait_for(2, cancels=1)  # its generation is stopped too
    assert peer.gpu.cancels == [bad.request_id]
    assert bad_records(metrics, "token_id") == 1 and link.up


async def test_a_record_of_another_epoch_resets_the_session(
        link: PeerLink, peer: LoopbackPeer, metrics: Metrics) -> None:
    request = link.submit([1], PARAMS)
    gpu = peer.gpu
    await gpu.wait_for(1)
    gpu.ring.epoch += 1  # a stale writer: records of an attachment that is not this one
    gpu.emit(request.request_id, (5,))
    with pytest.raises(ProtocolError, match="epoch"):
        await read_all(request)
    assert bad_records(metrics, "protocol") == 1
    await (await peer.wait_sessions(2)).wait_exchanges(1)  # a new session, a new epoch
    assert link.up


async def test_a_constrained_request_goes_only_to_a_peer_that_walks_automata(
        link: PeerLink, peer: LoopbackPeer, metrics: Metrics) -> None:
    """The loopback peer's layout offers no automata: the pool has no peer for a
    constrained request, and says so (the service answers 400 before it gets here), while
    unconstrained requests still go."""
    pool = PeerPool(serve_config(), metrics)
    pool.links = [link]
    assert link.up and not link.offers_constraints and not pool.offers_constraints
    with pytest.raises(Unavailable, match="no GPU peer that decodes structured output"):
        pool.submit([1], PARAMS, Constraint(b"\0" * 64))
    pool.submit([1], PARAMS)
    assert len(await peer.gpu.wait_for(1)) == 1
