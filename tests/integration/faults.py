"""Faults injected under open streams, shared by shm (native) and verbs (soft-RoCE) tests.

Each scenario opens streams, breaks the GPU side in one way, and checks the
journal of what every client received: exactly one error event and one
``[DONE]`` for each stream the fault hit, nothing lost, nothing twice; then
that the daemon recovers and serves again. No outcome is decided by a
sleep: waits are bounded polls of observable state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from dpu_frontend.config import PeerConfig, RdmaConfig
from dpu_frontend.control import messages
from dpu_frontend.peer.reference import ReferenceKernel
from dpu_frontend.peer.server import PeerServer, TokenSource
from dpu_frontend.ring import Geometry, GpuChannel, ResponseRecord
from dpu_frontend.ring.records import encode_response_body
from dpu_frontend.softroce.harness import RXE_IP
from dpu_frontend.softroce.processes import CLI, DAEMON_READY
from dpu_frontend.softroce.processes import start as start_process
from dpu_frontend.softroce.processes import stop as stop_process
from tests.integration.lifecycle import LONG, endings, eventually, read_events
from tests.stack import MODEL, VM_PEER_TIMEOUT_S, Stack


async def open_streams(http: aiohttp.ClientSession, base_url: str,
                       count: int) -> list[aiohttp.ClientResponse]:
    """``count`` long streams, each past its first event (generation under way)."""
    responses = [await http.post(f"{base_url}/v1/completions",
                                 json=LONG | {"prompt": f"fault {i}"}) for i in range(count)]
    assert [r.status for r in responses] == [200] * count
    for r in responses:
        assert (await r.content.readline()).startswith(b"data: {")
    return responses


async def ended_with_errors(responses: list[aiohttp.ClientResponse]) -> list[str]:
    """The error message of each stream, which must end with one error and [DONE]."""
    journal = await asyncio.gather(*(read_events(r) for r in responses))
    assert [endings(events) for events in journal] == [["error", "[DONE]"]] * len(responses)
    return [json.loads(events[-2])["error"]["message"] for events in journal]


async def healthy(http: aiohttp.ClientSession, base_url: str, what: str) -> None:
    async def up() -> bool:
        async with http.get(f"{base_url}/health") as h:
            return h.status == 200

    await eventually(up, what)


async def serves(http: aiohttp.ClientSession, base_url: str, count: int = 2) -> None:
    """``count`` new streams each finish, one after another."""
    for i in range(count):
        body = {"model": MODEL, "prompt": f"after {i}", "max_tokens": 5, "stream": True}
        async with http.post(f"{base_url}/v1/completions", json=body) as r:
            assert endings(await read_events(r)) == ["finish_reason", "[DONE]"]


# -- a peer alive but not advancing ----------------------------------------------------

async def check_peer_stalled(stack: Stack, streams: int = 3) -> None:
    """SIGSTOP the peer: its heartbeat stops, every open stream ends with an error
    naming it, new requests get 503; SIGCONT: the daemon reconnects and serves."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        responses = await open_streams(http, stack.base_url, streams)
        stack.peer.send_signal(signal.SIGSTOP)
        try:
            errors = await ended_with_errors(responses)
            assert all("heartbeat stopped" in e or "did not complete" in e for e in errors), errors
            async with http.post(f"{stack.base_url}/v1/completions",
                                 json=LONG | {"stream": False}) as refused:
                assert refused.status == 503 and refused.headers["Retry-After"] == "1"
        finally:
            stack.peer.send_signal(signal.SIGCONT)
        await healthy(http, stack.base_url, "the daemon never reconnected to the resumed peer")
        await serves(http, stack.base_url)


# -- a peer restarted speaking another protocol version ---------------------------------

@contextlib.asynccontextmanager
async def other_version_peer(host: str, port: int, version: int) -> AsyncIterator[list[str]]:
    """A control plane on ``host:port`` that refuses every hello as a v``version`` peer
    would; yields the hellos' client names as they come."""
    hellos: list[str] = []

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = messages.Hello.from_dict(await messages.receive(reader))
            hellos.append(hello.client)
            await messages.send(writer, {"op": "refuse", "code": "version",
                                         "protocol": version,
                                         "message": f"this peer v{version} does not speak "
                                                    f"v{hello.protocol}"})
        finally:
            writer.close()

    server = await asyncio.start_server(refuse, host, port, reuse_address=True)
    try:
        yield hellos
    finally:
        server.close()
        await server.wait_closed()


async def check_peer_speaks_another_version(stack: Stack) -> None:
    """kill -9 the peer and put a v3 peer at its address: the open stream ends with an
    error, the daemon refuses the v3 peer cleanly (503 and /health say why) and keeps
    serving nothing from it; the real peer back, it serves again."""
    host, port = stack.peers[0].address.rsplit(":", 1)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        responses = await open_streams(http, stack.base_url, 1)
        stack.peers[0].kill()
        await ended_with_errors(responses)
        async with other_version_peer(host, int(port), 3) as hellos:
            async def refused() -> bool:
                async with http.get(f"{stack.base_url}/health") as h:
                    error = (await h.json())["peers"][0]["error"] or ""
                    return h.status == 503 and "ring protocol v3" in error

            await eventually(refused, "the v3 peer's refusal never reached /health")
            assert hellos, "the daemon never said hello to the v3 peer"
            async with http.post(f"{stack.base_url}/v1/completions",
                                 json=LONG | {"stream": False}) as answer:
                assert answer.status == 503
                assert "ring protocol v3" in (await answer.json())["error"]["message"]
        stack.peers[0].restart()
        await healthy(http, stack.base_url, "the daemon never came back to the v2 peer")
        await serves(http, stack.base_url)


