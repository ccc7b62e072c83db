"""Prometheus metrics, named as vLLM's with the ``dpu_frontend_`` prefix.

One ``Metrics`` object per process, built at start and passed down; its own
registry (no global state), served at ``GET /metrics``. Gauges of current
state (running and waiting requests, ring occupancy, peer up) are refreshed
from the peer pool at every scrape and every second.

With several worker processes (``serve --workers N``), prometheus-client's
multiprocess mode is on: the supervisor gives every worker the same
``PROMETHEUS_MULTIPROC_DIR`` (the library reads it when imported), each
worker's values live in files there, and whichever worker answers a scrape
aggregates all of them: counters and histograms summed, running and waiting
requests summed over live workers, ring occupancy the fullest channel, a
peer up only while every worker's link to it is up.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

PREFIX = "dpu_frontend_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
#: The daemon's own share of a token's latency: tens of microseconds when it keeps up.
DELIVERY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25,
                    0.5, 1.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000)


class Metrics:
    def __init__(self, multiprocess_dir: Path | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a sequence "
                             "(one sample per delivery, of its mean gap per token).",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.delivery = Histogram(
            PREFIX + "delivery_seconds",
            "Time from a response record's arrival in the daemon (the poll that read it) "
            "to the write of its streamed event: the frontend's own share of a token's "
            "latency (one sample per write, of its oldest record).",
            buckets=DELIVERY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from request arrival to its last byte.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Time a request waited before its record went to the ring.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.tokenize_time = Histogram(PREFIX + "tokenize_seconds", "Time to tokenize a prompt.",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.constraint_time = Histogram(
            PREFIX + "constraint_seconds",
            "Time a constrained request waited for its automaton (compiled, or from the "
            "cache), by the request field and the outcome (ready, refused).",
            ["param", "outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Histogram(PREFIX + "prompt_tokens", "Prompt tokens per request.",
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram(PREFIX + "generation_tokens",
                                           "Generated tokens per request.",
                                           buckets=TOKEN_BUCKETS, registry=r)
        self.requests = Counter(PREFIX + "requests", "Requests by endpoint, status, finish reason.",
                                ["endpoint", "status", "finish_reason"], registry=r)
        self.aborted = Counter(PREFIX + "aborted_requests",
                               "Requests ended before their sequence did, by reason.",
                               ["reason"], registry=r)
        self.disconnected = Counter(PREFIX + "disconnected_clients",
                                    "Clients that went away before their answer was complete.",
                                    registry=r)
        self.refused_connections = Counter(
            PREFIX + "refused_connections",
            "Client connections answered 503 and closed at accept: max_connections open.",
            registry=r)
        self.input_tokens = Counter(PREFIX + "input_tokens", "Prompt tokens sent to GPU peers.",
                                    registry=r)
        self.output_tokens = Counter(PREFIX + "output_tokens",
                                     "Generated tokens received from GPU peers.", registry=r)
        self.rdma_operations = Counter(PREFIX + "rdma_operations",
                                       "RDMA operations (copies under shm) by peer and opcode.",
                                       ["peer", "opcode"], registry=r)
        self.rdma_errors = Counter(PREFIX + "rdma_errors",
                                   "Failed RDMA operations by peer and opcode.",
                                   ["peer", "opcode"], registry=r)
        self.poll_cadence = Counter(
            PREFIX + "peer_poll_cadence",
            "The poll loop's waits on a GPU peer's cadence, by peer and outcome: skip (a wait "
            "past the poll interval, until just before the next burst of records is due) and "
            "late (a burst already there when a skip ended: it may have waited up to the "
            "skip; the cadence is learned again).",
            ["peer", "outcome"], registry=r)
        self.reconnects = Counter(PREFIX + "peer_reconnects", "Reconnections to a GPU peer.",
                                  ["peer"], registry=r)
        self.bad_records = Counter(
            PREFIX + "peer_bad_records",
            "Response records from a GPU peer that were refused, by peer and reason: "
            "unknown_request (dropped), token_id (fails its request), protocol (fails the link).",
            ["peer", "reason"], registry=r)
        self.running = Gauge(PREFIX + "num_requests_running",
                             "Requests whose record is in a request ring or which are generating.",
                             multiprocess_mode="livesum", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting",
                             "Requests queued in front of a request ring.",
                             multiprocess_mode="livesum", registry=r)
        self.peer_up = Gauge(PREFIX + "peer_up", "1 while the link to the GPU peer is up.",
                             ["peer"], multiprocess_mode="livemin", registry=r)
        self.ring_occupancy = Gauge(PREFIX + "ring_occupancy",
                                    "Fraction of a ring in use, per peer.", ["peer", "ring"],
                                    multiprocess_mode="livemax", registry=r)

    def request(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)

    def exposition(self) -> bytes:
        """The text a scrape gets: this process's, or every worker's aggregated."""
        if self.multiprocess_dir is None:
            return bytes(generate_latest(self.registry))
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.multiprocess_dir))  # type: ignore[no-untyped-call]
        return bytes(generate_latest(registry))


#: Samples a request keeps before adding them to their histogram (and at its end): a
#: scrape sees a long stream's latencies within this many tokens.
FLUSH_EVERY = 64


class Samples:
    """Observations of one histogram gathered in place and added to it in one go
    (``flush``, by itself every ``FLUSH_EVERY``): the same counts and sum as one
    ``observe`` each, for a fraction of the cost. The inter-token latency is sampled
    once per token of a GPU step; observing each one took 3 us of a token's 40 (a lock
    and a value per bucket), counting it here takes a bisect. This reaches into
    prometheus-client's histogram (its bounds, its per-bucket and sum values), which
    every version from the lower bound up has; tests/unit/test_metrics.py holds it to
    ``observe``'s results."""

    __slots__ = ("_bounds", "_counts", "_histogram", "_sum", "pending")

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._bounds: list[float] = histogram._upper_bounds  # ends with +Inf
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self.pending = 0

    def add(self, amount: float) -> None:
        self._counts[bisect_left(self._bounds, amount)] += 1  # the first bound >= amount
        self._sum += amount
        self.pending += 1
        if self.pending >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        buckets = self._histogram._buckets
        for i, count in enumerate(self._counts):
            if count:
                buckets[i].inc(count)
                self._counts[i] = 0
        self._histogram._sum.inc(self._sum)
        self._sum = 0.0
        self.pending = 0


