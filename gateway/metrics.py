"""The gateway's and the dispatcher's Prometheus metrics, on a registry of their own (tests build
a fresh one per app and read it with `get_sample_value`). Names are `gateway.keys`'."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway import keys

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry
    requests: Counter
    latency: Histogram
    rejects: Counter
    tickets: Counter

    @classmethod
    def build(cls, registry: CollectorRegistry | None = None) -> GatewayMetrics:
        registry = registry if registry is not None else CollectorRegistry()
        return cls(
            registry,
            Counter(keys.REQUESTS, "HTTP requests answered, by route and status", ["route", "status"],
                    registry=registry),
            Histogram(keys.REQUEST_SECONDS, "Time to answer a request, by route", ["route"],
                      buckets=LATENCY_BUCKETS, registry=registry),
            Counter(keys.REJECTS, "Requests refused, by reason", ["reason"], registry=registry),
            Counter(keys.TICKETS, "Tickets in POSTs, by outcome (accepted, duplicate)", ["outcome"],
                    registry=registry),
        )


@dataclass
class DeliverMetrics:
    registry: CollectorRegistry
    deliveries: Counter
    attempts: Counter
    dead: Counter
    latency: Histogram
    trimmed: Counter
    lag: Gauge
    repeats: Counter

    @classmethod
    def build(cls, registry: CollectorRegistry | None = None) -> DeliverMetrics:
        registry = registry if registry is not None else CollectorRegistry()
        return cls(
            registry,
            Counter(keys.DELIVERIES, "Results delivered (the receiver answered 2xx)", registry=registry),
            Counter(keys.DELIVER_ATTEMPTS, "POSTs of results, by outcome (ok, http_<status>, error)", ["outcome"],
                    registry=registry),
            Counter(keys.DELIVER_DEAD, "Results dead-lettered after TICKETQ_DELIVER_MAX_ATTEMPTS POSTs",
                    registry=registry),
            Histogram(keys.DELIVER_SECONDS, "Time of one POST to the receiver", buckets=LATENCY_BUCKETS,
                      registry=registry),
            Counter(keys.DELIVER_TRIMMED, "Results trimmed from the stream before this group delivered them "
                    "(re-POST them with `ticketq-deliver redeliver-trimmed`)", registry=registry),
            Gauge(keys.DELIVER_LAG, "Results in the stream this group has not read yet, plus those pending",
                  registry=registry),
            Counter(keys.DELIVER_REPEATS, "Results not delivered: their ticket was read before Redis lost its data "
                    "(answered again in the new epoch)", registry=registry),
        )
