"""A peer's control plane: against a kernel that acknowledges its mailbox late, one that
detaches a channel on its own, and the reference kernel failing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from dpu_frontend.config import PeerAddress, PeerConfig, ServeConfig
from dpu_frontend.control import messages
from dpu_frontend.engine.session import PeerSession
from dpu_frontend.errors import PeerError
from dpu_frontend.peer import region as region_mod
from dpu_frontend.peer import server as server_mod
from dpu_frontend.peer.generator import TokenGenerator
from dpu_frontend.peer.kernel import PeerKernel
from dpu_frontend.peer.reference import ReferenceKernel
from dpu_frontend.peer.region import Region, RegionAddress
from dpu_frontend.peer.server import PeerServer
from dpu_frontend.ring import Geometry, Layout, SamplingParams
from dpu_frontend.ring.mailbox import ChannelState, Command, KernelMailbox, MailboxError, mailbox_area_size
from dpu_frontend.ring.memory import AtomicMemory
from tests.raw_ring import poll_until_final, write_unknown_kind

#: The daemon notices a silent peer at its heartbeat deadline; a peer that stops
#: serving a channel must close its control connection well before.
DAEMON_DEADLINE_S = ServeConfig().peer_timeout_s
GEOMETRY = Geometry(max_sequences=4, resp_slots=8)


class SlowKernel(PeerKernel):
    """Runs mailbox commands only while ``awake``, as a kernel stuck in a long step."""

    def __init__(self, *, awake: bool = False) -> None:
        self.awake = awake
        self.epochs: list[int] = []
        self.detaches = 0
        self._mailbox: AtomicMemory | None = None
        self._task: asyncio.Task[None] | None = None

    def open(self, layout: Layout, region: Region) -> RegionAddress:
        self._mailbox = AtomicMemory(bytearray(mailbox_area_size(len(layout.channels))))
        return RegionAddress()

    @property
    def mailbox(self) -> AtomicMemory:
        assert self._mailbox is not None
        return self._mailbox

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        box, epoch = KernelMailbox(self.mailbox, 0), 0
        while True:
            command = box.pending() if self.awake else None
            if command is not None:
                seq, what, arg = command
                ok = what != Command.ATTACH or arg > epoch
                if what == Command.ATTACH and ok:
                    epoch = arg
                    self.epochs.append(arg)
                self.detaches += what == Command.DETACH
                state = ChannelState.ATTACHED if what == Command.ATTACH and ok else (
                    ChannelState.DETACHED)
                box.ack(seq, state, MailboxError.OK if ok else MailboxError.BAD_EPOCH)
            await asyncio.sleep(0.001)

    def detach_on_its_own(self) -> None:
        KernelMailbox(self.mailbox, 0).detached()

    def failure(self) -> str | None:
        return None

    def channel_stats(self, channel: int) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def attach(port: int) -> tuple[messages.Welcome, asyncio.StreamReader,
                                     asyncio.StreamWriter]:
    """A daemon's hello; the connection stays open (the channel in use)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await messages.send(writer, messages.Hello("shm").to_dict())
        return messages.Welcome.from_dict(await messages.receive(reader)), reader, writer
    except BaseException:
        writer.close()
        raise


async def hello(port: int) -> messages.Welcome:
    """A hello, and the connection closed at once."""
    welcome, _, writer = await attach(port)
    writer.close()
    await writer.wait_closed()
    return welcome


async def closed_by_the_peer(reader: asyncio.StreamReader) -> None:
    """The peer closes the connection before the daemon's deadline would have run out."""
    async with asyncio.timeout(DAEMON_DEADLINE_S):
        assert await reader.read() == b""


async def freed(peer: PeerServer, index: int = 0) -> None:
    async with asyncio.timeout(10):
        while peer._channels[index].granted:  # noqa: ASYNC110 - the server's own state
            await asyncio.sleep(0.01)


