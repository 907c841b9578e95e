"""Prometheus collectors of the worker's own making, beside prometheus_client's: series read at
scrape time from a callable (queue depth, a tally, the error bounds, hook errors), a histogram that
takes a whole forward batch's observations in one call, and a metric bound to the worker's queue.
`worker.metrics.Metrics` builds them; `ticketq exporter` exports the queue depth the same way."""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from worker import constants as c

M = TypeVar("M")


def queue_depth_family(depths: Mapping[str, float]) -> GaugeMetricFamily:
    """`ticketq_queue_depth{queue}`, one sample per queue: as a worker and `ticketq exporter` export it."""
    family = GaugeMetricFamily(c.M_QUEUE_DEPTH, "Messages waiting in the broker queue.", labels=["queue"])
    for queue, depth in depths.items():
        family.add_metric([queue], float(depth))
    return family


class QueueDepthCollector:
    """Samples the broker queue's length (LLEN) at scrape time, so alerts see the backlog."""

    def __init__(self, depth: Callable[[], int], queue: str) -> None:
        self._depth, self._queue = depth, queue

    def collect(self):
        try:
            depth = self._depth()
        except Exception:  # a scrape must not fail because the broker is briefly away
            return
        yield queue_depth_family({self._queue: depth})


class QueueBound(Generic[M]):
    """A labelled metric whose `queue` label is this worker's queue: `labels(**others)` fills it in,
    so a call site names only the labels that vary (prometheus_client has no constant labels)."""

    def __init__(self, metric: M, queue: str) -> None:
        self.metric, self.queue = metric, queue

    def labels(self, **labels: str) -> M:
        return self.metric.labels(queue=self.queue, **labels)


class TallyCollector:
    """A counter kept elsewhere (the worker's health or its runs' tally), read at scrape time."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def collect(self) -> Iterable[CounterMetricFamily]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._read())


class BoundsCollector:
    """Each re-checked runner's error bound (by schema: its precision and bound), read at scrape time."""

    def __init__(self, read: Callable[[], Mapping[str, tuple[str, float]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            c.M_ERROR_BOUND, "A fast precision's re-check bound: answers whose smallest decision gap (log space) "
            "is below it are computed again in float32; by precision and schema.", labels=["precision", "schema"],
        )  # fmt: skip
        for schema, (precision, bound) in sorted(self._read().items()):
            family.add_metric([precision, schema], bound)
        yield family


class HookErrorsCollector:
    """Hook calls that raised, by hook and call point (`worker.service.hooks.Hooks.errors`), read at scrape time."""

    def __init__(self, read: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self._read = read

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(c.M_HOOK_ERRORS, "Hook calls that raised (logged; the job went on), by hook "
                                     "and call point.", labels=["hook", "point"])  # fmt: skip
        for (hook, point), count in sorted(self._read().items()):
            family.add_metric([hook, point], count)
        yield family


class ManyHistogram:
    """A histogram that takes a whole forward batch's observations in one call (`observe_many`).

    prometheus_client's `Histogram.observe` takes one value per call (a lock, a bucket search and
    two increments each): with one latency and one queue-wait observation per ticket, that was a
    tenth of the worker's CPU at tens of thousands of tickets a second. Exposed through the
    custom-collector API, with the series a `Histogram` has (`_bucket`, `_count`, `_sum`); `labels`:
    fixed labels every sample carries (the worker's queue).
    """

    def __init__(self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry,
                 labels: Mapping[str, str] | None = None) -> None:  # fmt: skip
        bounds = sorted(float(b) for b in buckets)
        self._bounds = (*bounds, math.inf) if not bounds or bounds[-1] != math.inf else tuple(bounds)
        self._name, self._documentation, self._labels = name, documentation, dict(labels or {})
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values: Iterable[float]) -> None:
        values = list(values)
        per_bucket = Tally(bisect_left(self._bounds, value) for value in values)  # first bound >= value: le
        total = math.fsum(values)
        with self._lock:
            for index, count in per_bucket.items():
                self._counts[index] += count
            self._sum += total

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._documentation)]

    def collect(self) -> Iterable[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), buckets, total)
        yield family
