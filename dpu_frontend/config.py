"""Typed, frozen configuration, built once at the edge (the CLI) and passed down.

Every field is validated in ``__post_init__`` with a ``ValueError`` that names
it; nothing reads the environment at the point of use. A setting's default
and its explanation are written once, here, on its field (``about``): the
file/environment keys, the ``serve`` flags and their help are derived from
them (``settings.SETTINGS``), and so are the peers' flags (``flags.Flags``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from dpu_frontend.flags import about, flat, none_if_empty
from dpu_frontend.ring import Geometry

DEFAULT_TRANSPORT = "verbs"  # the product; shm is its shared-memory twin for development
TRANSPORTS = (DEFAULT_TRANSPORT, "shm")
PEER_MODES = ("replay", "echo")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")


#: The shortest wait between two ring polls: uvloop's timers have millisecond
#: resolution, and ``asyncio.sleep(0.0005)`` under it returns at once (measured:
#: 355,000 turns a second, a whole core with streams open and nothing due).
MIN_POLL_INTERVAL_S = 0.001


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


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


#: Where the reference peer listens and the daemon looks for it, unless told otherwise.
DEFAULT_PEER = PeerAddress("127.0.0.1", 18515)


@dataclass(frozen=True, slots=True)
class RdmaConfig:
    """Which RDMA device and GID to use (verbs transport only)."""

    # The peers' flags read an empty value as the daemon's settings do: not set.
    device: str | None = field(default=None, metadata=about(
        "RDMA device name (rxe0, mlx5_2)", none="the one matching --rdma-ip, or the only device",
        parse=none_if_empty(str)))
    ip: str | None = field(default=None, metadata=about(
        "RoCE address whose GID to use (selects device and GID index)",
        none="the device's IPv4-mapped RoCE v2 GID", parse=none_if_empty(str)))

    def __post_init__(self) -> None:
        if self.ip is not None:
            try:
                ipaddress.ip_address(self.ip)
            except ValueError as exc:
                raise ValueError(f"rdma ip: {exc}") from exc


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """How the CLI sets up logging (settings ``log_level``, ``log_format``); no part of the daemon's."""

    level: str = field(default="INFO", metadata=about("log level", choices=LOG_LEVELS))
    format: str = field(default="text", metadata=about("text, or json (JSON lines)",
                                                       choices=LOG_FORMATS))

    def __post_init__(self) -> None:
        _check_choice("log_level", self.level, LOG_LEVELS)
        _check_choice("log_format", self.format, LOG_FORMATS)


REASONING_PARSERS = ("auto", "none", "qwen3")
TOOL_CALL_PARSERS = ("auto", "none", "hermes", "llama3_json")

