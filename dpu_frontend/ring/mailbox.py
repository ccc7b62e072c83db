"""The host-to-kernel mailbox: how a launcher attaches and detaches a channel under a
running kernel (docs/protocol.md, "Lifecycle").

The mailbox area is host memory mapped into the GPU, outside the RDMA region
(the DPU never sees it): one ``dpuf_kernel_block``, then one ``dpuf_mailbox``
per channel. The host writes a command and its argument, then bumps
``command_seq`` (release); the kernel runs the command *between two engine
steps*, when none of its own stores to that channel can still be in flight,
writes ``state`` and ``error``, then sets ``ack_seq`` (release). Both ends are
here, sans-I/O over a ``RingMemory``: the launcher and the reference peer use
``HostMailbox``, the reference peer's engine loop plays the kernel with
``KernelMailbox``, and the CUDA kernel implements the same bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dpu_frontend.ring.cstruct import CStruct
from dpu_frontend.ring.gpu import RingMemory

KERNEL_BLOCK = CStruct("dpuf_kernel_block", (
    ("stop", "Q"), ("state", "Q"), ("steps", "Q"), ("heartbeats", "Q"), ("error", "Q"),
), 128)
COUNTERS = ("records", "admitted", "completed", "cancelled", "bad_records", "tokens",
            "published", "ring_full_waits")
MAILBOX = CStruct("dpuf_mailbox", (
    ("command_seq", "Q"), ("command", "I"), ("arg_epoch", "I"), ("ack_seq", "Q"),
    ("state", "I"), ("error", "I"), *((name, "Q") for name in COUNTERS),
), 128)


class Command(enum.IntEnum):
    NONE = 0
    ATTACH = 1  # reset the channel to a new epoch and serve it
    DETACH = 2  # drop the channel's sequences and stop reading its request ring


class ChannelState(enum.IntEnum):
    DETACHED = 0
    ATTACHED = 1


class MailboxError(enum.IntEnum):
    OK = 0
    BAD_COMMAND = 1
    BAD_EPOCH = 2  # an ATTACH whose epoch does not follow the channel's


class KernelState(enum.IntEnum):
    STARTING = 0
    RUNNING = 1
    STOPPED = 2
    FAILED = 3


def mailbox_area_size(channels: int) -> int:
    return KERNEL_BLOCK.size + channels * MAILBOX.size


def _offset(channel: int, field: str) -> int:
    return KERNEL_BLOCK.size + channel * MAILBOX.size + MAILBOX.offset(field)


@dataclass(frozen=True, slots=True)
class Ack:
    state: ChannelState
    error: MailboxError


class HostMailbox:
    """The launcher's end of one channel's mailbox."""

    def __init__(self, mem: RingMemory, channel: int) -> None:
        self.mem = mem
        self.channel = channel
        self._seq = mem.load_acquire(_offset(channel, "command_seq"))

    def post(self, command: Command, epoch: int = 0) -> int:
        """Write a command; return the sequence number its ack will carry."""
        mem, ch = self.mem, self.channel
        # command and arg_epoch share one aligned word: one plain store for both.
        mem.write(_offset(ch, "command"), (int(command) | epoch << 32).to_bytes(8, "little"))
        self._seq += 1
        mem.store_release(_offset(ch, "command_seq"), self._seq)  # after the argument
        return self._seq

    def acked(self, seq: int) -> Ack | None:
        """The kernel's answer to command ``seq``, or None while it has not run it."""
        mem, ch = self.mem, self.channel
        if mem.load_acquire(_offset(ch, "ack_seq")) < seq:
            return None
        word = int.from_bytes(mem.read(_offset(ch, "state"), 8), "little")
        return Ack(ChannelState(word & 0xFFFF_FFFF), MailboxError(word >> 32))

    def attached(self) -> bool:
        """Whether the kernel's last stored ``state`` is ATTACHED. A kernel that stops
        serving a channel on its own stores DETACHED without an acknowledgement."""
        word = self.mem.read(_offset(self.channel, "state"), 4)
        return int.from_bytes(word, "little") == ChannelState.ATTACHED

    def counters(self) -> dict[str, int]:
        data = self.mem.read(_offset(self.channel, "records"), 8 * len(COUNTERS))
        return {name: int.from_bytes(data[8 * i:8 * i + 8], "little")
                for i, name in enumerate(COUNTERS)}


class KernelMailbox:
    """The kernel's end (played by the reference peer's engine loop)."""

    def __init__(self, mem: RingMemory, channel: int) -> None:
        self.mem = mem
        self.channel = channel
        self._acked = 0

    def pending(self) -> tuple[int, Command | int, int] | None:
        """(seq, command, epoch) of a command not yet acknowledged, or None."""
        seq = self.mem.load_acquire(_offset(self.channel, "command_seq"))
        if seq == self._acked:
            return None
        word = int.from_bytes(self.mem.read(_offset(self.channel, "command"), 8), "little")
        command = word & 0xFFFF_FFFF
        known = command in Command._value2member_map_
        return seq, Command(command) if known else command, word >> 32

    def detached(self) -> None:
        """Stop serving the channel on its own (no command): state DETACHED, no ack.
        The control plane then closes the channel's control connection."""
        self.mem.write(_offset(self.channel, "state"),
                       int(ChannelState.DETACHED).to_bytes(4, "little"))

    def ack(self, seq: int, state: ChannelState, error: MailboxError) -> None:
        mem, ch = self.mem, self.channel
        mem.write(_offset(ch, "state"), (int(state) | int(error) << 32).to_bytes(8, "little"))
        self._acked = seq
        mem.store_release(_offset(ch, "ack_seq"), seq)

    def publish_counters(self, counters: dict[str, int]) -> None:
        values = [counters.get(name, 0) for name in COUNTERS]
        self.mem.write(_offset(self.channel, "records"),
                       b"".join(v.to_bytes(8, "little") for v in values))
