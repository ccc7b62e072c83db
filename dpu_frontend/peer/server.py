"""The reference GPU peer: region, layout record, control plane, engine loop.

It registers its region once (an anonymous mapping under verbs, a
shared-memory file under shm), publishes the layout record at offset 0, and
from then on only loads and stores in that memory: the daemon moves every
byte with RDMA. The control plane (``dpu_frontend.control``) hands out one
channel per daemon worker and resets it when that worker goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from dpu_frontend import __version__
from dpu_frontend.config import PeerConfig
from dpu_frontend.control import messages
from dpu_frontend.errors import DpuFrontendError, PeerError
from dpu_frontend.lifecycle import stop_on_signals
from dpu_frontend.peer.engine import Engine, default_corpus
from dpu_frontend.ring import CancelRecord, GpuChannel, Layout, ResponseRecord
from dpu_frontend.sdnotify import Notifier
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.tokenizer import Vocabulary
from dpu_frontend.transport.shm import map_file
from dpu_frontend.transport.verbs.resources import QpInfo, RdmaResources
from dpu_frontend.transport.verbs.transport import pin

log = logging.getLogger("dpu_frontend.peer")


@dataclass(slots=True)
class _Channel:
    index: int
    ring: GpuChannel
    engine: Engine
    attached: bool = False
    attachments: int = 0
    qp: Any = None
    outbox: list[ResponseRecord] = field(default_factory=list)


class PeerServer:
    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self.layout: Layout | None = None
        self.vocab: Vocabulary | None = None
        self.port = config.port
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._anchor: Any = None
        self._address = 0
        self._resources: RdmaResources | None = None
        self._mr: Any = None
        self._channels: list[_Channel] = []
        self._server: asyncio.Server | None = None
        self._engine_task: asyncio.Task[None] | None = None
        self._sessions: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        cfg = self.config
        self.vocab = Vocabulary.load(cfg.tokenizer or default_tokenizer_dir())
        corpus = [self.vocab.encode(doc) for doc in default_corpus()]
        self.layout = cfg.geometry.plan(instance=secrets.randbits(63) | 1)
        size = self.layout.region_size
        if cfg.transport == "shm":
            self._map = map_file(str(cfg.shm_path), size, create=True)
        else:
            self._map = mmap.mmap(-1, size)
            self._resources = RdmaResources(cfg.rdma.device, cfg.rdma.ip)
            self._resources.open()
            self._address, self._anchor = pin(self._map)
            self._mr = self._resources.register(self._address, size, remote=True)
        mem = self._view = memoryview(self._map)
        mem[:self.layout.header_size] = self.layout.encode()
        for i, ch in enumerate(self.layout.channels):
            engine = Engine(mode=cfg.mode, corpus_ids=corpus, eos_token_ids=self.vocab.eos_token_ids,
                            tokens_per_s=cfg.tokens_per_s, tokens_per_record=ch.tokens_per_response)
            self._channels.append(_Channel(i, GpuChannel(mem, ch), engine))
        self._server = await asyncio.start_server(self._session, cfg.host, cfg.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._engine_task = asyncio.create_task(self._run_engine(), name="peer-engine")
        log.info("peer ready on %s:%d transport=%s channels=%d region=%d bytes mode=%s",
                 cfg.host, self.port, cfg.transport, len(self._channels), size, cfg.mode)

    # -- control plane ------------------------------------------------------

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._sessions.add(task)
        channel: _Channel | None = None
        try:
            first = await messages.receive(reader)
            if first.get("op") == "stats":
                await messages.send(writer, {"op": "stats", "channels": self.stats()})
                return
            hello = messages.Hello.from_dict(first)
            channel = self._grant(hello)
            welcome = self._attach(channel, hello)
            await messages.send(writer, welcome.to_dict())
            log.info("channel %d attached to %s (%s)", channel.index,
                     writer.get_extra_info("peername"), hello.client)
            await reader.read()  # the session lives until the daemon closes it
        except DpuFrontendError as exc:
            log.warning("control session refused: %s", exc)
            with contextlib.suppress(ConnectionError):
                await messages.send(writer, messages.refuse(str(exc)))
        except ConnectionError:
            pass
        finally:
            if channel is not None and channel.attached:
                self._detach(channel)
            writer.close()
            if task is not None:
                self._sessions.discard(task)

    def _grant(self, hello: messages.Hello) -> _Channel:
        if hello.protocol != self.layout_version:
            raise PeerError(f"daemon speaks ring protocol v{hello.protocol}, "
                            f"this peer v{self.layout_version}")
        if hello.transport != self.config.transport:
            raise PeerError(f"this peer serves over {self.config.transport}, not {hello.transport}")
        free = [c for c in self._channels if not c.attached]
        if hello.channel >= 0:
            free = [c for c in free if c.index == hello.channel]
            if hello.channel >= len(self._channels):
                raise PeerError(f"channel {hello.channel} does not exist "
                                f"(this peer has {len(self._channels)})")
        if not free:
            raise PeerError("no free channel: every ring pair is attached to a daemon worker")
        return free[0]

    def _attach(self, channel: _Channel, hello: messages.Hello) -> messages.Welcome:
        layout = self.layout
        if layout is None:
            raise PeerError("peer not started")
        channel.ring.reset()
        channel.engine.cancel_all()
        channel.outbox = []
        qp_info: dict[str, Any] | None = None
        if self.config.transport == "shm":
            region: dict[str, Any] = {"path": str(self.config.shm_path)}
        else:
            resources = self._resources
            if resources is None or hello.qp is None:
                raise PeerError("verbs hello without a QP description")
            qp = resources.create_qp()
            try:
                local = resources.local_info(qp)
                resources.to_rts(qp, local, QpInfo.from_dict(hello.qp))
            except BaseException:
                resources.destroy_qp(qp)
                raise
            channel.qp = qp
            qp_info = local.to_dict()
            region = {"addr": self._address, "rkey": self._mr.rkey}
        channel.attached = True
        channel.attachments += 1
        vocab = self.vocab
        return messages.Welcome(
            channel=channel.index, instance=layout.instance, region_size=layout.region_size,
            region=region, qp=qp_info,
            model={"eos_token_ids": list(vocab.eos_token_ids) if vocab else [],
                   "peer": f"dpu-frontend-peer {__version__}", "mode": self.config.mode},
        )

    def _detach(self, channel: _Channel) -> None:
        channel.attached = False
        channel.engine.cancel_all()
        channel.outbox = []
        if channel.qp is not None and self._resources is not None:
            self._resources.destroy_qp(channel.qp)
        channel.qp = None
        log.info("channel %d detached", channel.index)

    @property
    def layout_version(self) -> int:
        return self.layout.version_major if self.layout else 0

    # -- the "GPU kernel" ---------------------------------------------------

    async def _run_engine(self) -> None:
        tick = self.config.tick_s
        while True:
            now = time.monotonic()
            for channel in self._channels:
                if channel.attached:
                    try:
                        self._step(channel, now)
                    except DpuFrontendError as exc:
                        log.error("channel %d: %s; detaching", channel.index, exc)
                        self._detach(channel)
            await asyncio.sleep(tick)

    def _step(self, channel: _Channel, now: float) -> None:
        ring, engine = channel.ring, channel.engine
        outbox = channel.outbox
        for record, prompt in ring.poll_requests():
            if isinstance(record, CancelRecord):
                final = engine.cancel(record.request_id)
                if final is not None:
                    outbox.append(final)
            else:
                engine.admit(record, prompt, now)
        # Generate only what the response ring can take soon: the outbox is bounded.
        budget = max(0, ring.layout.resp_slots - len(outbox))
        outbox += engine.step(now, budget)
        sent = ring.publish(outbox)
        del outbox[:sent]
        ring.beat()

    def stats(self) -> list[dict[str, Any]]:
        """Per-channel counters (the ``stats`` control message; tests and operators)."""
        return [{"channel": c.index, "attached": c.attached, "attachments": c.attachments,
                 "active": c.engine.active_ids, "admitted": c.engine.stats.admitted,
                 "completed": c.engine.stats.completed, "cancelled": c.engine.stats.cancelled,
                 "cancelled_ids": c.engine.stats.cancelled_ids[-64:],
                 "tokens": c.engine.stats.tokens, "request_records": c.ring.consumed,
                 "request_slots": c.ring.layout.req_slots}
                for c in self._channels]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        sessions = list(self._sessions)
        for task in sessions:
            task.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)  # detach before teardown
        if self._engine_task is not None:
            self._engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_task
        if self._server is not None:
            await self._server.wait_closed()
        if self._resources is not None:
            self._resources.close()
        self._anchor = None
        for channel in self._channels:
            channel.ring.release()
        self._channels.clear()
        if self._view is not None:
            self._view.release()
        if self._map is not None:
            self._map.close()
        if self.config.transport == "shm":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.shm_path)


async def run_peer(config: PeerConfig) -> int:
    """``dpu-frontend peer``: serve until SIGTERM/SIGINT."""
    server = PeerServer(config)
    notifier = Notifier.from_environment()
    stop = stop_on_signals()
    try:
        await server.start()
        print(f"peer listening on {config.host}:{server.port}", flush=True)
        notifier.ready(f"listening on {config.host}:{server.port}")
        await stop.wait()
        notifier.stopping("closing")
    finally:
        await server.close()
    return 0
