"""A peer's control plane against a kernel that acknowledges its mailbox late."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dpu_frontend.config import PeerConfig
from dpu_frontend.control import messages
from dpu_frontend.errors import PeerError
from dpu_frontend.peer import server as server_mod
from dpu_frontend.peer.kernel import PeerKernel, RegionAddress
from dpu_frontend.peer.server import PeerServer
from dpu_frontend.ring import Geometry, Layout
from dpu_frontend.ring.mailbox import ChannelState, Command, KernelMailbox, MailboxError, mailbox_area_size
from dpu_frontend.ring.memory import AtomicMemory


class SlowKernel(PeerKernel):
    """Runs mailbox commands only while ``awake``, as a kernel stuck in a long step."""

    def __init__(self) -> None:
        self.awake = False
        self.epochs: list[int] = []
        self._mailbox: AtomicMemory | None = None
        self._task: asyncio.Task[None] | None = None

    def open(self, layout: Layout) -> RegionAddress:
        self._mailbox = AtomicMemory(bytearray(mailbox_area_size(len(layout.channels))))
        return RegionAddress(path="/dev/shm/unused")

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
                state = ChannelState.ATTACHED if what == Command.ATTACH and ok else (
                    ChannelState.DETACHED)
                box.ack(seq, state, MailboxError.OK if ok else MailboxError.BAD_EPOCH)
            await asyncio.sleep(0.001)

    def failure(self) -> str | None:
        return None

    def channel_stats(self, channel: int) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def hello(port: int) -> messages.Welcome:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await messages.send(writer, messages.Hello("shm").to_dict())
        return messages.Welcome.from_dict(await messages.receive(reader))
    finally:
        writer.close()
        await writer.wait_closed()


async def test_an_attach_acknowledged_late_does_not_poison_the_channel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel runs an ATTACH after the control plane gave up on it: the next
    daemon still gets the channel, in a later epoch (never a BAD_EPOCH loop)."""
    monkeypatch.setattr(server_mod, "MAILBOX_TIMEOUT_S", 0.05)
    monkeypatch.setattr(server_mod, "SHM_DETACH_GRACE_S", 0.0)
    kernel = SlowKernel()
    peer = PeerServer(PeerConfig(transport="shm", port=0,
                                 geometry=Geometry(max_sequences=4, resp_slots=8)), kernel, {})
    await peer.start()
    try:
        with pytest.raises(PeerError, match="did not run ATTACH"):
            await hello(peer.port)
        # The session gives up on its DETACH too, then frees the channel.
        async with asyncio.timeout(10):
            while peer._channels[0].granted:  # noqa: ASYNC110 - the server's own state
                await asyncio.sleep(0.01)
        kernel.awake = True  # the long step ends: the stale ATTACH runs now
        welcome = await hello(peer.port)
        # The stale ATTACH ran, then this one in the next epoch, acknowledged OK.
        assert kernel.epochs == [welcome.epoch - 1, welcome.epoch]
    finally:
        await peer.close()
