"""The error hierarchy.

Three families, each mapping to one HTTP status and one OpenAI-style error
body at the request boundary (``dpu_frontend.http.errors``):

* ``RequestError``: the client's mistake (bad input, too long). 4xx.
* ``PeerError``: the GPU side failed (QP in error, completion error, peer
  gone, protocol violation). 503 before the first byte, an error event after.
* ``StartupError``: configuration or environment that cannot work. The
  process exits 1 with the message.
"""

from __future__ import annotations


class DpuFrontendError(Exception):
    """Base of every error this package raises on purpose."""


class RequestError(DpuFrontendError):
    """A per-request failure caused by what the client sent."""

    status = 400
    type = "invalid_request_error"
    close_connection = False  # True: the connection is closed after the answer

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelNotFound(RequestError):
    status = 404
    type = "invalid_request_error"


class PromptTooLong(RequestError):
    """The prompt cannot fit the model context or the peer's prompt arena."""


class RequestTooLarge(RequestError):
    """The request body is larger than ``max_request_bytes`` (413)."""

    status = 413

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body larger than {limit} bytes (max_request_bytes)",
                         code="request_too_large")


class Overloaded(RequestError):
    """The queue in front of the request rings is full: try again shortly (429)."""

    status = 429
    type = "rate_limit_error"
    retry_after = 1

    def __init__(self, message: str) -> None:
        super().__init__(message, code="overloaded")


class Unauthorized(RequestError):
    """No API key, or not one of the configured ones (401, as OpenAI answers)."""

    status = 401
    challenge = "Bearer"  # the WWW-Authenticate header a 401 must carry (RFC 6750)

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


class BodyTooSlow(RequestError):
    """The request body did not arrive within ``body_timeout_s`` of its head (408: the
    server timed out waiting for the request); the connection is closed after it."""

    status = 408
    close_connection = True  # the rest of the body may still come: nothing to reuse

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request body did not arrive within {timeout_s:g} s "
                         "(body_timeout_s)", code="request_timeout")


class TooManyStreams(RequestError):
    """This API key already has ``max_streams_per_key`` completions in flight (429)."""

    status = 429
    type = "rate_limit_error"
    retry_after = 1

    def __init__(self, limit: int) -> None:
        super().__init__(f"this API key already has {limit} requests in flight "
                         "(max_streams_per_key); retry when one ends", code="too_many_streams")


class ClientTooSlow(RequestError):
    """A streaming client fell so far behind that its buffer is full; the request is
    cancelled on the GPU side rather than buffered without bound.

    A stream's status line went out long before: there this is an error event, and
    its status is never sent. A non-streamed answer has no client reading it, only
    the daemon: if its buffer overflows, the daemon fell behind (its event loop
    starved for a whole buffer of records, or ``stream_buffer_records`` below what
    one poll returns), a transient overload of the server: 503 with Retry-After.
    Not 408 (the server timed out waiting for the request), nor 429 (the client's
    rate) or any 4xx: that client did nothing wrong.
    """

    status = 503
    type = "client_too_slow"
    retry_after = 1


class PeerError(DpuFrontendError):
    """The GPU peer cannot serve: the link is down or broke mid-request."""

    status = 503
    type = "service_unavailable"
    retry_after = 1


class Unavailable(PeerError):
    """No capacity at all: no GPU peer is up, or the daemon is draining (503)."""


class ProtocolError(PeerError):
    """The peer's memory holds something the ring protocol forbids."""


class LayoutMismatch(ProtocolError):
    """The peer's layout record is not one this daemon speaks (magic, version, geometry)."""


class TransportError(PeerError):
    """An RDMA operation (or its shm twin) failed."""

    def __init__(self, message: str, *, opcode: str = "other") -> None:
        super().__init__(message)
        self.opcode = opcode  # "write", "read" or "other": the metrics label


class StartupError(DpuFrontendError):
    """A fatal configuration or environment problem found at start-up."""
