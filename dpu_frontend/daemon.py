"""``dpu-frontend serve``: start-up, serving, and shutdown in order.

Start: load the tokenizer, connect the GPU peer (handshake, layout check),
then bind HTTP. Stop (SIGTERM/SIGINT): stop accepting, end open streams,
close the link (QP, MRs, PD, context), exit.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from dpu_frontend.config import ServeConfig
from dpu_frontend.engine.link import PeerLink
from dpu_frontend.engine.service import Service
from dpu_frontend.http.app import create_app
from dpu_frontend.lifecycle import stop_on_signals
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.chat_template import load_chat_template
from dpu_frontend.text.tokenizer import Vocabulary

log = logging.getLogger("dpu_frontend.http")

SHUTDOWN_TIMEOUT_S = 10.0


class Daemon:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.link = PeerLink(config)
        self.service: Service | None = None
        self.runner: web.AppRunner | None = None
        self.port = config.port

    async def start(self) -> None:
        cfg = self.config
        vocab = Vocabulary.load(cfg.tokenizer or default_tokenizer_dir())
        template = load_chat_template(vocab, cfg.chat_template)
        await self.link.start()
        self.service = Service(cfg, vocab, self.link, template)
        # handler_cancellation: a client that disconnects cancels its handler,
        # whose cleanup sends the cancel record to the GPU side.
        self.runner = web.AppRunner(create_app(self.service, cfg.model_name),
                                    handler_cancellation=True, access_log=None,
                                    shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self.runner.setup()
        site = web.TCPSite(self.runner, cfg.host, cfg.port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        log.info("serving %s on http://%s:%d", cfg.model_name, cfg.host, self.port)
        print(f"daemon listening on http://{cfg.host}:{self.port}", flush=True)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        await self.link.close()
        if self.service is not None:
            self.service.close()


async def serve(config: ServeConfig) -> int:
    """Run until SIGTERM/SIGINT (exit 0) or until the GPU peer is lost (exit 1).

    Reconnection is not built yet: a lost peer ends the process so that its
    supervisor (systemd ``Restart=on-failure``) starts it afresh.
    """
    daemon = Daemon(config)
    stop = stop_on_signals()
    try:
        await daemon.start()
        waiter = asyncio.create_task(stop.wait())
        failed = asyncio.create_task(daemon.link.down.wait())
        done, _ = await asyncio.wait({waiter, failed}, return_when=asyncio.FIRST_COMPLETED)
        for task in (waiter, failed):
            task.cancel()
        if failed in done:
            log.error("GPU peer lost: %s", daemon.link.error)
            return 1
        return 0
    finally:
        await daemon.stop()
