"""The ``epd_cache_*`` Prometheus series of one process, read from ``EmbeddingCache.stats()`` at
scrape time (nothing to update on the hot path). Registered on the caller's ``CollectorRegistry``
(each stage server has its own; see ``stages/metrics.py``).

  epd_cache_hits_total       keys found when looked up (get, contains_many, lookup_claim, wait_ready at once)
  epd_cache_misses_total     keys not found when looked up
  epd_cache_evictions_total  entries this process's writes evicted to stay within the byte budget
  epd_cache_claims_total     single-flight claims this process won (it had to encode the image)
  epd_cache_unavailable_total  Redis calls that failed or timed out (CacheUnavailable: Redis down or slow)
  epd_cache_bytes            bytes stored in the cache (all processes), as of the last Redis call
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache.store import CacheStats


class _CacheCollector(Collector):
    def __init__(self, stats: Callable[[], CacheStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield CounterMetricFamily("epd_cache_hits", "Image keys found in the embedding cache.", value=s.hits)
        yield CounterMetricFamily("epd_cache_misses", "Image keys not found in the embedding cache.", value=s.misses)
        yield CounterMetricFamily("epd_cache_evictions", "Cache entries evicted to stay within the byte budget.",
                                  value=s.evictions)
        yield CounterMetricFamily("epd_cache_claims", "Single-flight claims won (this process had to encode).",
                                  value=s.claims)
        yield CounterMetricFamily("epd_cache_unavailable", "Redis calls that failed or timed out.",
                                  value=s.unavailable)
        yield GaugeMetricFamily("epd_cache_bytes", "Bytes stored in the embedding cache (metadata + payload).",
                                value=s.stored_bytes)


def register_cache_metrics(registry: CollectorRegistry, stats: Callable[[], CacheStats]) -> None:
    """Export ``stats()`` (e.g. ``cache.stats``) on ``registry``. Call once per registry."""
    registry.register(_CacheCollector(stats))
