"""HTTPS on the client listener: the real ``Daemon`` on loopback, certificates from a test CA.

A reload (what SIGHUP calls) serves new connections with the new certificate
while a stream opened before it runs to its end on the old one; files that
fail to load change nothing.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import aiohttp
import openai
import pytest
import trustme

from dpu_frontend.daemon import Daemon
from dpu_frontend.errors import StartupError
from dpu_frontend.http.tls import TlsCertificates
from dpu_frontend.text.tokenizer import Vocabulary
from tests.engine.conftest import serve_config
from tests.engine.loopback import LoopbackPeer
from tests.http.conftest import MODEL, events, ids, next_event, start_daemon
from tests.tls import Files, handshake, served, trusting

LONG = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 1000, "stream": True}


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def files(tmp_path: Path) -> Files:
    return Files(tmp_path / "cert.pem", tmp_path / "key.pem")


@pytest.fixture
def trust(ca: trustme.CA) -> ssl.SSLContext:
    return trusting(ca)


async def start_tls(daemons: list[Daemon], peer: LoopbackPeer, files: Files) -> str:
    daemon = await start_daemon(daemons, peer, tls_cert_file=files.cert, tls_key_file=files.key)
    return f"https://127.0.0.1:{daemon.port}"


async def test_the_openai_sdk_streams_over_https(
        daemons: list[Daemon], ca: trustme.CA, files: Files, trust: ssl.SSLContext) -> None:
    files.install(ca.issue_cert("127.0.0.1"))
    url = await start_tls(daemons, LoopbackPeer(echo=3), files)
    async with openai.DefaultAsyncHttpxClient(verify=trust) as http:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", http_client=http)
        stream = await client.completions.create(model=MODEL, prompt="Hello there",
                                                 max_tokens=3, stream=True)
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_plain_http_to_the_https_listener_gets_no_answer(
        daemons: list[Daemon], peer: LoopbackPeer, ca: trustme.CA, files: Files) -> None:
    files.install(ca.issue_cert("127.0.0.1"))
    url = await start_tls(daemons, peer, files)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            await http.post(url.replace("https:", "http:") + "/v1/completions", json=LONG)
    assert not peer.gpu.arrivals  # nothing reached the GPU


async def test_a_reload_serves_the_new_certificate_and_open_streams_keep_theirs(
        daemons: list[Daemon], peer: LoopbackPeer, vocab: Vocabulary, ca: trustme.CA,
        files: Files, trust: ssl.SSLContext) -> None:
    old = files.install(ca.issue_cert("127.0.0.1"))
    url = await start_tls(daemons, peer, files)
    daemon = daemons[-1]
    connector = aiohttp.TCPConnector(ssl=trust, force_close=True)  # a connection a request
    async with aiohttp.ClientSession(connector=connector) as http:
        stream = await http.post(f"{url}/v1/completions", json=LONG)
        assert served(stream) == old
        (arrival,) = await peer.gpu.wait_for(1)
        request_id = arrival.record.request_id
        peer.gpu.emit(request_id, ids(vocab, " Once"))
        assert "error" not in await next_event(stream)

        new = files.install(ca.issue_cert("127.0.0.1", "localhost"))
        assert new != old
        daemon.reload()
        assert daemon.tls is not None and daemon.tls.reloads == 1
        assert await handshake(url, trust) == new
        async with http.get(f"{url}/health") as health:
            assert health.status == 200

        # The stream opened before the reload runs to its end on its own session.
        peer.gpu.finish(request_id, ids(vocab, " upon"))
        assert served(stream) == old
        rest = await events(stream)
        assert rest[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("damage", ["garbage", "other key", "open key", "missing"])
async def test_a_reload_that_fails_keeps_the_certificate_in_use(
        damage: str, daemons: list[Daemon], peer: LoopbackPeer, ca: trustme.CA, files: Files,
        trust: ssl.SSLContext, caplog: pytest.LogCaptureFixture) -> None:
    old = files.install(ca.issue_cert("127.0.0.1"))
    url = await start_tls(daemons, peer, files)
    daemon = daemons[-1]
    if damage == "garbage":
        files.cert.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n")
    elif damage == "other key":  # a renewal whose key was not copied
        ca.issue_cert("127.0.0.1").cert_chain_pems[0].write_to_path(str(files.cert))
    elif damage == "open key":
        files.key.chmod(0o644)
    else:
        files.key.unlink()
    daemon.reload()
    assert daemon.tls is not None and daemon.tls.reloads == 0
    assert "TLS certificate not reloaded, the one in use kept" in caplog.text
    assert await handshake(url, trust) == old


@pytest.mark.parametrize(("damage", "message"), [
    ("other key", "cannot load the TLS certificate"),
    ("open key", "is open to every user (mode 604): chmod 600 or 640 it"),
    ("missing", "cannot read the TLS key file"),
])
def test_a_certificate_that_cannot_be_served_stops_the_start(
        damage: str, message: str, ca: trustme.CA, files: Files) -> None:
    files.install(ca.issue_cert("127.0.0.1"))
    if damage == "other key":
        ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(files.key))
    elif damage == "open key":
        files.key.chmod(0o604)
    else:
        files.key.unlink()
    with pytest.raises(StartupError, match="TLS") as raised:
        TlsCertificates(files.cert, files.key).load()
    assert message in str(raised.value)


def test_a_group_readable_key_is_accepted(ca: trustme.CA, files: Files) -> None:
    """Distributions hand keys to services through a group (Debian's ssl-cert): mode 640."""
    files.install(ca.issue_cert("127.0.0.1"))
    files.key.chmod(0o640)
    TlsCertificates(files.cert, files.key).load()


@pytest.mark.parametrize("given", ["tls_cert_file", "tls_key_file"])
def test_the_certificate_and_the_key_go_together(given: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file go together"):
        serve_config(**{given: tmp_path / "x.pem"})
