"""Several GPU peers behind one daemon: one link each, requests to the least loaded.

Load is a link's outstanding tokens (prompt + max_tokens of its open
requests); equal loads go to each peer in turn, so that requests that never
overlap still spread. Peers that are down are skipped; when none is up, or the daemon
is draining, requests get 503 at once. A full queue on one peer sends the
request to the next; all full is a 429.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence

from dpu_frontend.config import ServeConfig
from dpu_frontend.engine.link import PeerLink
from dpu_frontend.engine.request import RingRequest
from dpu_frontend.engine.session import Connector, PeerSession
from dpu_frontend.errors import (
    DpuFrontendError,
    LayoutMismatch,
    Overloaded,
    StartupError,
    Unavailable,
)
from dpu_frontend.metrics import Metrics
from dpu_frontend.ring import SamplingParams
from dpu_frontend.ring.automaton import Constraint

log = logging.getLogger("dpu_frontend.engine")


class PeerPool:
    def __init__(self, config: ServeConfig, metrics: Metrics,
                 connect: Connector = PeerSession.connect) -> None:
        self.metrics = metrics
        self.links = [PeerLink(config, address, metrics, connect) for address in config.peers]
        self.draining = False
        self._turn = itertools.count()  # who wins a tie in load: each link in turn

    def limit_tokens(self, vocab_size: int) -> None:
        """Refuse records holding token ids outside the daemon's vocabulary."""
        for link in self.links:
            link.vocab_size = vocab_size

    def update_gauges(self) -> None:
        """Refresh the state gauges (at each scrape, and every second)."""
        m = self.metrics
        queued = in_flight = 0
        for link in self.links:
            peer = str(link.address)
            m.peer_up.labels(peer).set(1.0 if link.up else 0.0)
            channel = link.channel
            in_flight += link.in_flight
            if channel is not None:
                queued += channel.waiting
                lay = channel.layout
                m.ring_occupancy.labels(peer, "request").set(channel.in_ring / lay.req_slots)
                m.ring_occupancy.labels(peer, "response").set(channel.unread / lay.resp_slots)
        m.running.set(in_flight - queued)
        m.waiting.set(queued)

    async def start(self) -> None:
        """Connect to every peer. A fatal answer from any, or none reachable, is an error."""
        results = await asyncio.gather(*(link.start() for link in self.links),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for error in errors:
            if isinstance(error, StartupError | LayoutMismatch):
                raise error
        if not self.up:
            raise errors[0]
        for link, result in zip(self.links, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("serving without GPU peer %s for now: %s", link.address, result)

    @property
    def up(self) -> bool:
        return any(link.up for link in self.links)

    @property
    def in_flight(self) -> int:
        return sum(link.in_flight for link in self.links)

    @property
    def offers_constraints(self) -> bool:
        """Whether a peer that is up decodes structured output."""
        return any(link.up and link.offers_constraints for link in self.links)

    def submit(self, prompt: Sequence[int], params: SamplingParams,
               constraint: Constraint | None = None) -> RingRequest:
        """Queue the request on the least loaded peer that is up (and, for a constrained
        one, that decodes structured output)."""
        if self.draining:
            raise Unavailable("the daemon is draining: it takes no new requests")
        turn, n = next(self._turn), len(self.links)
        candidates = sorted((i for i, link in enumerate(self.links)
                             if link.up and (constraint is None or link.offers_constraints)),
                            key=lambda i: (self.links[i].outstanding, (i - turn) % n))
        if not candidates:
            if constraint is not None and self.up:
                raise Unavailable("no GPU peer that decodes structured output is up")
            reasons = "; ".join(f"{link.address}: {link.error}" for link in self.links)
            raise Unavailable(f"no GPU peer is up ({reasons})")
        overloaded: list[Overloaded] = []
        for i in candidates:
            try:
                return self.links[i].submit(prompt, params, constraint)
            except Overloaded as exc:
                overloaded.append(exc)
        raise overloaded[-1]

    async def wait_idle(self) -> None:
        """Until no request is open on any peer (the daemon takes no new ones by then)."""
        while self.in_flight:
            for link in self.links:
                await link.idle.wait()

    def abort(self, error: DpuFrontendError, *, reason: str) -> None:
        for link in self.links:
            link.abort(error, reason=reason)

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links))
