"""The whole daemon in one process over a loopback peer: start, drain, stop in order.

A real listening socket and the real ``Daemon``; only the GPU side is in
memory, so the test decides when each stream ends.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from dpu_frontend.daemon import Daemon
from dpu_frontend.ring import FinishReason
from dpu_frontend.text.tokenizer import Vocabulary
from tests.engine.loopback import LoopbackPeer
from tests.http.conftest import MODEL, events, ids, next_event, start_daemon

LONG = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 1000, "stream": True}

def aborted(daemon: Daemon, reason: str) -> float:
    return daemon.metrics.registry.get_sample_value(
        "dpu_frontend_aborted_requests_total", {"reason": reason}) or 0.0


async def test_a_drain_refuses_new_work_and_lets_open_streams_finish(
        daemons: list[Daemon], peer: LoopbackPeer, vocab: Vocabulary) -> None:
    daemon = await start_daemon(daemons, peer)
    url = f"http://127.0.0.1:{daemon.port}"
    # A load balancer's probe: one keep-alive connection, opened before the drain
    # (the daemon stops accepting connections at once).
    probe = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
    async with probe, aiohttp.ClientSession() as http:
        async with probe.get(f"{url}/health") as health:
            assert health.status == 200
        resp = await http.post(f"{url}/v1/completions", json=LONG)
        (arrival,) = await peer.gpu.wait_for(1)
        request_id = arrival.record.request_id
        peer.gpu.emit(request_id, ids(vocab, " Once"))
        assert "error" not in await next_event(resp)

        drain = asyncio.create_task(daemon.drain())
        await asyncio.sleep(0)  # the drain's first step: not ready, no new requests
        async with probe.get(f"{url}/health") as health:
            assert health.status == 503
            assert "draining" in (await health.json())["error"]["message"]
        async with probe.post(f"{url}/v1/completions", json=LONG) as refused:
            assert refused.status == 503 and refused.headers["Retry-After"] == "1"
        assert not drain.done()

        peer.gpu.finish(request_id, ids(vocab, " upon"))
        rest = await events(resp)
        assert rest[-1]["choices"][0]["finish_reason"] == "stop"
        await drain
    assert aborted(daemon, "drain_timeout") == 0 and peer.gpu.cancels == []


async def test_a_drain_that_times_out_ends_the_streams_with_an_error(
        daemons: list[Daemon], peer: LoopbackPeer) -> None:
    daemon = await start_daemon(daemons, peer, drain_timeout_s=0.01)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"http://127.0.0.1:{daemon.port}/v1/completions", json=LONG)
        (arrival,) = await peer.gpu.wait_for(1)
        await daemon.drain()  # the GPU never finishes it
        rest = await events(resp)
    assert "drain timeout" in rest[-1]["error"]["message"]
    assert aborted(daemon, "drain_timeout") == 1
    await peer.gpu.wait_for(1, cancels=1)  # its generation is stopped on the GPU too
    peer.gpu.finish(arrival.record.request_id, finish=FinishReason.CANCELLED)


async def test_the_access_log_counts_the_events_the_poll_loop_wrote(
        daemons: list[Daemon], peer: LoopbackPeer, vocab: Vocabulary,
        caplog: pytest.LogCaptureFixture) -> None:
    """The size field of a streamed answer is every byte of it on the wire (the chunk
    framing with it), the events written from the poll loop included."""
    daemon = await start_daemon(daemons, peer)
    url = f"http://127.0.0.1:{daemon.port}"
    caplog.set_level(logging.INFO, logger="dpu_frontend.access")
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{url}/v1/completions", json=LONG)
        (arrival,) = await peer.gpu.wait_for(1)
        request_id = arrival.record.request_id
        body = b""
        for word in (" Once", " upon", " a", " time", " there", " was"):
            peer.gpu.emit(request_id, ids(vocab, word))
            body += await resp.content.readuntil(b"\n\n")  # one poll a record
        peer.gpu.finish(request_id, finish=FinishReason.LENGTH)
        body += await resp.read()
    await daemon.drain()  # the handler has ended, and logged
    (line,) = [r.getMessage() for r in caplog.records if r.name == "dpu_frontend.access"
               and "/v1/completions" in r.getMessage()]
    size = int(line.split('" ', 1)[1].split()[1])  # "%r" %s %b
    assert size > len(body)  # the body, its framing and the headers


async def test_an_http_1_0_stream_ends_with_its_connection(
        daemons: list[Daemon], peer: LoopbackPeer, vocab: Vocabulary) -> None:
    """HTTP/1.0 has no chunked coding: the end of a stream is the connection closing,
    also when the client asked for keep-alive (it would wait for the idle timeout)."""
    daemon = await start_daemon(daemons, peer)
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    body = json.dumps(LONG).encode()
    writer.write(b"POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                 % (len(body), body))
    try:
        (arrival,) = await peer.gpu.wait_for(1)
        request_id = arrival.record.request_id
        for word in (" Once", " upon", " a", " time"):  # a record a poll: direct writes
            peer.gpu.emit(request_id, ids(vocab, word))
            await peer.gpu.wait_exchanges(2)
        peer.gpu.finish(request_id, finish=FinishReason.LENGTH)
        async with asyncio.timeout(10):
            answer = await reader.read()  # to the end: the daemon closes the connection
    finally:
        writer.close()
    head, _, stream = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower()
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in stream.split(b"\n\n")
             if line.startswith(b"data: {")]
    assert "".join(texts) == " Once upon a time" and stream.endswith(b"data: [DONE]\n\n")
