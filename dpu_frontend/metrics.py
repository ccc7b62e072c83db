"""Prometheus metrics, named as vLLM's with the ``dpu_frontend_`` prefix.

One ``Metrics`` object per daemon, built at start and passed down; its own
registry (no global state), served at ``GET /metrics``. Gauges that describe
current state (running and waiting requests, ring occupancy, peer up) are
computed at scrape time from the peer pool, so they can never drift.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "dpu_frontend_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a sequence "
                             "(one sample per delivery, of its mean gap per token).",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from request arrival to its last byte.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Time a request waited before its record went to the ring.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.tokenize_time = Histogram(PREFIX + "tokenize_seconds", "Time to tokenize a prompt.",
                                       buckets=LATENCY_BUCKETS, registry=r)
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
        self.reconnects = Counter(PREFIX + "peer_reconnects", "Reconnections to a GPU peer.",
                                  ["peer"], registry=r)

    def watch(self, collect: Callable[[], Iterator[Metric]]) -> None:
        """Gauges computed at scrape time by ``collect``."""
        self.registry.register(_Collect(collect))

    def request(self, endpoint: str, arrival: float) -> RequestTimer:
        return RequestTimer(self, endpoint, arrival)


class _Collect(Collector):
    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        return self._collect()


def gauge(name: str, documentation: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, labels=labels)


@dataclass(slots=True)
class RequestTimer:
    """The latencies of one request, observed as its deltas arrive."""

    metrics: Metrics
    endpoint: str
    arrival: float
    first: float | None = None
    last: dict[int, tuple[float, int]] = field(default_factory=dict)  # choice -> (time, tokens)

    def on_delta(self, index: int, completion_tokens: int) -> None:
        now = time.monotonic()
        before_time, before_tokens = self.last.get(index, (0.0, 0))
        new = completion_tokens - before_tokens
        if new <= 0:
            return
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
        elif before_tokens:
            # Tokens arrive several to a record: one sample per delta, of the mean
            # gap per token (as vLLM samples once per engine step). A sample per
            # token cost ~10% of the daemon's throughput in benchmarks/e2e_stream.
            self.metrics.itl.observe((now - before_time) / new)
        self.last[index] = (now, completion_tokens)

    def finish(self, prompt_tokens: int) -> None:
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.arrival)
        generated = sum(tokens for _, tokens in self.last.values())
        m.prompt_tokens.observe(prompt_tokens)
        m.generation_tokens.observe(generated)
        m.input_tokens.inc(prompt_tokens)
        m.output_tokens.inc(generated)
