"""Certificates from a test CA (trustme), installed as an operator would, and what a
client is served: shared by the in-process and the process-level TLS tests."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import trustme


@dataclass
class Files:
    """The certificate and key files an operator points the daemon at."""

    cert: Path
    key: Path

    def install(self, issued: trustme.LeafCert) -> str:
        """Write ``issued`` over the files (the key mode 600); return its fingerprint."""
        issued.private_key_pem.write_to_path(str(self.key))
        self.key.chmod(0o600)
        issued.cert_chain_pems[0].write_to_path(str(self.cert))
        return fingerprint(issued.cert_chain_pems[0].bytes())


def fingerprint(pem: bytes) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem.decode())).hexdigest()


def trusting(ca: trustme.CA) -> ssl.SSLContext:
    """A client context that trusts ``ca`` (and verifies the host name)."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


def served(resp: aiohttp.ClientResponse) -> str:
    """The fingerprint of the certificate served to the connection of ``resp`` (open)."""
    assert resp.connection is not None and resp.connection.transport is not None
    return presented(resp.connection.transport.get_extra_info("ssl_object"))


def presented(ssl_object: ssl.SSLObject) -> str:
    der = ssl_object.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).hexdigest()


async def handshake(url: str, trust: ssl.SSLContext) -> str:
    """The fingerprint of the certificate a new connection to ``url`` is served."""
    host, port = url.removeprefix("https://").split(":")
    _, writer = await asyncio.open_connection(host, int(port), ssl=trust)
    try:
        return presented(writer.get_extra_info("ssl_object"))
    finally:
        writer.close()
        await writer.wait_closed()