#: Settings the daemon and the peers share: one explanation for both sides' flags.
_TRANSPORT = about("verbs (RDMA, the product) or shm (shared-memory twin)", choices=TRANSPORTS)
_TOKENIZER = about("tokenizer.json or a directory holding it",
                   none="the bundled Qwen3 tokenizer", parse=none_if_empty(Path))


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """The daemon (``dpu-frontend serve``)."""

    peers: tuple[PeerAddress, ...] = field(default=(DEFAULT_PEER,), metadata=about(
        "GPU peer control address HOST:PORT; repeat for several GPUs (each request goes to "
        "the least loaded)", flag="--peer"))
    transport: str = field(default=DEFAULT_TRANSPORT, metadata=_TRANSPORT)
    rdma: RdmaConfig = field(default_factory=RdmaConfig)  # settings rdma_device, rdma_ip
    host: str = field(default="127.0.0.1", metadata=about("HTTP listen address"))
    port: int = field(default=8000, metadata=about("HTTP listen port, 0 for any"))
    model_name: str = field(default="qwen3", metadata=about("the model name clients send"))
    tokenizer: Path | None = field(default=None, metadata=_TOKENIZER)
    chat_template: Path | None = field(default=None, metadata=about(
        "a .jinja chat template", none="the tokenizer config's chat_template"))
    reasoning_parser: str = field(default="auto", metadata=about(
        "split chat answers' reasoning into reasoning_content: qwen3 (a <think> block), "
        "none, or auto (qwen3 where the chat template writes </think>)",
        choices=REASONING_PARSERS))
    tool_call_parser: str = field(default="auto", metadata=about(
        "parse tool calls out of chat answers for requests with tools: hermes "
        "(<tool_call>{json}</tool_call>, Qwen3's and Hermes'), llama3_json (an answer of "
        "JSON calls, Llama 3.1's), none, or auto (hermes where the chat template writes "
        "<tool_call>, llama3_json where it writes <|python_tag|>)",
        choices=TOOL_CALL_PARSERS))
    max_model_len: int | None = field(default=None, metadata=about(
        "context length", none="the tokenizer config's model_max_length"))
    channel: int = field(default=-1, metadata=about(
        "the peers' ring pair to claim, -1 for any free one"))
    poll_interval_s: float = field(default=0.001, metadata=about(
        "seconds between response-ring polls while requests are in flight and none "
        "brought a record (at least 0.001: the event loop's timers count whole "
        "milliseconds, a shorter wait does not wait)"))
    idle_poll_interval_s: float = field(default=0.01, metadata=about(
        "seconds between response-ring polls with nothing in flight"))
    poll_cadence: bool = field(default=True, metadata=about(
        "learn the period at which a GPU peer's records come (its decode steps) and skip "
        "the polls between its bursts, polling every poll interval again from just "
        "before the next is due (on or off)"))
    connect_timeout_s: float = field(default=10.0, metadata=about(
        "seconds a peer's TCP connect, and each handshake message, may take"))
    # A peer is failed when its heartbeat stops or an RDMA operation does not
    # complete for this long; every open stream then gets its error.
    peer_timeout_s: float = field(default=1.0, metadata=about(
        "seconds without a heartbeat or an RDMA completion before a peer is failed and its "
        "streams end with an error"))
    reconnect_initial_s: float = field(default=0.1, metadata=about(
        "first wait before reconnecting to a failed peer, seconds; it doubles up to "
        "--reconnect-max"))
    reconnect_max_s: float = field(default=5.0, metadata=about(
        "longest wait between reconnection attempts, seconds"))
    # Admission: the queue in front of each peer's request ring.
    max_queued_requests: int = field(default=1024, metadata=about(
        "requests waiting for each peer's request ring before 429"))
    max_queued_prompt_tokens: int = field(default=1 << 20, metadata=about(
        "prompt tokens waiting for each peer's request ring before 429"))
    # 4 MiB holds a prompt of the whole 131072-token context at 32 bytes a token:
    # text takes ~4 bytes a token, token ids in JSON up to 7, \u-escaped CJK ~9.
    max_request_bytes: int = field(default=4 << 20, metadata=about(
        "largest request body in bytes; a larger one gets 413 before the rest is read "
        "(the default holds a 131072-token prompt at 32 bytes a token)"))
    # Who may use the API, and how much of it (dpu_frontend/http/auth.py, docs/operations.md).
    api_key_file: Path | None = field(default=None, metadata=about(
        "file of API keys clients send as 'Authorization: Bearer KEY', one a line, # comments "
        "(mode 600; re-read on SIGHUP)", none="only api_keys; neither: no authentication"))
    # repr=False: a key must never reach a log line through the config's repr.
    api_keys: str | None = field(default=None, repr=False, metadata=about(
        "comma-separated API keys; set it as DPU_FRONTEND_API_KEYS, since a flag's value is "
        "visible to every local user in ps", none="only api_key_file"))
    auth_exempt_paths: str = field(default="/health,/metrics", metadata=about(
        "comma-separated paths served without an API key (probes and scrapes); empty: none"))
    # TLS on the client listener (dpu_frontend/http/tls.py): both files or neither.
    tls_cert_file: Path | None = field(default=None, metadata=about(
        "PEM certificate chain (leaf first) for HTTPS on the client listener; re-read on "
        "SIGHUP, open streams keep theirs", none="plain HTTP"))
    tls_key_file: Path | None = field(default=None, metadata=about(
        "PEM private key of tls_cert_file (not readable by others: mode 600 or 640)",
        none="plain HTTP"))
    max_streams_per_key: int = field(default=0, metadata=about(
        "completions one API key may have in flight in each worker before 429; 0: no limit"))
    max_connections: int = field(default=0, metadata=about(
        "open client connections in each worker; more are answered 503 and closed at accept; "
        "0: what the open-files limit allows"))
    idle_timeout_s: float = field(default=15.0, metadata=about(
        "seconds a client connection may go without a complete request head, idle between "
        "requests or sending its headers slowly (slowloris), before it is closed"))
    body_timeout_s: float = field(default=30.0, metadata=about(
        "seconds a client may take to send its request body after the head (a slow POST); "
        "past it, 408 and the connection closed"))
    stream_buffer_records: int = field(default=4096, metadata=about(
        "response records buffered for one slow client before it is cut off"))
    drain_timeout_s: float = field(default=30.0, metadata=about(
        "seconds open requests get to finish on SIGTERM"))
    tokenizer_threads: int = field(default=2, metadata=about(
        "threads tokenizing prompts off the event loop"))
    # Structured output: automata compiled on one thread of their own, cached by the
    # constraint's hash within these bounds (each entry: the automaton and its wire form).
    constraint_cache_entries: int = field(default=64, metadata=about(
        "compiled structured-output automata kept"))
    constraint_cache_bytes: int = field(default=512 << 20, metadata=about(
        "bytes the kept automata may take"))
    max_automaton_bytes: int = field(default=32 << 20, metadata=about(
        "the largest automaton a constraint may compile to (a 400 past it; a GPU peer may "
        "take less)"))
    constraint_compile_timeout_s: float = field(default=20.0, metadata=about(
        "seconds a constraint may take to compile (a 400 past it; the compiler's process "
        "is restarted)"))
    constraint_compiler_at_start: bool = field(default=True, metadata=about(
        "start each worker's constraint compiler (a process of about 140 MB with a Qwen3 "
        "vocabulary) when the worker starts, rather than on its first structured-output "
        "request, which would wait the second or so it takes (on or off)"))
    # Worker processes sharing the HTTP port (SO_REUSEPORT), each with its own
    # channel and QP to every peer (the peers need as many channels).
    peer_secret_file: Path | None = field(default=None, metadata=about(
        "file holding the secret shared with the GPU peers' control planes (mutual "
        "HMAC-SHA256 challenge-response; mode 600; re-read at each handshake, so replacing "
        "it rotates the secret)", none="no authentication: a peer must not require it"))
    workers: int = field(default=1, metadata=about(
        "worker processes sharing the HTTP port, each with its own channel to every peer"))
    worker_index: int | None = field(default=None, metadata=about(
        "this worker's number", none="not a worker", hidden=True))
    metrics_dir: Path | None = field(default=None, metadata=about(
        "prometheus-client multiprocess directory of the workers", none="single process",
        hidden=True))

    def __post_init__(self) -> None:
        _check_choice("transport", self.transport, TRANSPORTS)
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
        for name in ("max_queued_requests", "max_queued_prompt_tokens", "max_request_bytes",
                     "stream_buffer_records", "tokenizer_threads", "workers",
                     "constraint_cache_entries", "constraint_cache_bytes",
                     "max_automaton_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.constraint_compile_timeout_s <= 0:
            raise ValueError("constraint_compile_timeout_s must be > 0")
        if self.max_streams_per_key < 0 or self.max_connections < 0:
            raise ValueError("max_streams_per_key and max_connections must be >= 0 (0: no limit)")
        if self.idle_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("idle_timeout_s and body_timeout_s must be > 0")
        for path in self.exempt_paths:
            if not path.startswith("/"):
                raise ValueError(f"auth_exempt_paths: {path!r} is not a path (starts with /)")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser {self.reasoning_parser!r} is not one of "
                             f"{', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r} is not one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if not MIN_POLL_INTERVAL_S <= self.poll_interval_s <= 1:
            raise ValueError(f"poll_interval_s must be in [{MIN_POLL_INTERVAL_S}, 1] s: the "
                             "event loop's timers count whole milliseconds, and a shorter "
                             "wait spins a core")
        if not MIN_POLL_INTERVAL_S <= self.idle_poll_interval_s <= 10:
            raise ValueError(f"idle_poll_interval_s must be in [{MIN_POLL_INTERVAL_S}, 10] s")
        if self.connect_timeout_s <= 0:
            raise ValueError("connect_timeout_s must be > 0")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both for HTTPS, "
                             "neither for plain HTTP")
        if self.workers > 1 and self.channel >= 0:
            # Every worker claims its own channel of each peer: one fixed channel
            # would be granted to the first worker and refused to the others.
            raise ValueError(f"channel {self.channel} with workers = {self.workers}: each worker "
                             "needs a channel of its own; leave channel at -1")

    @property
    def scheme(self) -> str:
        """What clients use to reach the listener: https with a certificate, else http."""
        return "http" if self.tls_cert_file is None else "https"

    @property
    def exempt_paths(self) -> frozenset[str]:
        """``auth_exempt_paths`` as a set."""
        return frozenset(p.strip() for p in self.auth_exempt_paths.split(",") if p.strip())


