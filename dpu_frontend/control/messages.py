"""Control-plane messages and their framing (4-byte big-endian length + msgpack map)."""

from __future__ import annotations

import asyncio
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from dpu_frontend.config import TRANSPORTS
from dpu_frontend.control.auth import NONCE_BYTES, PROOF_BYTES
from dpu_frontend.errors import LayoutMismatch, PeerError, StartupError
from dpu_frontend.ring.layout import VERSION_MAJOR, version_refusal

MAX_FRAME = 64 * 1024
_PEER_VERSION = re.compile(r"this peer v(\d+)")
_LENGTH = struct.Struct(">I")


async def send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    writer.write(_LENGTH.pack(len(data)) + data)
    await writer.drain()


async def receive(reader: asyncio.StreamReader) -> dict[str, Any]:
    """One frame; ``PeerError`` when the other side closed or sent garbage."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if length > MAX_FRAME:
            raise PeerError(f"control frame of {length} bytes exceeds {MAX_FRAME}")
        message = msgpack.unpackb(await reader.readexactly(length), raw=False)
    except asyncio.IncompleteReadError as exc:
        raise PeerError("control connection closed by the other side") from exc
    except (ValueError, msgpack.UnpackException) as exc:
        raise PeerError(f"undecodable control frame: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise PeerError(f"control frame is not a message: {message!r}")
    return message


@dataclass(frozen=True, slots=True)
class Hello:
    """Daemon -> peer: which channel, over which transport, and the daemon's QP."""

    transport: str  # one of config.TRANSPORTS
    channel: int = -1  # -1: any free channel
    qp: dict[str, Any] | None = None
    protocol: int = VERSION_MAJOR
    client: str = ""
    nonce: bytes | None = None  # the daemon's challenge to the peer (control/auth.py)

    def to_dict(self) -> dict[str, Any]:
        message = {"op": "hello", "protocol": self.protocol, "channel": self.channel,
                   "transport": self.transport, "qp": self.qp, "client": self.client}
        if self.nonce is not None:
            message["nonce"] = self.nonce
        return message

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> Hello:
        if m.get("op") != "hello":
            raise PeerError(f"expected hello, got {m.get('op')!r}")
        protocol, channel, transport = m.get("protocol"), m.get("channel", -1), m.get("transport")
        if not isinstance(protocol, int) or not isinstance(channel, int):
            raise PeerError("hello: protocol and channel must be integers")
        if transport not in TRANSPORTS:
            raise PeerError(f"hello: unknown transport {transport!r}")
        qp = m.get("qp")
        nonce = m.get("nonce")
        if nonce is not None and not (isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES):
            raise PeerError(f"hello: the nonce must be {NONCE_BYTES} bytes")
        return cls(transport, channel, qp if isinstance(qp, dict) else None, protocol,
                   str(m.get("client", "")), nonce)


@dataclass(frozen=True, slots=True)
class Challenge:
    """Peer -> daemon, when the peer has a secret: its nonce and its proof."""

    nonce: bytes
    proof: bytes

    def to_dict(self) -> dict[str, Any]:
        return {"op": "challenge", "nonce": self.nonce, "proof": self.proof}

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> Challenge:
        nonce, proof = m.get("nonce"), m.get("proof")
        if not (isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES
                and isinstance(proof, bytes) and len(proof) == PROOF_BYTES):
            raise PeerError("malformed challenge")
        return cls(nonce, proof)


@dataclass(frozen=True, slots=True)
class Auth:
    """Daemon -> peer: the daemon's proof, answering the challenge."""

    proof: bytes

    def to_dict(self) -> dict[str, Any]:
        return {"op": "auth", "proof": self.proof}

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> Auth:
        proof = m.get("proof")
        if m.get("op") != "auth" or not (isinstance(proof, bytes) and len(proof) == PROOF_BYTES):
            raise PeerError(f"expected auth, got {m.get('op')!r}")
        return cls(proof)


@dataclass(frozen=True, slots=True)
class Welcome:
    """Peer -> daemon: the channel granted and where its region lives."""

    channel: int
    instance: int
    region_size: int
    region: dict[str, Any]  # verbs: {"addr", "rkey"}; shm: {"path"}
    epoch: int  # the attachment: in the GPU control block and in every record
    qp: dict[str, Any] | None = None
    model: dict[str, Any] = field(default_factory=dict)
    protocol: int = VERSION_MAJOR

    def to_dict(self) -> dict[str, Any]:
        return {"op": "welcome", "protocol": self.protocol, "channel": self.channel,
                "instance": self.instance, "region_size": self.region_size,
                "region": self.region, "epoch": self.epoch, "qp": self.qp, "model": self.model}

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> Welcome:
        if m.get("op") == "refuse":
            message = str(m.get("message"))
            older = _PEER_VERSION.search(message)  # how a v1 peer words the mismatch
            if older is not None or m.get("code") == "version":
                raise LayoutMismatch(version_refusal(int(older.group(1)) if older else
                                                     m.get("protocol")))
            if m.get("code") == "auth":
                # A configuration that cannot work: the secrets differ, or only the peer has one.
                raise StartupError(f"the GPU peer refused to authenticate us: {message}")
            raise PeerError(f"peer refused the channel: {message}")
        if m.get("op") != "welcome":
            raise PeerError(f"expected welcome, got {m.get('op')!r}")
        if m.get("protocol") != VERSION_MAJOR:
            raise LayoutMismatch(version_refusal(m.get("protocol")))
        try:
            welcome = cls(int(m["channel"]), int(m["instance"]), int(m["region_size"]),
                          dict(m["region"]), int(m["epoch"]), m.get("qp"),
                          dict(m.get("model") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerError(f"malformed welcome: {exc}") from exc
        if not 1 <= welcome.epoch < 2**32:
            raise PeerError(f"malformed welcome: epoch {welcome.epoch} outside [1, 2^32)")
        return welcome


def refuse(message: str, *, version: bool = False, auth: bool = False) -> dict[str, Any]:
    """A refusal; ``version`` marks a protocol mismatch, ``auth`` a failed authentication
    (the daemon then exits)."""
    answer: dict[str, Any] = {"op": "refuse", "message": message}
    if version:
        answer |= {"code": "version", "protocol": VERSION_MAJOR}
    if auth:
        answer |= {"code": "auth"}
    return answer
