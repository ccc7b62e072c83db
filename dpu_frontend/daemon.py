"""``dpu-frontend serve``: start-up, serving, and shutdown in order.

Start: load the tokenizer and chat template, connect the GPU peers
(handshake, layout check), then bind HTTP. A lost peer is reconnected in
the background; the daemon keeps serving with the others.

Stop (SIGTERM/SIGINT): report not-ready on /health and refuse new requests
(503), stop accepting connections, give open requests ``drain_timeout_s``
to finish, end the rest with an explicit error (their generation cancelled
on the GPU side), close the HTTP server, then the peer links (QPs, MRs, PD,
context), and exit 0.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import resource
import signal

from aiohttp import web

from dpu_frontend.config import ServeConfig
from dpu_frontend.engine.pool import PeerPool
from dpu_frontend.engine.service import Service
from dpu_frontend.engine.session import Connector, PeerSession
from dpu_frontend.errors import StartupError, Unavailable
from dpu_frontend.http.app import AccessLog, BoundedRunner, create_app
from dpu_frontend.http.auth import ApiKeys
from dpu_frontend.http.tls import TlsCertificates
from dpu_frontend.lifecycle import DAEMON_READY, announce_ready, stop_on_signals
from dpu_frontend.logs import ACCESS_FORMAT
from dpu_frontend.metrics import Metrics
from dpu_frontend.sdnotify import Notifier
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.chat_template import load_chat_template
from dpu_frontend.text.tokenizer import Vocabulary

log = logging.getLogger("dpu_frontend.daemon")

#: After the drain, what aiohttp still gives handlers to write their last event.
CLOSE_GRACE_S = 5.0
GAUGE_INTERVAL_S = 1.0
#: Descriptors kept for everything but client connections: the peers' control sockets,
#: shm regions and RDMA device files, the tokenizer's files, logs, the metrics directory,
#: epoll, and the instant a connection over ``max_connections`` is open to be refused.
FILES_MARGIN = 256
#: Connections the kernel completes before the daemon accepts them. aiohttp's 128 lost
#: connections in a burst of 500 (the handshake's last ACK dropped while the queue was
#: full, the client left believing it was connected); the kernel caps this at
#: net.core.somaxconn (4096 by default since Linux 5.4).
LISTEN_BACKLOG = 4096


def release_free_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``): loading
    the tokenizer parses its 11 MB of JSON into structures that are freed again, and
    glibc kept 39 of the 86 MB that left resident. False where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False  # musl, or no libc to load: nothing to trim with
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


#: The cyclic garbage collector's thresholds while serving. A token allocates a few
#: objects the collector tracks (its record, its delta), so Python's default first
#: threshold, 700, ran a young collection every couple of hundred tokens, and the
#: older ones after them: 0.9 s of the daemon's CPU in a 15 s run at 1,000 streams
#: (6%), and most of its inter-token p99 (89 ms against 46). Objects in a cycle wait
#: longer for it; they are few, and a stream's are freed by reference counting.
GC_THRESHOLDS = (20_000, 20, 20)


def tune_garbage_collector() -> None:
    """Once started: what start built (the app, the routes, the templates, the modules)
    leaves the collector's sight for good (``gc.freeze``), and the young generation is
    collected every ``GC_THRESHOLDS[0]`` allocations."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def raise_open_files_limit() -> int:
    """Thousands of streams need thousands of sockets: lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def connection_limit(max_connections: int, files: int) -> int:
    """``max_connections``, checked against the open-files limit (0: all that it allows)."""
    allowed = files - FILES_MARGIN
    if allowed < 1 or max_connections > allowed:
        wanted = max_connections or 1
        raise StartupError(f"the open-files limit is {files}, but max_connections = "
                           f"{max_connections} needs {wanted + FILES_MARGIN} ({FILES_MARGIN} "
                           "kept for peers, tokenizer, logs): raise LimitNOFILE or lower "
                           "max_connections")
    return max_connections or allowed


class Daemon:
    def __init__(self, config: ServeConfig, connect: Connector = PeerSession.connect) -> None:
        self.config = config
        self.metrics = Metrics(config.metrics_dir)
        self.keys = ApiKeys(config)
        self.tls = (None if config.tls_cert_file is None or config.tls_key_file is None
                    else TlsCertificates(config.tls_cert_file, config.tls_key_file))
        self.pool = PeerPool(config, self.metrics, connect)
        self.service: Service | None = None
        self.runner: web.AppRunner | None = None
        self.site: web.TCPSite | None = None
        self.port = config.port
        self._gauges: asyncio.Task[None] | None = None

    async def start(self) -> None:
        cfg = self.config
        files = raise_open_files_limit()
        connections = connection_limit(cfg.max_connections, files)
        self.keys.load()
        ssl_context = self.tls.load() if self.tls is not None else None
        vocab = Vocabulary.load(cfg.tokenizer or default_tokenizer_dir())
        template = load_chat_template(vocab, cfg.chat_template)
        self.pool.limit_tokens(vocab.tokenizer.get_vocab_size())
        await self.pool.start()
        self.service = Service(cfg, vocab, self.pool, template, self.metrics)
        await self.service.warm_up()
        release_free_memory()
        # handler_cancellation: a client that disconnects cancels its handler,
        # whose cleanup sends the cancel record to the GPU side.
        app = create_app(self.service, cfg.model_name, self.metrics, self.keys)
        self.runner = BoundedRunner(app, max_connections=connections,
                                    idle_timeout_s=cfg.idle_timeout_s, metrics=self.metrics,
                                    handler_cancellation=True, shutdown_timeout=CLOSE_GRACE_S,
                                    access_log=logging.getLogger("dpu_frontend.access"),
                                    access_log_class=AccessLog, access_log_format=ACCESS_FORMAT)
        await self.runner.setup()
        # Workers share the port: the kernel spreads connections over them.
        self.site = web.TCPSite(self.runner, cfg.host, cfg.port,
                                ssl_context=ssl_context, backlog=LISTEN_BACKLOG,
                                reuse_port=cfg.worker_index is not None)
        await self.site.start()
        self.port = self.runner.addresses[0][1]
        # Set before the ready line: a supervisor's scrape sees this worker's state at once.
        self.pool.update_gauges()
        self._gauges = asyncio.create_task(self._refresh_gauges(), name="gauges")
        log.info("serving %s on %s://%s:%d (%d GPU peers, open files limit %d, at most %d "
                 "connections, API keys %s)", cfg.model_name, cfg.scheme, cfg.host, self.port,
                 len(self.pool.links), files, connections, "on" if self.keys.enabled else "off")
        announce_ready(DAEMON_READY, f"{cfg.scheme}://{cfg.host}:{self.port}")

    def reload(self) -> None:
        """SIGHUP: re-read the API keys and the TLS certificate; nothing open is dropped,
        and a file that fails to load leaves what is in use in place."""
        self.keys.reload()
        if self.tls is not None:
            self.tls.reload()

    async def drain(self) -> None:
        """Refuse new work, let open requests finish, end the rest explicitly."""
        self.pool.draining = True
        if self.site is not None:
            await self.site.stop()  # no new connections
        in_flight = self.pool.in_flight
        log.info("draining: %d open requests, up to %.1f s", in_flight,
                 self.config.drain_timeout_s)
        try:
            async with asyncio.timeout(self.config.drain_timeout_s):
                await self.pool.wait_idle()
        except TimeoutError:
            left = self.pool.in_flight
            log.warning("drain timeout: ending %d open requests with an error", left)
            self.pool.abort(Unavailable("the daemon is shutting down: the drain timeout ended "
                                        "this request"), reason="drain_timeout")

    async def _refresh_gauges(self) -> None:
        """Every second, so that the other workers see this one's state at their scrapes."""
        while True:
            await asyncio.sleep(GAUGE_INTERVAL_S)
            self.pool.update_gauges()

    async def stop(self) -> None:
        if self._gauges is not None:
            self._gauges.cancel()
        if self.runner is not None:
            await self.runner.cleanup()
        await self.pool.close()
        if self.service is not None:
            self.service.close()


async def serve(config: ServeConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain and stop; exit status 0.

    Under systemd (``Type=notify``): READY=1 once the peers are connected and
    HTTP listens, WATCHDOG=1 from the event loop, STOPPING=1 when the drain
    starts.
    """
    daemon = Daemon(config)
    notifier = Notifier.from_environment()
    stop = stop_on_signals()
    # SIGHUP re-reads the API keys and the TLS certificate: cheap (small files), and the
    # default action would end the process.
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, daemon.reload)
    watchdog: asyncio.Task[None] | None = None
    try:
        await daemon.start()
        tune_garbage_collector()
        up = sum(link.up for link in daemon.pool.links)
        notifier.ready(f"serving {config.model_name} on port {daemon.port}, "
                       f"{up}/{len(daemon.pool.links)} GPU peers up")
        watchdog = asyncio.create_task(notifier.watchdog(), name="watchdog")
        await stop.wait()
        notifier.stopping(f"draining {daemon.pool.in_flight} open requests")
        await daemon.drain()
        return 0
    finally:
        if watchdog is not None:
            watchdog.cancel()
        await daemon.stop()


