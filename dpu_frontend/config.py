"""Typed, frozen configuration, built once at the edge (the CLI) and passed down.

Every field is validated in ``__post_init__`` with a ``ValueError`` that names
it; nothing reads the environment at the point of use.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from dpu_frontend.ring import Geometry

TRANSPORTS = ("verbs", "shm")


def _check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")


def _check_port(name: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} must be a TCP port (0-65535), got {port}")


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where a GPU peer's control plane listens: ``host:port``."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"peer address must be HOST:PORT, got {text!r}")
        host = host.strip("[]")
        address = cls(host, int(port))
        _check_port("peer port", address.port)
        return address

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class RdmaConfig:
    """Which RDMA device and GID to use (verbs transport only)."""

    device: str | None = None  # e.g. rxe0, mlx5_2
    ip: str | None = None  # the RoCE address; selects device and GID index

    def __post_init__(self) -> None:
        if self.ip is not None:
            try:
                ipaddress.ip_address(self.ip)
            except ValueError as exc:
                raise ValueError(f"rdma ip: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """The daemon (``dpu-frontend serve``)."""

    peers: tuple[PeerAddress, ...]  # one per GPU; requests go to the least loaded
    transport: str = "verbs"
    rdma: RdmaConfig = field(default_factory=RdmaConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "qwen3"
    tokenizer: Path | None = None  # None: the bundled Qwen3 tokenizer
    chat_template: Path | None = None  # None: the tokenizer config's chat_template
    max_model_len: int | None = None  # None: the tokenizer config's model_max_length
    channel: int = -1  # the peer's ring pair to claim; -1: any free one
    poll_interval_s: float = 0.0005  # between polls while requests are in flight
    idle_poll_interval_s: float = 0.01  # between polls with nothing in flight
    connect_timeout_s: float = 10.0
    # A peer is failed when its heartbeat stops or an RDMA operation does not
    # complete for this long; every open stream then gets its error.
    peer_timeout_s: float = 1.0
    reconnect_initial_s: float = 0.1  # first retry after a failure, doubling ...
    reconnect_max_s: float = 5.0  # ... up to this
    # Admission: the queue in front of each peer's request ring.
    max_queued_requests: int = 1024
    max_queued_prompt_tokens: int = 1 << 20
    stream_buffer_records: int = 4096  # per request; a slower client is cut off
    drain_timeout_s: float = 30.0
    tokenizer_threads: int = 2
    # Worker processes sharing the HTTP port (SO_REUSEPORT), each with its own
    # channel and QP to every peer (the peers need as many channels).
    workers: int = 1
    worker_index: int | None = None  # set by the supervisor for its workers
    metrics_dir: Path | None = None  # prometheus-client multiprocess directory (workers)

    def __post_init__(self) -> None:
        _check_transport(self.transport)
        _check_port("port", self.port)
        if not self.peers:
            raise ValueError("peers: at least one GPU peer address is needed")
        if len(set(self.peers)) != len(self.peers):
            raise ValueError("peers: the same address is listed twice")
        for name in ("peer_timeout_s", "reconnect_initial_s", "reconnect_max_s",
                     "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ValueError("reconnect_max_s must be >= reconnect_initial_s")
        if self.workers > 1 and self.port == 0:
            raise ValueError("workers > 1 needs a fixed port (they share it)")
        for name in ("max_queued_requests", "max_queued_prompt_tokens", "stream_buffer_records",
                     "tokenizer_threads", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if not 0 < self.poll_interval_s <= 1 or not 0 < self.idle_poll_interval_s <= 10:
            raise ValueError("poll intervals must be in (0, 1] s and (0, 10] s")
        if self.connect_timeout_s <= 0:
            raise ValueError("connect_timeout_s must be > 0")


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """The reference GPU peer (``dpu-frontend peer``)."""

    transport: str = "verbs"
    rdma: RdmaConfig = field(default_factory=RdmaConfig)
    host: str = "127.0.0.1"
    port: int = 18515
    shm_path: Path = Path("/dev/shm/dpu-frontend-peer")
    geometry: Geometry = field(default_factory=Geometry)
    mode: str = "replay"
    tokens_per_s: float = 50.0
    tokens_per_step: int = 0  # tokens per sequence per engine step; 0: a full record
    tick_s: float = 0.001
    tokenizer: Path | None = None

    def __post_init__(self) -> None:
        _check_transport(self.transport)
        _check_port("port", self.port)
        if self.mode not in ("replay", "echo"):
            raise ValueError(f"mode must be replay or echo, got {self.mode!r}")
        if self.tokens_per_s < 0:
            raise ValueError("tokens_per_s must be >= 0 (0: as fast as possible)")
        if not 0 < self.tick_s <= 1:
            raise ValueError("tick_s must be in (0, 1]")
        if self.tokens_per_step < 0:
            raise ValueError("tokens_per_step must be >= 0 (0: a full record per step)")