@dataclass(slots=True)
class RequestTimer:
    """The latencies of one request, observed as its deltas arrive."""

    metrics: Metrics
    arrival: float
    first: float | None = None
    last: dict[int, tuple[float, int]] = field(default_factory=dict)  # choice -> (time, tokens)
    itl: Samples | None = None
    delivery: Samples | None = None

    def on_delta(self, index: int, completion_tokens: int, now: float = 0.0) -> None:
        now = now or time.monotonic()
        before_time, before_tokens = self.last.get(index, (0.0, 0))
        new = completion_tokens - before_tokens
        if new <= 0:
            return
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
        elif before_tokens:
            # Tokens arrive several to a record: one sample per delta, of the mean
            # gap per token (as vLLM samples once per engine step).
            itl = self.itl
            if itl is None:
                itl = self.itl = Samples(self.metrics.itl)
            itl.add((now - before_time) / new)
        self.last[index] = (now, completion_tokens)

    def on_write(self, received: float, now: float = 0.0) -> None:
        """Streamed events are being written for records received at ``received``."""
        if not received:
            return
        delivery = self.delivery
        if delivery is None:
            delivery = self.delivery = Samples(self.metrics.delivery)
        delivery.add((now or time.monotonic()) - received)

    def finish(self, prompt_tokens: int) -> None:
        for samples in (self.itl, self.delivery):
            if samples is not None:
                samples.flush()
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.arrival)
        generated = sum(tokens for _, tokens in self.last.values())
        m.prompt_tokens.observe(prompt_tokens)
        m.generation_tokens.observe(generated)
        m.input_tokens.inc(prompt_tokens)
        m.output_tokens.inc(generated)
