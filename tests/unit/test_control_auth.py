"""The control plane's shared-secret authentication (control/auth.py), in memory and
against a real PeerServer over shm in this process (tests/rdma runs it over rxe)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dpu_frontend.config import PeerAddress, PeerConfig, ServeConfig
from dpu_frontend.control import auth, messages
from dpu_frontend.engine.session import PeerSession
from dpu_frontend.errors import StartupError
from dpu_frontend.peer.server import PeerServer, reference_model
from dpu_frontend.ring import Geometry


def secret_file(tmp_path: Path, text: str = "0123456789abcdef0123456789abcdef",
                mode: int = 0o600) -> Path:
    path = tmp_path / f"secret-{uuid.uuid4().hex[:6]}"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def test_the_proofs_differ_by_role_secret_and_nonce() -> None:
    s, dn, pn = b"s" * 32, auth.nonce(), auth.nonce()
    mine = auth.proof(s, "daemon", dn, pn)
    assert auth.verify(s, "daemon", dn, pn, mine)
    assert not auth.verify(s, "peer", dn, pn, mine)  # never reflected as the other side's
    assert not auth.verify(b"t" * 32, "daemon", dn, pn, mine)
    assert not auth.verify(s, "daemon", auth.nonce(), pn, mine)  # a replay on a new nonce


def test_a_secret_must_be_private_and_long_enough(tmp_path: Path) -> None:
    assert auth.load_secret(secret_file(tmp_path)) == b"0123456789abcdef0123456789abcdef"
    with pytest.raises(StartupError, match="open to others"):
        auth.load_secret(secret_file(tmp_path, mode=0o644))
    with pytest.raises(StartupError, match="at least 16"):
        auth.load_secret(secret_file(tmp_path, text="short"))
    with pytest.raises(StartupError, match="cannot read"):
        auth.load_secret(tmp_path / "missing")


@pytest.fixture
async def secret_peer(tmp_path: Path) -> AsyncIterator[PeerServer]:
    config = PeerConfig(transport="shm", port=0, secret_file=secret_file(tmp_path),
                        shm_path=Path(f"/dev/shm/dpu-frontend-auth-{os.getpid()}-"
                                      f"{uuid.uuid4().hex[:6]}"),
                        geometry=Geometry(req_slots=4, arena_bytes=4096, resp_slots=8,
                                          max_sequences=4))
    peer = PeerServer(config, *reference_model(config))
    await peer.start()
    yield peer
    await peer.close()


def daemon_config(peer: PeerServer, secret: Path | None) -> ServeConfig:
    return ServeConfig(peers=(PeerAddress("127.0.0.1", peer.port),), transport="shm",
                       peer_secret_file=secret)


def attached(peer: PeerServer) -> list[bool]:
    return [channel["attached"] for channel in peer.stats()]


async def test_the_right_secret_is_welcomed(secret_peer: PeerServer) -> None:
    secret = secret_peer.config.secret_file
    session = await PeerSession.connect(daemon_config(secret_peer, secret),
                                        PeerAddress("127.0.0.1", secret_peer.port))
    try:
        assert session.channel.epoch > 0 and attached(secret_peer) == [True]
    finally:
        await session.close()


@pytest.mark.parametrize(("daemon_secret", "message"), [
    ("other", "failed to prove the shared secret"),
    (None, "requires authentication"),
])
async def test_a_daemon_without_the_secret_gets_nothing(
        secret_peer: PeerServer, tmp_path: Path, daemon_secret: str | None,
        message: str) -> None:
    secret = secret_file(tmp_path, daemon_secret * 8) if daemon_secret else None
    with pytest.raises(StartupError, match=message):
        await PeerSession.connect(daemon_config(secret_peer, secret),
                                  PeerAddress("127.0.0.1", secret_peer.port))
    assert attached(secret_peer) == [False]


async def raw(peer: PeerServer, *frames: dict[str, object]) -> list[dict[str, object]]:
    """Send ``frames`` one after another on one connection; the answer to each."""
    reader, writer = await asyncio.open_connection("127.0.0.1", peer.port)
    answers = []
    try:
        for frame in frames:
            await messages.send(writer, frame)
            answers.append(await messages.receive(reader))
    finally:
        writer.close()
        await writer.wait_closed()
    return answers


async def test_an_unauthenticated_or_wrong_hello_gets_no_layout_rkey_or_qp(
        secret_peer: PeerServer) -> None:
    (refusal,) = await raw(secret_peer, messages.Hello("shm").to_dict())
    assert refusal == {"op": "refuse", "code": "auth",
                       "message": "this peer requires authentication: set peer_secret_file"}
    hello = messages.Hello("shm", nonce=auth.nonce()).to_dict()
    challenge, refusal = await raw(secret_peer, hello,
                                   messages.Auth(bytes(auth.PROOF_BYTES)).to_dict())
    assert set(challenge) == {"op", "nonce", "proof"}  # nothing of the region
    assert refusal == {"op": "refuse", "code": "auth", "message": "authentication failed"}
    assert attached(secret_peer) == [False]


async def test_a_peer_that_cannot_prove_the_secret_is_not_used(tmp_path: Path) -> None:
    config = PeerConfig(transport="shm", port=0,
                        shm_path=Path(f"/dev/shm/dpu-frontend-auth-{os.getpid()}-open"),
                        geometry=Geometry(req_slots=4, arena_bytes=4096, resp_slots=8,
                                          max_sequences=4))
    peer = PeerServer(config, *reference_model(config))
    await peer.start()
    try:
        with pytest.raises(StartupError, match="did not prove the shared secret"):
            await PeerSession.connect(daemon_config(peer, secret_file(tmp_path)),
                                      PeerAddress("127.0.0.1", peer.port))
    finally:
        await peer.close()
