"""The real HTTP application and ``Service`` over loopback peers, through ``aiohttp_client``.

Everything below the ring is in memory (``tests/engine/loopback.py``); the
client talks to a real socket on loopback. The GPU half answers what each
test tells it to, so no outcome depends on timing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from pytest_aiohttp import AiohttpClient

from dpu_frontend.config import PeerAddress
from dpu_frontend.daemon import Daemon
from dpu_frontend.engine.pool import PeerPool
from dpu_frontend.engine.service import Service
from dpu_frontend.http.app import create_app
from dpu_frontend.http.auth import ApiKeys
from dpu_frontend.metrics import Metrics
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.chat_template import load_chat_template
from dpu_frontend.text.tokenizer import Vocabulary
from tests.engine.conftest import serve_config
from tests.engine.loopback import LoopbackGpu, LoopbackPeer

MODEL = "qwen3"


@pytest.fixture(scope="session")
def vocab() -> Vocabulary:
    return Vocabulary.load(default_tokenizer_dir())



def ids(vocab: Vocabulary, text: str) -> tuple[int, ...]:
    """``text`` as the token ids a GPU would emit for it (no special tokens)."""
    return tuple(vocab.encode(text, add_special_tokens=False))

@dataclass
class Frontend:
    client: TestClient[Any, Any]
    peers: dict[PeerAddress, LoopbackPeer]
    service: Service
    metrics: Metrics
    keys: ApiKeys

    @property
    def peer(self) -> LoopbackPeer:
        return next(iter(self.peers.values()))

    @property
    def gpu(self) -> LoopbackGpu:
        return self.peer.gpu

    def aborted(self, reason: str) -> float:
        return self.metrics.registry.get_sample_value(
            "dpu_frontend_aborted_requests_total", {"reason": reason}) or 0.0


Factory = Callable[..., Awaitable[Frontend]]


@pytest.fixture
async def make_frontend(aiohttp_client: AiohttpClient,
                        vocab: Vocabulary) -> AsyncIterator[Factory]:
    """``await make_frontend(peers=1, **ServeConfig overrides)``"""
    made: list[Frontend] = []

    async def make(peers: int = 1, **overrides: Any) -> Frontend:
        addresses = tuple(PeerAddress(f"gpu{i}", 1) for i in range(peers))
        config = serve_config(peers=addresses, **overrides)
        loopbacks = {address: LoopbackPeer() for address in addresses}

        async def connect(cfg: Any, address: PeerAddress) -> Any:
            return await loopbacks[address].connect(cfg, address)

        metrics = Metrics()
        pool = PeerPool(config, metrics, connect)
        pool.limit_tokens(vocab.tokenizer.get_vocab_size())  # as the daemon does
        await pool.start()
        service = Service(config, vocab, pool, load_chat_template(vocab, None), metrics)
        keys = ApiKeys(config)
        keys.load()  # as the daemon does at start
        client = await aiohttp_client(create_app(service, MODEL, metrics, keys))
        frontend = Frontend(client, loopbacks, service, metrics, keys)
        made.append(frontend)
        return frontend

    yield make
    for frontend in made:
        await frontend.service.pool.close()
        frontend.service.close()


@pytest.fixture
async def peer() -> LoopbackPeer:
    return LoopbackPeer()


@pytest.fixture
async def daemons() -> AsyncIterator[list[Daemon]]:
    """Where ``start_daemon`` puts the daemons it starts; each is stopped at the end."""
    started: list[Daemon] = []
    yield started
    for daemon in started:
        await daemon.stop()


async def start_daemon(daemons: list[Daemon], peer: LoopbackPeer, **overrides: Any) -> Daemon:
    """The real ``Daemon`` on a free port of loopback, its GPU side ``peer``."""
    daemon = Daemon(serve_config(port=0, tokenizer_threads=1, **overrides), peer.connect)
    daemons.append(daemon)
    await daemon.start()
    return daemon


async def events(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    """Every event of an SSE answer; it must end with ``[DONE]``."""
    out: list[dict[str, Any]] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            return out
        if line:
            out.append(json.loads(line.removeprefix("data: ")))
    raise AssertionError(f"the stream ended without [DONE] after {out}")


async def next_event(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    while True:
        line = (await resp.content.readline()).decode().strip()
        if line:
            event: dict[str, Any] = json.loads(line.removeprefix("data: "))
            return event
