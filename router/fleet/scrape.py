"""Reading the workers' own ``/metrics`` into the load history (``router.fleet.load``).

Contract: ``sample_all`` scrapes every known worker at once (each within ``--health-timeout-s``; a
worker that does not answer is skipped this round) and records the router's own counters beside
them. ``sample_loop`` runs it every ``period(window)`` seconds for the router's whole life, as a
supervised task; the admin API also calls it before answering, so its numbers are fresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import aiohttp
from prometheus_client import Counter

from router.fleet.load import History, Sample, parse_sample
from router.metrics import LoopHistogram, Metrics
from router.fleet.workers import Worker

log = logging.getLogger(__name__)


def period(window_s: float) -> float:
    """Seconds between samples: a dozen per window, between 0.25 s and 5 s."""
    return min(5.0, max(0.25, window_s / 12))


async def scrape(session: aiohttp.ClientSession, worker: Worker, timeout_s: float) -> Sample | None:
    """One sample of ``worker``'s /metrics, or None if it did not answer in time or not as Prometheus."""
    try:
        async with session.get(worker.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                return None
            text = await response.text()
        return parse_sample(worker.role, text, time.monotonic())
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("could not read %s/metrics: %s", worker.url, exc)
        return None


async def sample_all(session: aiohttp.ClientSession, workers: Iterable[Worker], metrics: Metrics, history: History,
                     timeout_s: float) -> dict[str, Sample]:
    """Scrape every known worker and record what answered; the samples by worker id."""
    known = [w for w in workers if w.known]
    samples = await asyncio.gather(*(scrape(session, w, timeout_s) for w in known))
    now = time.monotonic()
    history.add_router(now, router_counters(metrics))
    taken = {}
    for worker, sample in zip(known, samples):
        if sample is not None:
            history.add(worker.id, sample)
            taken[worker.id] = sample
    return taken


async def sample_loop(session: aiohttp.ClientSession, workers: Iterable[Worker], metrics: Metrics, history: History,
                      timeout_s: float) -> None:
    """Forever: sample, then sleep ``period(history.window_s)``."""
    while True:
        await sample_all(session, workers, metrics, history, timeout_s)
        await asyncio.sleep(period(history.window_s))


def router_counters(metrics: Metrics) -> dict[str, float]:
    """The router's cumulative counters the ratio report takes differences of: images received (cache
    hits and misses: the encode demand counts both), and the sums and counts of its TTFT and TPOT
    histograms."""
    counters = {"images": _read(metrics.images, "_total")}
    for name, histogram in (("ttft", metrics.ttft), ("tpot", metrics.tpot)):
        counters[f"{name}_sum"], counters[f"{name}_count"] = _read(histogram, "_sum"), _read(histogram, "_count")
    return counters


def _read(metric: Counter | LoopHistogram, suffix: str) -> float:
    """The sum over its labels (``epd_router_images_total``'s cache hit and miss) of a metric's
    samples named with ``suffix``."""
    return sum(s.value for family in metric.collect() for s in family.samples if s.name.endswith(suffix))
