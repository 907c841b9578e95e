"""Prometheus metrics of one worker process: every series takes an injected registry.

Padding ratio in PromQL: `rate(ticketq_tokens_padded_total[1m]) / rate(ticketq_tokens_computed_total[1m])`.
Items/s: `sum(rate(ticketq_tickets_total{outcome="ok"}[1m]))`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import GaugeMetricFamily

from worker import constants as c

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class QueueDepthCollector:
    """Samples the broker queue's length (LLEN) at scrape time, so alerts see the backlog."""

    def __init__(self, depth: Callable[[], int]) -> None:
        self._depth = depth

    def collect(self):
        family = GaugeMetricFamily(c.M_QUEUE_DEPTH, "Messages waiting in the broker queue.")
        try:
            family.add_metric([], float(self._depth()))
        except Exception:  # a scrape must not fail because the broker is briefly away
            return
        yield family


class Metrics:
    """All of ticketq's series, registered in `registry`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.tickets = Counter(c.M_TICKETS, "Tickets finished, by label and outcome.", ["label", "outcome"], registry=r)
        self.tokens_real = Counter(c.M_TOKENS_REAL, "Real (non-pad) tokens run through the model.", registry=r)
        self.tokens_computed = Counter(c.M_TOKENS_COMPUTED, "Tokens computed in forward passes.", registry=r)
        self.tokens_padded = Counter(c.M_TOKENS_PADDED, "Pad tokens computed in forward passes.", registry=r)
        self.padding_ratio = Gauge(c.M_PADDING_RATIO_LAST, "Padding ratio of the last forward batch.", registry=r)
        self.batch_size = Histogram(c.M_BATCH_SIZE, "Tickets per forward batch.", buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            c.M_BATCH_TOKENS, "Padded tokens per forward batch.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            c.M_QUEUE_WAIT, "Submit to batch start, seconds.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.forward = Histogram(c.M_FORWARD, "One forward batch, seconds.", buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram(
            c.M_LATENCY, "Submit to result published, seconds.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.prefix_reuses = Counter(c.M_PREFIX_REUSES, "Forward batches that reused the prefix KV cache.", registry=r)
        self.dead_letters = Counter(c.M_DEAD_LETTERS, "Messages or tickets dead-lettered.", ["reason"], registry=r)
        self.shadow_checked = Counter(c.M_SHADOW_CHECKED, "Tickets re-run on the reference path.", registry=r)
        self.shadow_agreed = Counter(c.M_SHADOW_AGREED, "Shadow-checked tickets whose label matched.", registry=r)
        self.shadow_dropped = Counter(c.M_SHADOW_DROPPED, "Shadow samples dropped (checker busy).", registry=r)
        self.duplicates = Counter(c.M_DUPLICATES, "Re-executed tickets whose result was already out.", registry=r)
        self.flushes = Counter(c.M_FLUSHES, "Buffer drains (micro-batches handed to the engine).", registry=r)
        self.model = Info(c.M_MODEL_INFO, "The model this worker serves.", registry=r)

    def preinit(self, labels: tuple[str, ...], reasons: tuple[str, ...]) -> None:
        """Create the labelled series at 0 so dashboards and rate() see them before the first event."""
        for label in labels:
            self.tickets.labels(label=label, outcome="ok")
        for outcome in ("failed", "rejected"):
            self.tickets.labels(label="none", outcome=outcome)
        for reason in reasons:
            self.dead_letters.labels(reason=reason)

    def observe_batch(self, rows: int, width: int, real_tokens: int, seconds: float) -> None:
        computed = rows * width
        self.tokens_real.inc(real_tokens)
        self.tokens_computed.inc(computed)
        self.tokens_padded.inc(computed - real_tokens)
        self.padding_ratio.set((computed - real_tokens) / computed if computed else 0.0)
        self.batch_size.observe(rows)
        self.batch_tokens.observe(computed)
        self.forward.observe(seconds)
        self.prefix_reuses.inc()

    def watch_queue(self, depth: Callable[[], int]) -> None:
        self.registry.register(QueueDepthCollector(depth))

    def serve(self, host: str, port: int) -> None:
        """Expose /metrics on host:port (the default host is loopback only)."""
        start_http_server(port, addr=host, registry=self.registry)
