"""Prometheus series of one encoder server, on its own registry (``epd_`` prefix, as every stage):

  epd_encoder_images_encoded_total  images actually run through the vision tower (cache hits, images
                                    encoded elsewhere and cancelled work are not counted)
  epd_encoder_batch_size            images per vision-tower call
  epd_encoder_seconds               seconds per vision-tower call
  epd_encoder_queue_depth           images queued, not yet taken by the encoder thread
  epd_encoder_videos_encoded_total  videos run through the vision tower (their seconds count in
                                    epd_encoder_seconds, one observation per video, chunks together)
  epd_encoder_video_*               videos read and encoded (``stages.metrics.VideoMetrics``):
                                    video_frames_decoded_total, video_decode_seconds, video_bytes_total
                                    (observed on a request's worker thread, before any claim) and
                                    video_frames_encoded_total (the encoder thread)
  epd_cache_*                       the embedding cache as this process sees it (cache/metrics.py)

The encoder thread observes the first three and the encoded videos (prometheus_client is thread-safe); the gauges are
read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cache.metrics import register_cache_metrics
from cache.store import CacheStats
from stages.metrics import VideoMetrics

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EncoderMetrics:
    def __init__(self, queue_depth: Callable[[], int], cache_stats: Callable[[], CacheStats] | None,
                 registry: CollectorRegistry | None = None) -> None:
        """The series on ``registry`` (a new one when None); ``cache_stats`` None: the ``epd_cache_*``
        series are there already (a switchable worker registers them once for its roles)."""
        r = self.registry = CollectorRegistry() if registry is None else registry
        self.images_encoded = Counter("epd_encoder_images_encoded", "Images run through the vision tower.",
                                      registry=r)
        self.batch_size = Histogram("epd_encoder_batch_size", "Images per vision-tower call.",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.seconds = Histogram("epd_encoder_seconds", "Seconds per vision-tower call.",
                                 buckets=_SECONDS_BUCKETS, registry=r)
        self.queue_depth = Gauge("epd_encoder_queue_depth", "Images waiting for the vision tower.", registry=r)
        self.queue_depth.set_function(queue_depth)
        self.videos_encoded = Counter("epd_encoder_videos_encoded", "Videos run through the vision tower.",
                                      registry=r)
        self.video = VideoMetrics(r, prefix="epd_encoder_")
        if cache_stats is not None:
            register_cache_metrics(r, cache_stats)

    def observe_call(self, images: int, seconds: float) -> None:
        """One vision-tower call over ``images`` images that succeeded. Called on the encoder thread."""
        self.images_encoded.inc(images)
        self.batch_size.observe(images)
        self.seconds.observe(seconds)

    def observe_video(self, frames: int, seconds: float) -> None:
        """One video of ``frames`` sampled frames encoded (all its chunks) in ``seconds``. Encoder thread."""
        self.videos_encoded.inc()
        self.video.observe_encode(frames)
        self.seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
