"""Mutual authentication of the control plane with a shared secret.

Whoever reaches a peer's control port and is welcomed gets a channel, the
region's address and its rkey: remote write access to GPU memory. With a
secret configured on both sides, the handshake proves knowledge of it both
ways before the peer grants anything (docs/protocol.md, section 8.1):

1. the daemon's ``hello`` carries a fresh 32-byte nonce ``Nd``;
2. the peer answers ``challenge``: its own nonce ``Np`` and
   ``HMAC-SHA256(secret, "peer" | Nd | Np)``, which the daemon checks;
3. the daemon answers ``auth`` with ``HMAC-SHA256(secret, "daemon" | Nd | Np)``,
   which the peer checks before it grants a channel.

Both nonces are fresh per connection, so a recorded exchange cannot be
replayed; proofs are compared in constant time (``hmac.compare_digest``).
The secret is read from a file at each handshake, so replacing the file on
both sides rotates it without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from dpu_frontend.errors import StartupError
from dpu_frontend.private import read_private

NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
MIN_SECRET_BYTES = 16
_CONTEXT = b"dpu-frontend control plane v1|"


def load_secret(path: Path) -> bytes:
    """The secret in ``path`` (surrounding whitespace dropped). The file must be readable
    by its owner only: a secret others can read protects nothing."""
    secret = read_private(path, "the control-plane secret").strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise StartupError(f"the control-plane secret {path} holds {len(secret)} bytes; "
                           f"at least {MIN_SECRET_BYTES} are needed (e.g. `openssl rand -hex 32`)")
    return secret


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(secret: bytes, role: str, daemon_nonce: bytes, peer_nonce: bytes) -> bytes:
    """What ``role`` ("daemon" or "peer") presents: the roles differ, so that one side's
    proof can never be reflected back as the other's."""
    message = _CONTEXT + role.encode() + b"|" + daemon_nonce + peer_nonce
    return hmac.new(secret, message, hashlib.sha256).digest()


def verify(secret: bytes, role: str, daemon_nonce: bytes, peer_nonce: bytes,
           presented: bytes) -> bool:
    return hmac.compare_digest(proof(secret, role, daemon_nonce, peer_nonce), presented)
