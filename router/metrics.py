"""Prometheus metrics of the router, on its own ``CollectorRegistry``; names carry the ``epd_router_``
prefix (the stages' are ``epd_``), so one Prometheus can scrape the router and every stage.

When a request's metrics are recorded (``docs/router.md``, "When they are recorded"): its stage times, TTFT and
TPOT when the router has settled it, before the client's last byte; its outcome and end-to-end
latency after the last byte, before the handler returns. Every labelled series exists from the
start (at 0), and the request path uses the children made then (``outcome``, ``stage``, ``cache``:
one dict lookup, where ``labels()`` would check and join the label values and take the metric's
lock on every call). The histograms on the request path (``LoopHistogram``: end-to-end time, stage
times, TTFT, TPOT) are plain counts that only the event loop writes and reads, exported through a
custom collector: prometheus_client's ``Histogram.observe`` costs about 3 us (a Python loop over the
buckets, a lock per bucket), these about 0.4. Worker gauges (health, circuit state, outstanding
requests) are read from the workers at scrape time.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from router.plan.prefix_tree import IMAGE_CHARS
from router.fleet.workers import Worker

OUTCOMES = ("success", "client_error", "upstream_error", "rejected", "aborted", "internal_error")
CACHE = ("hit", "miss")
PREFIX_BY = ("match", "spread", "load")  # router.plan.policy.PrefixAware: how a pick was made
STAGES = ("encoder", "prefill", "decode", "colocated")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Series:
    """One histogram series: a count per bucket and the sum. Written and read on the event loop only
    (no lock)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a bucket's bound is inclusive (le)
        self.total += value


class LoopHistogram(Collector):
    """A Prometheus histogram of the event loop's own (``Series`` per label values), rendered by
    prometheus_client's exposition like any other (``_bucket``, ``_count``, ``_sum``)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = (), registry: CollectorRegistry | None = None) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets if b != math.inf)
        self._les = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        self._series: dict[tuple[str, ...], Series] = {}
        if not self.labelnames:
            self._series[()] = Series(self.bounds)
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str, **named: str) -> Series:
        key = tuple(values) if values else tuple(named[n] for n in self.labelnames)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = Series(self.bounds)
        return series

    def observe(self, value: float) -> None:
        """The unlabelled histogram's one series."""
        self._series[()].observe(value)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, series in self._series.items():
            family.add_metric(list(key), list(zip(self._les, accumulate(series.counts))), series.total)
        yield family


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("epd_router_requests", "Requests by how they ended: success, client_error (any 4xx), "
                                "upstream_error (a stage failed), rejected (503: the router's limits, no worker, "
                                "or every stage busy), aborted (client left), internal_error (a router bug).",
                                ["outcome"], registry=r)
        self.ttft = LoopHistogram("epd_router_time_to_first_token_seconds",
                              "Streamed requests: arrival at the router to the first text chunk sent to the client.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = LoopHistogram("epd_router_time_per_output_token_seconds",
                              "Streamed requests: mean time per output token after the first, one per request.",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = LoopHistogram("epd_router_e2e_request_latency_seconds",
                             "Arrival at the router to the last byte of the answer.", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.stage_seconds = LoopHistogram("epd_router_stage_seconds",
                                       "Time one stage took for one request: sent to its last byte.", ["stage"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.retries = Counter("epd_router_retries", "Requests retried on fresh workers, by the stage that failed.",
                               ["stage"], registry=r)
        self.images = Counter("epd_router_images", "Images in the chat requests received (the encode demand), by "
                              "cache: hit if the embedding cache held the image when the request was planned (epd), "
                              "else miss.", ["cache"], registry=r)
        self.local_encodes = Counter("epd_router_local_encode_images", "Images sent to encode to the request's own "
                                     "prefill instead of an encoder (--local-encode), per attempt.", registry=r)
        self.prefix_routes = Counter("epd_router_prefix_routes", "prefix_aware picks, by how: match (the longest "
                                     "prefix match covered --prefix-cache-threshold), spread (it did not: the "
                                     "smallest prefix tree), load (loads imbalanced: the least loaded).", ["by"],
                                     registry=r)
        self.prefix_request_chars = Counter("epd_router_prefix_request_chars", "prefix_aware picks: characters of "
                                            f"the requests' messages (an image counts as {IMAGE_CHARS}).", registry=r)
        self.prefix_match_chars = Counter("epd_router_prefix_match_chars", "prefix_aware picks: of those, the "
                                          "characters the chosen worker was already sent, by the router's prefix "
                                          "tree (the estimated hit rate: this / request chars).", registry=r)
        self.in_flight = Gauge("epd_router_in_flight_requests", "Requests the router holds now.", registry=r)
        self._health = Gauge("epd_router_worker_healthy", "1 if the worker's last health check passed.",
                             ["role", "worker"], registry=r)
        self._circuit = Gauge("epd_router_circuit_state", "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
                              ["role", "worker"], registry=r)
        self._outstanding = Gauge("epd_router_worker_outstanding_requests", "Requests sent to the worker now.",
                                  ["role", "worker"], registry=r)
        self._outcomes = {outcome: self.requests.labels(outcome=outcome) for outcome in OUTCOMES}
        self._retries = {stage: self.retries.labels(stage=stage) for stage in STAGES}
        self._stage_seconds = {stage: self.stage_seconds.labels(stage=stage) for stage in (*STAGES, "local_encode")}
        self._images = {cache: self.images.labels(cache=cache) for cache in CACHE}
        self._prefix_routes = {by: self.prefix_routes.labels(by=by) for by in PREFIX_BY}

    def outcome(self, outcome: str) -> Counter:
        """``epd_router_requests_total{outcome}``'s child."""
        return self._outcomes.get(outcome) or self.requests.labels(outcome=outcome)

    def stage_time(self, stage: str) -> Series:
        """``epd_router_stage_seconds{stage}``'s child."""
        return self._stage_seconds.get(stage) or self.stage_seconds.labels(stage=stage)

    def retry(self, stage: str) -> Counter:
        """``epd_router_retries_total{stage}``'s child."""
        return self._retries.get(stage) or self.retries.labels(stage=stage)

    def image_count(self, cache: str) -> Counter:
        """``epd_router_images_total{cache}``'s child."""
        return self._images.get(cache) or self.images.labels(cache=cache)

    def observe_prefix(self, by: str, matched: int, total: int) -> None:
        """One prefix_aware pick (``router.plan.policy.Observe``)."""
        (self._prefix_routes.get(by) or self.prefix_routes.labels(by=by)).inc()
        self.prefix_request_chars.inc(total)
        self.prefix_match_chars.inc(matched)

    def watch(self, workers: Iterable[Worker]) -> None:
        """Export each worker's health, circuit state and load (read when scraped)."""
        for w in workers:
            self._watch_one(w)

    def _watch_one(self, w: Worker) -> None:
        labels = {"role": w.role, "worker": w.url}
        self._health.labels(**labels).set_function(lambda: float(w.healthy))
        self._circuit.labels(**labels).set_function(lambda: float(w.breaker.state))
        self._outstanding.labels(**labels).set_function(lambda: float(w.outstanding))

    def unwatch(self, worker: Worker) -> None:
        """Stop exporting a worker that left (removed) or changed role (watched again under the new one)."""
        for gauge in (self._health, self._circuit, self._outstanding):
            try:
                gauge.remove(worker.role, worker.url)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
