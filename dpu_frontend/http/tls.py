"""TLS on the client listener: a certificate chain and its key, reloaded on SIGHUP.

The listening socket is bound once with one ``ssl.SSLContext``, the
*listener's*. Its ``sni_callback`` runs for every ClientHello (with or
without a server name) and hands the handshake to the context loaded last,
so a reload swaps the certificate for new connections only: open
connections keep the session they negotiated, and no stream is dropped.

A reload builds the new context completely before it is used. A missing
file, a key that does not match the certificate or a key file open to
every local user is logged and the certificate in use is kept, as an API
key reload does (``http/auth.py``).
"""

from __future__ import annotations

import logging
import os
import ssl
import stat
from pathlib import Path

from dpu_frontend.errors import StartupError

log = logging.getLogger("dpu_frontend.http")


def _check_key_file(path: Path) -> None:
    """The private key must not be readable by every local user. Group read stays allowed:
    distributions hand keys to services through a group (Debian's ``ssl-cert``)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise StartupError(f"cannot read the TLS key file {path}: {exc}") from exc
    if mode & stat.S_IRWXO:
        raise StartupError(f"the TLS key file {path} is open to every user "
                           f"(mode {stat.S_IMODE(mode):o}): chmod 600 or 640 it")


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A server context for ``cert_file`` (the chain, leaf first) and ``key_file``."""
    _check_key_file(key_file)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # HTTP/1.1 only: aiohttp speaks no HTTP/2; ALPN lets clients that offer h2 fall back.
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(cert_file, key_file)
    except FileNotFoundError as exc:
        raise StartupError(f"cannot read the TLS certificate or key: {exc}") from exc
    except (ssl.SSLError, OSError) as exc:
        raise StartupError(f"cannot load the TLS certificate {cert_file} with the key "
                           f"{key_file}: {exc} (a PEM chain, leaf first, and its key)") from exc
    return context


class TlsCertificates:
    """The listener's context, and the certificate loaded last behind it."""

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self._current: ssl.SSLContext | None = None
        self._listener: ssl.SSLContext | None = None
        self.reloads = 0

    def load(self) -> ssl.SSLContext:
        """Load the files (at start; a ``StartupError`` names what is wrong) and return the
        context to bind the listener with."""
        self._current = server_context(self.cert_file, self.key_file)
        listener = server_context(self.cert_file, self.key_file)
        listener.sni_callback = self._choose
        self._listener = listener
        return listener

    def _choose(self, connection: ssl.SSLObject, server_name: str | None,
                listener: ssl.SSLContext) -> None:
        if self._current is not None:
            connection.context = self._current

    def reload(self) -> bool:
        """Re-read the files (SIGHUP). New connections get the new certificate; open ones
        keep theirs. On an error the certificate in use is kept and the error logged."""
        if self._listener is None:
            return False
        try:
            fresh = server_context(self.cert_file, self.key_file)
        except StartupError as exc:
            log.error("TLS certificate not reloaded, the one in use kept: %s", exc)
            return False
        self._current = fresh
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.cert_file)
        return True