async def test_an_attach_acknowledged_late_does_not_poison_the_channel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel runs an ATTACH after the control plane gave up on it: the next
    daemon still gets the channel, in a later epoch (never a BAD_EPOCH loop)."""
    monkeypatch.setattr(server_mod, "MAILBOX_TIMEOUT_S", 0.05)
    monkeypatch.setattr(region_mod, "SHM_DETACH_GRACE_S", 0.0)
    kernel = SlowKernel()
    peer = PeerServer(PeerConfig(transport="shm", port=0, geometry=GEOMETRY), kernel, {})
    await peer.start()
    try:
        with pytest.raises(PeerError, match="did not run ATTACH"):
            await hello(peer.port)
        await freed(peer)  # the session gives up on its DETACH too, then frees the channel
        kernel.awake = True  # the long step ends: the stale ATTACH runs now
        welcome = await hello(peer.port)
        # The stale ATTACH ran, then this one in the next epoch, acknowledged OK.
        assert kernel.epochs == [welcome.epoch - 1, welcome.epoch]
    finally:
        await peer.close()


async def test_a_channel_the_kernel_detached_on_its_own_loses_its_connection_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon learns it from the connection's end, not from its heartbeat deadline;
    the next hello attaches the channel again, in a later epoch."""
    monkeypatch.setattr(region_mod, "SHM_DETACH_GRACE_S", 0.0)
    kernel = SlowKernel(awake=True)
    peer = PeerServer(PeerConfig(transport="shm", port=0, geometry=GEOMETRY), kernel, {})
    await peer.start()
    try:
        welcome, reader, writer = await attach(peer.port)
        try:
            kernel.detach_on_its_own()
            await closed_by_the_peer(reader)
        finally:
            writer.close()
        await freed(peer)
        again = await hello(peer.port)
        assert again.channel == 0 and again.epoch > welcome.epoch
    finally:
        await peer.close()


async def test_a_stale_session_never_detaches_the_channel_another_one_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(region_mod, "SHM_DETACH_GRACE_S", 0.0)
    kernel = SlowKernel(awake=True)
    peer = PeerServer(PeerConfig(transport="shm", port=0, geometry=GEOMETRY), kernel, {})
    await peer.start()
    channel = peer._channels[0]
    try:
        _, _, writer = await attach(peer.port)
        stale = channel.owner
        writer.close()
        await freed(peer)
        assert kernel.detaches == 1
        welcome, reader, writer = await attach(peer.port)
        try:
            # The first session's end, once more, late: the channel is another's now.
            await peer._detach(channel, stale)
            assert kernel.detaches == 1 and channel.granted
            [stats] = peer.stats()
            assert stats["attached"] and stats["epoch"] == welcome.epoch
            assert not reader.at_eof()
        finally:
            writer.close()
    finally:
        await peer.close()


async def test_a_failed_kernel_closes_every_control_connection_at_once(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The reference kernel fails under two attached channels: both connections close
    before the daemon's deadline, and a hello is refused, saying why."""
    config = PeerConfig(transport="shm", port=0, shm_path=tmp_path / "region",
                        geometry=Geometry(channels=2, max_sequences=4, resp_slots=8))
    peer = PeerServer(config, ReferenceKernel(config, [[5, 6, 7]], (0,)), {})
    await peer.start()
    try:
        sessions = [await attach(peer.port) for _ in range(2)]
        try:
            assert sorted(welcome.channel for welcome, _, _ in sessions) == [0, 1]

            def broken(self: TokenGenerator, now: float, budget: int) -> list[Any]:
                raise RuntimeError("the generator broke")

            monkeypatch.setattr(TokenGenerator, "step", broken)  # its next step raises
            for _, reader, _ in sessions:
                await closed_by_the_peer(reader)
        finally:
            for _, _, writer in sessions:
                writer.close()
        with pytest.raises(PeerError, match=r"reference kernel failed: .*the generator broke"):
            await hello(peer.port)
    finally:
        await peer.close()


async def test_a_bad_record_is_skipped_and_its_channel_keeps_its_connection(
        tmp_path: Path) -> None:
    """A record the kernel cannot accept is counted and skipped (protocol.md, 5.1): no
    detach, so the control connection stays open and the channel serves the next one."""
    config = PeerConfig(transport="shm", port=0, shm_path=tmp_path / "region", geometry=GEOMETRY)
    peer = PeerServer(config, ReferenceKernel(config, [[5, 6, 7]], (0,)), {})
    await peer.start()
    address = PeerAddress("127.0.0.1", peer.port)
    session = await PeerSession.connect(ServeConfig(peers=(address,), transport="shm"), address)
    ended = asyncio.create_task(session.ended())
    try:
        await write_unknown_kind(session, 1, [1, 2, 3])
        session.channel.submit(2, [4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
        records = await poll_until_final(session, 2, limit=10)
        assert [t for r in records for t in r.tokens] == [5, 6, 7, 5]
        [stats] = peer.stats()
        assert (stats["bad_records"], stats["records"], stats["attached"]) == (1, 2, True)
        assert not ended.done()
    finally:
        ended.cancel()
        await session.close()
        await peer.close()