#: The reference peer's rings: the default's, and structured output, with an arena that
#: holds an automaton of up to 32 MiB (the compiler's bound) beside the longest prompt.
REFERENCE_GEOMETRY = Geometry(arena_bytes=36 << 20, max_automaton_bytes=32 << 20)


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """The GPU peers' shared settings: all of the reference peer's (``dpu-frontend peer``),
    the others' less the pace they set themselves (cli.py says which)."""

    transport: str = field(default=DEFAULT_TRANSPORT, metadata=_TRANSPORT)
    rdma: RdmaConfig = field(default_factory=RdmaConfig)  # flags --rdma-device, --rdma-ip
    host: str = field(default=DEFAULT_PEER.host, metadata=about("control-plane listen address"))
    port: int = field(default=DEFAULT_PEER.port, metadata=about("control-plane port"))
    shm_path: Path = field(default=Path("/dev/shm/dpu-frontend-peer"), metadata=about(
        "the ring region's file, with --transport shm"))
    geometry: Geometry = field(default_factory=Geometry, metadata=flat())
    mode: str = field(default="replay", metadata=about(
        "replay a corpus, or echo the prompt", choices=PEER_MODES))
    tokens_per_s: float = field(default=50.0, metadata=about(
        "per-sequence generation rate, 0: as fast as the ring takes", flag="--tokens-per-s"))
    tokens_per_step: int = field(default=0, metadata=about(
        "tokens per sequence per engine step, 0: a full record"))
    tick_s: float = field(default=0.001, metadata=about(
        "period of the host loop, seconds: the reference peer's engine step, the model "
        "peer's poll while idle", metavar="SECONDS"))
    # Seconds, as every duration of the configs; milliseconds on the command line, where
    # a GPU's decode step is counted.
    step_s: float = field(default=0.0, metadata=about(
        "GPU-like decode steps: every MS milliseconds each running sequence gets one token "
        "(a burst of one-token records); replaces --tokens-per-s; 0: off", flag="--step-ms",
        metavar="MS", scale=1e3))
    batch: int = field(default=0, metadata=about(
        "with --step-ms: sequences a step decodes at most, over every channel; the rest wait "
        "for a slot; 0: no limit"))
    # 20 beats within the daemon's default 1 s peer timeout.
    heartbeat_s: float = field(default=0.05, metadata=about(
        "heartbeat period, seconds; keep the daemons' peer_timeout at least 4 times it",
        metavar="SECONDS"))
    tokenizer: Path | None = field(default=None, metadata=_TOKENIZER)
    # The secret shared with the daemons: a hello that does not prove it gets no
    # channel, no region address, no rkey and no QP (control/auth.py). An empty value
    # is a path, not "none": the peer then refuses to start rather than serve unproven
    # clients, as when an operator's variable for it is unset.
    secret_file: Path | None = field(default=None, metadata=about(
        "the secret shared with the daemons (their peer_secret_file): a hello that does not "
        "prove it gets no channel, no rkey and no QP; mode 600",
        none="none, any client on the control port is served"))

    def __post_init__(self) -> None:
        _check_choice("transport", self.transport, TRANSPORTS)
        _check_port("port", self.port)
        _check_choice("mode", self.mode, PEER_MODES)
        if self.tokens_per_s < 0:
            raise ValueError("tokens_per_s must be >= 0 (0: as fast as possible)")
        if not 0 < self.tick_s <= 1:
            raise ValueError("tick_s must be in (0, 1]")
        if not 0.001 <= self.heartbeat_s <= 1:
            raise ValueError("heartbeat_s must be in [0.001, 1]")
        if self.tokens_per_step < 0:
            raise ValueError("tokens_per_step must be >= 0 (0: a full record per step)")
        if not 0 <= self.step_s <= 10:
            raise ValueError("step_s must be in [0, 10] seconds (0: no GPU-like steps)")
        if self.batch < 0 or (self.batch and not self.step_s):
            raise ValueError("batch must be >= 0, and it needs GPU-like steps (step_s)")
