"""Prometheus metrics of one stage server, on its own ``CollectorRegistry`` (so several servers, or
several test apps, can live in one process). Names carry the ``epd_`` prefix shared by the router
and every stage.

Request metrics are observed by the HTTP layer through ``RequestTimer``; the batch size is observed
and the step time on the engine thread through ``observe_step`` (``AsyncEngine``'s ``on_step``; the
router's ratio report reads the step seconds as the stage's busy time); queue and KV gauges
are refreshed from ``AsyncEngine.stats()`` when /metrics is scraped.

Videos (``VideoMetrics``, on a stage's registry as ``epd_video_*``, on an encoder's as
``epd_encoder_video_*``): files decoded and their bytes, frames decoded, decode seconds, frames run
through the vision tower. A stage that decodes a video itself (colocated, a PD prefill) reports it
with ``Metrics.observe_video_decode`` (and ``observe_video_encode`` once its frames are encoded).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from stages.engine.outputs import EngineStats
    from transfer.base import TransferStats

FINISH_REASONS = ("stop", "length", "abort", "error")
PREEMPTION_KINDS = ("recompute", "swap")  # stages.engine.request.Preemption's values
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_DECODE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class VideoMetrics:
    """The video series of one registry, named ``{prefix}video_*``: ``frames_decoded`` (sampled frames
    decoded), ``decode_seconds`` (per video: probe + decode of its sampled frames), ``bytes`` (video
    files decoded), ``frames_encoded`` (sampled frames run through the vision tower). Thread-safe
    (prometheus_client is): call from any thread."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "epd_") -> None:
        self.frames_decoded = Counter(f"{prefix}video_frames_decoded", "Sampled video frames decoded.",
                                      registry=registry)
        self.decode_seconds = Histogram(f"{prefix}video_decode_seconds", "Seconds to read one video: its probe "
                                        "and the decode of its sampled frames.", buckets=_DECODE_BUCKETS,
                                        registry=registry)
        self.bytes = Counter(f"{prefix}video_bytes", "Bytes of the video files decoded.", registry=registry)
        self.frames_encoded = Counter(f"{prefix}video_frames_encoded", "Sampled video frames run through the "
                                      "vision tower.", registry=registry)

    def observe_decode(self, frames: int, seconds: float, nbytes: int) -> None:
        """One video read: ``frames`` sampled frames decoded from a file of ``nbytes`` in ``seconds``."""
        self.frames_decoded.inc(frames)
        self.decode_seconds.observe(seconds)
        self.bytes.inc(nbytes)

    def observe_encode(self, frames: int) -> None:
        """One video's ``frames`` sampled frames run through the vision tower."""
        self.frames_encoded.inc(frames)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("epd_time_to_first_token_seconds", "Time from request arrival to its first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("epd_time_per_output_token_seconds",
                              "Mean time per output token after the first, one observation per request.",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("epd_e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("epd_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("epd_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("epd_generation_tokens", "Generated tokens.", registry=r)
        self.queue_depth = Gauge("epd_queue_depth", "Requests waiting to be scheduled.", registry=r)
        self.running = Gauge("epd_running_requests", "Requests in the running batch.", registry=r)
        self.batch_size = Histogram("epd_batch_size", "Requests per engine step.", buckets=_BATCH_BUCKETS, registry=r)
        self.step_seconds = Histogram("epd_engine_step_seconds", "Seconds per engine step (forward pass and "
                                      "sampling); the sum is the engine's busy time.", buckets=_TOKEN_BUCKETS,
                                      registry=r)
        self.kv_blocks_used = Gauge("epd_kv_blocks_used", "KV cache blocks in use (held by live requests or a "
                                    "KV transfer).", registry=r)
        self.kv_blocks_total = Gauge("epd_kv_blocks_total", "KV cache blocks in the pool.", registry=r)
        self.kv_blocks_cached = Gauge("epd_kv_blocks_cached", "Prefix cache: cached KV blocks nobody uses, kept for "
                                      "later hits and evicted when the pool needs them.", registry=r)
        self.prefix_queries = Counter("epd_prefix_cache_queries", "Prefix cache: prompt tokens looked up.",
                                      registry=r)
        self.prefix_hit_tokens = Counter("epd_prefix_cache_hit_tokens", "Prefix cache: prompt tokens whose KV was "
                                         "found cached (not computed).", registry=r)
        self._prefix_seen = (0, 0)  # the engine's counts at the last refresh
        self.prefill_images_skipped = Counter("epd_prefill_images_skipped", "EPD prefill: image and video "
                                              "embeddings not read from the cache because the prefix cache held "
                                              "their KV (their placeholders lay wholly in the cached prefix).",
                                              registry=r)
        self.images_preprocess_skipped = Counter("epd_images_preprocess_skipped", "Colocated and PD prefill: "
                                                 "images not decoded nor preprocessed when their request came "
                                                 "because the prefix cache held their KV (their placeholders "
                                                 "lay wholly in the cached prefix).", registry=r)
        self.preemptions = Counter("epd_preemptions", "Requests preempted when the KV pool ran dry, by what "
                                   "happened to their KV: recompute (prefilled again) or swap (to host memory).",
                                   ["kind"], registry=r)
        self._preemptions_seen = {kind: 0 for kind in PREEMPTION_KINDS}
        self.video = VideoMetrics(r)
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        for kind in PREEMPTION_KINDS:
            self.preemptions.labels(kind=kind)

    def watch_transfer(self, backend: str, stats: Callable[[], TransferStats]) -> None:
        """Export a transfer backend's counters (read at scrape time) as epd_kv_transfer_* gauges."""
        labels = {"backend": backend}
        for field, help_text in (("bytes", "Bytes of KV written to peers."), ("seconds", "Seconds spent writing KV."),
                                 ("writes", "KV writes to peers."), ("failures", "Failed KV writes.")):
            gauge = Gauge(f"epd_kv_transfer_{field}", help_text, ["backend"], registry=self.registry)
            gauge.labels(**labels).set_function(_reader(stats, field))

    def observe_video_decode(self, frames: int, seconds: float, nbytes: int) -> None:
        """A video this stage read itself: ``frames`` sampled frames of a ``nbytes`` file, in ``seconds``
        (probe and frame decode). Any thread; never raises."""
        self.video.observe_decode(frames, seconds, nbytes)

    def observe_video_encode(self, frames: int) -> None:
        """A video's ``frames`` sampled frames this stage ran through its vision tower."""
        self.video.observe_encode(frames)

    def observe_step(self, batch_size: int, seconds: float) -> None:
        """Called on the engine thread after each step; must never raise."""
        self.batch_size.observe(batch_size)
        self.step_seconds.observe(seconds)

    def refresh(self, stats: EngineStats) -> None:
        self.queue_depth.set(stats.waiting)
        self.running.set(stats.running)
        self.kv_blocks_used.set(stats.blocks_used)
        self.kv_blocks_total.set(stats.blocks_total)
        self.kv_blocks_cached.set(stats.blocks_cached)
        queries, hits = self._prefix_seen
        self.prefix_queries.inc(max(0, stats.prefix_queries - queries))  # the engine counts; the counters follow
        self.prefix_hit_tokens.inc(max(0, stats.prefix_hit_tokens - hits))
        self._prefix_seen = (max(queries, stats.prefix_queries), max(hits, stats.prefix_hit_tokens))
        for kind, count in stats.preemptions.items():  # the engine counts; the counter catches up at scrape
            self.preemptions.labels(kind=kind).inc(count - self._preemptions_seen.get(kind, 0))
            self._preemptions_seen[kind] = count

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


def _reader(stats: Callable[[], TransferStats], field: str) -> Callable[[], float]:
    """Reads ``field`` of a fresh ``stats()`` each time it is called (at scrape time)."""
    return lambda: getattr(stats(), field)


class RequestTimer:
    """Times one request from arrival; ``finish`` records it exactly once (later calls do nothing)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.first_token_at: float | None = None
        self.done = False

    def tokens(self, completion_tokens: int) -> None:
        if self.first_token_at is None and completion_tokens > 0:
            self.first_token_at = time.monotonic()
            self.metrics.ttft.observe(self.first_token_at - self.start)

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int, longest: int | None = None) -> None:
        """``completion_tokens``: of all the request's sequences; ``longest``: the most of one sequence
        (default: all of them, one sequence), which sets the time per output token."""
        if self.done:
            return
        self.done = True
        m, now = self.metrics, time.monotonic()
        m.requests.labels(finish_reason=reason).inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(completion_tokens)
        if reason in ("stop", "length"):
            m.e2e.observe(now - self.start)
            sequence_tokens = completion_tokens if longest is None else longest
            if self.first_token_at is not None and sequence_tokens > 1:
                m.tpot.observe((now - self.first_token_at) / (sequence_tokens - 1))
