"""API keys: ``Authorization: Bearer KEY``, and how many streams each key may hold.

The keys come from a file (``api_key_file``: one a line, ``#`` comments, mode
600) and/or the environment (``DPU_FRONTEND_API_KEYS``, comma-separated).
They are read at start (``ApiKeys.load``, never in a constructor) and again
on SIGHUP (``ApiKeys.reload``); with none configured the API is open.

A presented key is compared with every configured one, all of them each
time, through their SHA-256 digests and ``hmac.compare_digest``: neither the
time taken nor the first differing byte tells a caller how close it came.
The key that matched goes on the request (``API_KEY``) and never into a log:
``fingerprint`` gives the short digest prefix a log line may carry.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from dpu_frontend.config import ServeConfig
from dpu_frontend.errors import StartupError, TooManyStreams, Unauthorized
from dpu_frontend.private import read_private

log = logging.getLogger("dpu_frontend.http")

#: The key that authenticated the request (absent where none is configured or the
#: path is exempt).
API_KEY = web.RequestKey("api_key", str)
#: The endpoints that hold a stream, counted against ``max_streams_per_key``.
STREAMING_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MIN_KEY_CHARS = 16

_MISSING = ("You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
_WRONG = "Incorrect API key provided."


def fingerprint(key: str) -> str:
    """What a log line may say about a key: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def _check(key: str, where: str) -> str:
    if len(key) < MIN_KEY_CHARS or not key.isascii() or not key.isprintable() or " " in key:
        # Never the key itself in the message: it may be a real one, mistyped.
        raise StartupError(f"{where}: an API key ({len(key)} characters, {fingerprint(key)}) "
                           f"must be at least {MIN_KEY_CHARS} printable ASCII characters "
                           "without spaces (e.g. `openssl rand -hex 32`)")
    return key


def read_key_file(path: Path) -> list[str]:
    """The keys in ``path``, which only its owner may read."""
    data = read_private(path, "the API key file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StartupError(f"cannot read the API key file {path}: {exc}") from exc
    keys = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    found = [_check(key, str(path)) for key in keys if key]
    if not found:
        # An empty file must not silently open the API to everyone.
        raise StartupError(f"the API key file {path} holds no key")
    return found


def configured_keys(config: ServeConfig) -> frozenset[str]:
    keys = [_check(k.strip(), "api_keys") for k in (config.api_keys or "").split(",")
            if k.strip()]
    if config.api_key_file is not None:
        keys += read_key_file(config.api_key_file)
    return frozenset(keys)


class ApiKeys:
    """The configured keys (by SHA-256 digest), and the streams each one holds."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self._digests: dict[bytes, str] = {}
        self._streams: dict[str, int] = {}
        self._released = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def load(self) -> None:
        """Read the keys (at start): a ``StartupError`` names what is wrong."""
        keys = configured_keys(self.config)
        if self.config.max_streams_per_key and not keys:
            raise StartupError("max_streams_per_key needs API keys (api_key_file or "
                               "DPU_FRONTEND_API_KEYS): without them no request has a key")
        self._digests = {hashlib.sha256(k.encode()).digest(): k for k in keys}

    def reload(self) -> bool:
        """Re-read the keys (SIGHUP); on an error keep the ones in use and say so. Streams
        open under a removed key run to their end."""
        before = len(self._digests)
        try:
            self.load()
        except StartupError as exc:
            log.error("API keys not reloaded, the %d in use kept: %s", before, exc)
            return False
        log.info("API keys reloaded: %d (were %d)", len(self._digests), before)
        return True

    def match(self, presented: str) -> str | None:
        """The configured key equal to ``presented``, compared with every one of them."""
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for known, key in self._digests.items():
            if hmac.compare_digest(known, digest):
                found = key
        return found

    def streams(self, key: str) -> int:
        return self._streams.get(key, 0)

    async def wait_streams(self, key: str, count: int = 0) -> None:
        """Until ``key`` holds ``count`` streams or fewer: their handlers have returned."""
        while self.streams(key) > count:
            self._released.clear()
            await self._released.wait()

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        """One stream of ``key`` for the duration; 429 past ``max_streams_per_key``."""
        limit = self.config.max_streams_per_key
        held = self._streams.get(key, 0)
        if limit and held >= limit:
            log.info("key %s has %d streams open: 429", fingerprint(key), held)
            raise TooManyStreams(limit)
        self._streams[key] = held + 1
        try:
            yield
        finally:  # also when the handler is cancelled by a client that went away
            left = self._streams[key] - 1
            if left:
                self._streams[key] = left
            else:
                del self._streams[key]
            self._released.set()


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def authenticate(keys: ApiKeys) -> Middleware:
    """Inside the error boundary, which answers its errors (401 with ``WWW-Authenticate``,
    429 with ``Retry-After``) and counts them."""
    exempt = keys.config.exempt_paths

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not keys.enabled or request.path in exempt:
            return await handler(request)
        presented = _bearer(request)
        if presented is None:
            raise Unauthorized(_MISSING)
        key = keys.match(presented)
        if key is None:
            raise Unauthorized(_WRONG)
        request[API_KEY] = key
        if request.path not in STREAMING_PATHS:
            return await handler(request)
        with keys.hold(key):
            return await handler(request)

    return middleware