# -- corrupt and torn response records from a test peer ---------------------------------

class FaultyRing(GpuChannel):
    """The GPU half, which publishes its next record broken when told to:
    ``epoch``: a body of another attachment (a stale writer), ``torn``: a sequence
    word that does not belong to the slot (a body seen before its own ``seq``)."""

    fault: str | None = None

    def write(self, position: int, record: ResponseRecord) -> None:
        fault, self.fault = self.fault, None
        if fault is None:
            super().write(position, record)
            return
        lay = self.layout
        slot = lay.resp_slot_offset(position)
        epoch = self.epoch ^ 0x5A5A if fault == "epoch" else self.epoch
        self.mem.write(slot + 8, encode_response_body(record, lay.resp_slot_size, epoch))
        seq = position + 1 + (lay.resp_slots if fault == "torn" else 0)
        self.mem.store_release(slot, seq)
        self.counters.published += 1


class FaultyKernel(ReferenceKernel):
    """The reference kernel with ``FaultyRing``s."""

    def rings(self) -> list[FaultyRing]:
        return [channel.ring for channel in self._channels
                if isinstance(channel.ring, FaultyRing)]

    def open(self, layout: Any, region: Any) -> Any:
        address = super().open(layout, region)
        for channel in self._channels:
            channel.ring = FaultyRing(channel.ring.mem, channel.ring.layout)
        return address


#: How soon the streams of a session end once a broken record is published: the
#: daemon's next poll refuses it (milliseconds natively; the micro-VM's software CPU is
#: 15-20x slower and a starved guest stalls for seconds). A record it accepted would
#: let the streams run on for their 100,000 tokens.
BROKEN_RECORD_SEEN_S = {"shm": 10.0, "verbs": 60.0}


@dataclass
class FaultyStack:
    base_url: str
    kernel: FaultyKernel
    transport: str


@contextlib.asynccontextmanager
async def faulty_stack(transport: str, tmp: Path) -> AsyncIterator[FaultyStack]:
    """A ``FaultyKernel`` peer in this process, a daemon process in front of it."""
    verbs = transport == "verbs"
    host = RXE_IP if verbs else "127.0.0.1"
    config = PeerConfig(transport=transport, rdma=RdmaConfig(ip=RXE_IP if verbs else None),
                        host=host, port=0, tokens_per_s=20,
                        shm_path=tmp / f"faulty-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                        geometry=Geometry(req_slots=8, arena_bytes=1 << 16, resp_slots=64,
                                          max_sequences=16))
    source = TokenSource.load(config, "dpu-frontend-test-peer")
    kernel = FaultyKernel(config, source.corpus, source.eos_token_ids)
    peer = PeerServer(config, kernel, source.model)
    await peer.start()
    net = ["--rdma-ip", RXE_IP, "--peer-timeout", str(VM_PEER_TIMEOUT_S)] if verbs else []
    daemon = None
    try:
        # In a thread: this loop must answer the daemon's handshake meanwhile.
        daemon, url = await asyncio.to_thread(
            start_process, [*CLI, "serve", "--transport", transport, *net, "--peer",
                            f"{host}:{peer.port}", "--port", "0", "--model-name", MODEL],
            DAEMON_READY, 300)
        yield FaultyStack(url, kernel, transport)
    finally:
        # The peer closed whatever the daemon's exit: a socket left open would fail the
        # next test as an unraisable warning, not this one.
        try:
            status = 0 if daemon is None else await asyncio.to_thread(stop_process, daemon)
        finally:
            await peer.close()
        assert status == 0, "daemon exit status"


async def check_a_broken_record_resets_the_session(stack: FaultyStack, fault: str,
                                                   streams: int = 2) -> None:
    """One broken record: every stream of that session ends with an error (nothing the
    peer publishes after it can be trusted), the daemon counts it, reconnects in a new
    epoch and serves."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        before = await protocol_errors(http, stack.base_url)
        responses = await open_streams(http, stack.base_url, streams)
        (ring,) = stack.kernel.rings()
        epoch = ring.epoch
        ring.fault = fault
        limit = BROKEN_RECORD_SEEN_S[stack.transport]
        try:
            async with asyncio.timeout(limit):
                errors = await ended_with_errors(responses)
        except TimeoutError:
            raise AssertionError(f"a {fault} record did not end the session's streams within "
                                 f"{limit} s: the daemon accepted it") from None
        assert all("epoch" in e or "sequence" in e for e in errors), errors
        await healthy(http, stack.base_url, "the daemon never reconnected after the fault")
        assert ring.epoch != epoch  # a new attachment
        assert await protocol_errors(http, stack.base_url) == before + 1
        await serves(http, stack.base_url)


async def protocol_errors(http: aiohttp.ClientSession, base_url: str) -> float:
    """``dpu_frontend_peer_bad_records_total{reason="protocol"}`` as the daemon reports it."""
    async with http.get(f"{base_url}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("dpu_frontend_peer_bad_records_total{") and 'reason="protocol"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
