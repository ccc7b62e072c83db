"""The control plane's shared secret over real soft-RoCE: a daemon that proves it gets
a QP and the region; one that does not gets no QP, no rkey, nothing."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from dpu_frontend.config import PeerAddress, PeerConfig, RdmaConfig, ServeConfig
from dpu_frontend.engine.session import PeerSession
from dpu_frontend.errors import StartupError
from dpu_frontend.peer.region import VerbsRegion
from dpu_frontend.peer.server import PeerServer, reference_model
from dpu_frontend.ring import Geometry
from dpu_frontend.softroce.harness import RXE_IP

pytestmark = pytest.mark.rdma


#: What the VM may write.
BUILD = Path(__file__).resolve().parents[2] / "build"


def secret(where: Path, name: str, text: str) -> Path:
    where.mkdir(exist_ok=True)
    path = where / name
    path.write_text(text)
    path.chmod(0o600)
    return path


async def test_only_a_daemon_that_proves_the_secret_gets_a_qp() -> None:
    right = secret(BUILD, "dpu-frontend-test-secret", "right-secret-" * 4)
    wrong = secret(BUILD, "dpu-frontend-test-wrong", "wrong-secret-" * 4)
    config = PeerConfig(transport="verbs", rdma=RdmaConfig(ip=RXE_IP), host=RXE_IP, port=0,
                        secret_file=right,
                        geometry=Geometry(req_slots=4, arena_bytes=4096, resp_slots=8,
                                          max_sequences=4))
    peer = PeerServer(config, *reference_model(config))
    await peer.start()
    address = PeerAddress(RXE_IP, peer.port)

    def daemon(path: Path) -> ServeConfig:
        return ServeConfig(peers=(address,), transport="verbs", rdma=RdmaConfig(ip=RXE_IP),
                           peer_secret_file=path)

    try:
        with pytest.raises(StartupError, match="failed to prove the shared secret"):
            await PeerSession.connect(daemon(wrong), address)
        assert isinstance(peer.region, VerbsRegion)
        resources = peer.region.resources
        assert resources is not None and resources._qps == []
        session = await PeerSession.connect(daemon(right), address)
        try:
            assert len(resources._qps) == 1 and session.layout is not None
        finally:
            await session.close()
    finally:
        await peer.close()
        right.unlink()
        wrong.unlink()
        gc.collect()  # any verbs object left unclosed fails this test, not the next one
