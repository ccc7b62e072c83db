"""A GPU peer's control plane: the region, the layout record, channels granted to daemons.

The peer registers its region once (where the transport's provider puts it,
``peer/region.py``: a shared-memory file under shm; host or GPU memory a NIC
registers under verbs), publishes the layout record at offset 0, and hands out
one channel per daemon worker. It never touches a
ring itself: a ``PeerKernel`` (the reference token generator, or the CUDA
kernel) serves them, and the control plane attaches and detaches channels
through the kernel's mailbox (``ring/mailbox.py``), the way a launcher drives
a persistent GPU kernel:

* attach: ATTACH with the channel's next epoch; the kernel resets the channel
  between two steps and acknowledges; then the QP is brought up and the
  daemon is welcomed with the epoch;
* detach (the control connection closed): the channel's link goes first (the QP
  destroyed, or shm's grace period), so no late WRITE of the old session can
  land, then DETACH.

The connection stays open exactly while the channel is in use: when the
kernel stops serving a channel (it failed, or it detached the channel on its
own), the control plane closes that channel's connection at once, so the
daemon fails its link now rather than at its heartbeat deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from dpu_frontend import __version__
from dpu_frontend.config import PeerConfig
from dpu_frontend.control import auth, messages
from dpu_frontend.errors import DpuFrontendError, LayoutMismatch, PeerError
from dpu_frontend.lifecycle import PEER_READY, announce_ready, stop_on_signals
from dpu_frontend.peer.generator import default_corpus
from dpu_frontend.peer.kernel import PeerKernel
from dpu_frontend.peer.reference import ReferenceKernel
from dpu_frontend.peer.region import Link, region_for
from dpu_frontend.ring import Layout
from dpu_frontend.ring.layout import version_refusal
from dpu_frontend.ring.mailbox import Ack, ChannelState, Command, HostMailbox, MailboxError
from dpu_frontend.sdnotify import Notifier
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.tokenizer import Vocabulary

log = logging.getLogger("dpu_frontend.peer")

#: How long a mailbox command may wait for the kernel's acknowledgement. A
#: kernel runs commands between two steps, so this bounds the longest step.
MAILBOX_TIMEOUT_S = 10.0
#: How long a daemon has to answer the challenge.
AUTH_TIMEOUT_S = 10.0
MAILBOX_POLL_S = 0.0002
#: How often a session checks that the kernel still serves its channel. The kernel
#: reports a failure or a detach in memory, with nothing to wait on; this is a
#: hundredth of the daemon's default heartbeat deadline (--peer-timeout).
KERNEL_WATCH_S = 0.01


@dataclass(slots=True)
class _Channel:
    index: int
    mailbox: HostMailbox
    owner: object | None = None  # the control session that holds it (set before any await)
    attached: bool = False  # an ATTACH was posted: DETACH it when the session ends
    epoch: int = 0  # the last epoch posted; epochs only grow, acknowledged or not
    attachments: int = 0
    link: Link | None = None  # the attachment's way in (its QP under verbs)
    unacked: int = 0  # a command's sequence number the kernel has not acknowledged yet

    @property
    def granted(self) -> bool:
        return self.owner is not None


class PeerServer:
    def __init__(self, config: PeerConfig, kernel: PeerKernel, model: dict[str, Any]) -> None:
        self.config = config
        self.kernel = kernel
        self.model = model
        self.layout: Layout | None = None
        self.port = config.port
        self.region = region_for(config)
        self._channels: list[_Channel] = []
        self._server: asyncio.Server | None = None
        self._sessions: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self) -> None:
        cfg = self.config
        if cfg.secret_file is not None:
            auth.load_secret(cfg.secret_file)  # a missing or open secret stops us here
        self.layout = cfg.geometry.plan(instance=secrets.randbits(63) | 1)
        address = self.kernel.open(self.layout, self.region)
        self.region.open(self.kernel, address, self.layout.region_size)
        # Epochs start at a random point, so that a restarted peer never reuses the
        # epoch of its previous life (whose records a daemon could still be holding).
        self._channels = [_Channel(i, HostMailbox(self.kernel.mailbox, i),
                                   epoch=secrets.randbelow(1 << 30))
                          for i in range(len(self.layout.channels))]
        await self.kernel.start()
        self._server = await asyncio.start_server(self._session, cfg.host, cfg.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("peer ready on %s:%d transport=%s channels=%d region=%d bytes",
                 cfg.host, self.port, cfg.transport, len(self._channels), self.layout.region_size)

    # -- control plane ------------------------------------------------------

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._sessions.add(task)
        channel: _Channel | None = None
        session = object()  # what holds the channel: only its end detaches it
        try:
            if self._closing:  # accepted just before close(): nothing to serve
                return
            first = await messages.receive(reader)
            if first.get("op") == "stats":
                await messages.send(writer, {"op": "stats", "channels": self.stats(),
                                             "kernel": self.kernel.kernel_stats()})
                return
            hello = messages.Hello.from_dict(first)
            if not await self._authenticate(hello, reader, writer):
                return
            channel = self._grant(hello, session)
            welcome = await self._attach(channel, hello)
            await messages.send(writer, welcome.to_dict())
            log.info("channel %d attached in epoch %d to %s (%s)", channel.index, channel.epoch,
                     writer.get_extra_info("peername"), hello.client)
            lost = await self._hold(channel, reader)
            if lost is not None:
                log.error("channel %d (epoch %d): %s; closing its control connection",
                          channel.index, channel.epoch, lost)
        except LayoutMismatch as exc:
            log.warning("control session refused: %s", exc)
            with contextlib.suppress(ConnectionError):
                await messages.send(writer, messages.refuse(str(exc), version=True))
        except DpuFrontendError as exc:
            log.warning("control session refused: %s", exc)
            with contextlib.suppress(ConnectionError):
                await messages.send(writer, messages.refuse(str(exc)))
        except ConnectionError:
            pass
        except TimeoutError:
            log.warning("control session from %s: no answer to the challenge in %.0f s",
                        writer.get_extra_info("peername"), AUTH_TIMEOUT_S)
        finally:
            writer.close()  # first: the daemon stops using the channel at EOF
            try:
                if channel is not None:
                    await self._detach(channel, session)
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
            finally:
                if task is not None:
                    self._sessions.discard(task)

    async def _authenticate(self, hello: messages.Hello, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> bool:
        """With a secret configured: the challenge-response of control/auth.py, before
        anything is granted. False (the hello refused, code ``auth``) unless the daemon
        proved the secret."""
        path = self.config.secret_file
        if path is None:
            return True
        secret = auth.load_secret(path)  # re-read: replacing the file rotates the secret
        who = writer.get_extra_info("peername")
        if hello.nonce is None:
            log.warning("control session from %s refused: no authentication", who)
            await messages.send(writer, messages.refuse(
                "this peer requires authentication: set peer_secret_file", auth=True))
            return False
        peer_nonce = auth.nonce()
        await messages.send(writer, messages.Challenge(
            peer_nonce, auth.proof(secret, "peer", hello.nonce, peer_nonce)).to_dict())
        async with asyncio.timeout(AUTH_TIMEOUT_S):
            answer = messages.Auth.from_dict(await messages.receive(reader))
        if not auth.verify(secret, "daemon", hello.nonce, peer_nonce, answer.proof):
            log.warning("control session from %s refused: wrong secret", who)
            await messages.send(writer, messages.refuse("authentication failed", auth=True))
            return False
        return True

    def _grant(self, hello: messages.Hello, session: object) -> _Channel:
        if hello.protocol != self.layout_version:
            raise LayoutMismatch(version_refusal(hello.protocol))
        if hello.transport != self.config.transport:
            raise PeerError(f"this peer serves over {self.config.transport}, not {hello.transport}")
        failure = self.kernel.failure()
        if failure is not None:
            raise PeerError(failure)
        free = [c for c in self._channels if c.owner is None]
        if hello.channel >= 0:
            free = [c for c in free if c.index == hello.channel]
            if hello.channel >= len(self._channels):
                raise PeerError(f"channel {hello.channel} does not exist "
                                f"(this peer has {len(self._channels)})")
        if not free:
            raise PeerError("no free channel: every ring pair is attached to a daemon worker")
        free[0].owner = session
        return free[0]

    async def _attach(self, channel: _Channel, hello: messages.Hello) -> messages.Welcome:
        layout = self.layout
        if layout is None:
            raise PeerError("peer not started")
        # The epoch is spent as soon as it is posted: a kernel that runs this ATTACH
        # late (after a timeout here) must not make the next one a BAD_EPOCH.
        epoch = channel.epoch = channel.epoch + 1
        channel.attached = True  # from now on the session's end posts a DETACH
        ack = await self._command(channel, Command.ATTACH, epoch)
        if ack.error != MailboxError.OK or ack.state != ChannelState.ATTACHED:
            raise PeerError(f"the kernel refused to attach channel {channel.index} in epoch "
                            f"{epoch}: {ack.error.name}")
        channel.attachments += 1
        link = channel.link = self.region.link(hello.qp)
        return messages.Welcome(
            channel=channel.index, instance=layout.instance, region_size=layout.region_size,
            region=link.region, epoch=epoch, qp=link.qp_info, model=self.model,
        )

    async def _hold(self, channel: _Channel, reader: asyncio.StreamReader) -> str | None:
        """Until the daemon closes the connection (None), or the kernel stops serving
        ``channel``: why (its failure, or a DETACH it ran on its own). Then the session
        must end at once (docs/protocol.md, section 8)."""
        closed = asyncio.ensure_future(reader.read())  # no message follows the welcome
        try:
            while not closed.done():
                failure = self.kernel.failure()
                if failure is not None:
                    return failure
                if not channel.mailbox.attached():
                    return "the kernel detached the channel"
                await asyncio.wait({closed}, timeout=KERNEL_WATCH_S)
            closed.result()  # a connection reset: ConnectionError
            return None
        finally:
            closed.cancel()

    async def _detach(self, channel: _Channel, session: object) -> None:
        """End ``session``'s hold on ``channel``, if it still holds it: only the owner
        detaches, so a session that ends late can never detach the next owner's
        attachment (nor free its channel)."""
        if channel.owner is not session:
            log.error("channel %d: a session that no longer holds it ended; left alone",
                      channel.index)
            return
        # The link goes first: once it is gone no WRITE of this session can land, so
        # the next ATTACH's reset is final. A session never welcomed has none.
        link, channel.link = channel.link, None
        try:
            if link is not None:
                await self.region.unlink(link)
            if channel.attached:
                await self._command(channel, Command.DETACH)
                channel.attached = False
                log.info("channel %d detached (epoch %d)", channel.index, channel.epoch)
        except PeerError as exc:
            # The kernel may still run the DETACH later; the channel stays out of
            # service until it has acknowledged every command (see _command).
            log.error("channel %d: %s", channel.index, exc)
        finally:
            channel.owner = None

    async def _command(self, channel: _Channel, command: Command, epoch: int = 0) -> Ack:
        """Post ``command`` and wait for its acknowledgement.

        The mailbox has one command slot: a command is never posted while an earlier
        one is unacknowledged (the kernel could read the new command word with the
        old sequence number), so a late kernel is waited for first.
        """
        if channel.unacked:
            await self._acknowledged(channel, channel.unacked, "an earlier command")
        channel.unacked = channel.mailbox.post(command, epoch)
        return await self._acknowledged(channel, channel.unacked, command.name)

    async def _acknowledged(self, channel: _Channel, seq: int, what: str) -> Ack:
        deadline = time.monotonic() + MAILBOX_TIMEOUT_S
        while (ack := channel.mailbox.acked(seq)) is None:
            failure = self.kernel.failure()
            if failure is not None:
                raise PeerError(failure)
            if time.monotonic() > deadline:
                raise PeerError(f"the kernel did not run {what} on channel "
                                f"{channel.index} within {MAILBOX_TIMEOUT_S} s")
            await asyncio.sleep(MAILBOX_POLL_S)
        channel.unacked = 0
        return ack

    @property
    def layout_version(self) -> int:
        return self.layout.version_major if self.layout else 0

    def stats(self) -> list[dict[str, Any]]:
        """Per-channel counters (the ``stats`` control message; tests and operators)."""
        layout = self.layout
        return [{"channel": c.index, "attached": c.attached, "attachments": c.attachments,
                 "epoch": c.epoch,
                 "request_slots": layout.channels[c.index].req_slots if layout else 0,
                 **c.mailbox.counters(), **self.kernel.channel_stats(c.index)}
                for c in self._channels]

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        # Detach before teardown. A connection accepted just before the server closed
        # starts its handler only now: yield once, and take those too.
        while True:
            await asyncio.sleep(0)
            sessions = list(self._sessions)
            if not sessions:
                break
            for task in sessions:
                task.cancel()
            await asyncio.gather(*sessions, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        self.region.close()  # what registered the region, before the memory goes
        try:
            await self.kernel.close()
        finally:
            self.region.release()


@dataclass(frozen=True, slots=True)
class TokenSource:
    """What both peers generate from: the replay corpus tokenized with the serving
    tokenizer, its EOS ids, and the ``model`` part of the welcome."""

    corpus: list[list[int]]
    eos_token_ids: tuple[int, ...]
    model: dict[str, Any]
    vocab_size: int = 0  # the tokenizer's: structured output's automata are over it

    @classmethod
    def load(cls, config: PeerConfig, peer: str) -> TokenSource:
        vocab = Vocabulary.load(config.tokenizer or default_tokenizer_dir())
        return cls([vocab.encode(doc) for doc in default_corpus()], vocab.eos_token_ids,
                   {"eos_token_ids": list(vocab.eos_token_ids),
                    "peer": f"{peer} {__version__}", "mode": config.mode},
                   vocab.tokenizer.get_vocab_size())


def reference_model(config: PeerConfig) -> tuple[ReferenceKernel, dict[str, Any]]:
    source = TokenSource.load(config, "dpu-frontend-peer")
    return (ReferenceKernel(config, source.corpus, source.eos_token_ids,
                            vocab_size=source.vocab_size), source.model)


async def serve_peer(server: PeerServer) -> int:
    """Serve until SIGTERM/SIGINT; print the ready line and tell systemd."""
    config = server.config
    notifier = Notifier.from_environment()
    stop = stop_on_signals()
    try:
        await server.start()
        announce_ready(PEER_READY, f"{config.host}:{server.port}")
        notifier.ready(f"listening on {config.host}:{server.port}")
        await stop.wait()
        notifier.stopping("closing")
    finally:
        await server.close()
    return 0


async def run_peer(config: PeerConfig) -> int:
    """``dpu-frontend peer``: the reference peer."""
    kernel, model = reference_model(config)
    return await serve_peer(PeerServer(config, kernel, model))
