"""The encoder's working parts over a loaded vision tower: the batcher, the flights (claims), the
encoder thread, the request logic and their metrics, plus the encoder fields of ``/server_info``.

Built by ``stages.encoder.server.build`` (``stage serve encoder``: a vision-only model) and by
``stages.disagg.switchable.build`` (``stage serve pd --redis-url``: the whole model, serving as an
encoder, or as a prefill encoding its own requests' images when the router sends it them). Either
calls ``start`` once in its lifespan, on the event loop, and ``stop`` at its end; the caller owns the
cache and closes it after ``stop``.

The vision fingerprint hashes the weights of everything but the language model
(``ModelAdapter.vision_state``), so a switchable worker and an encoder of one checkpoint, dtype and
image processor give the same fingerprint, hence the same image keys.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from cache.store import EmbeddingCache
from stages.api import videos
from stages.config import ServerConfig
from stages.encoder.batcher import Batcher
from stages.encoder.flights import Flights
from stages.encoder.metrics import EncoderMetrics
from stages.encoder.service import EncodeService, VideoSetup
from stages.encoder.worker import EncoderWorker
from stages.engine.models.base import ModelAdapter
from stages.faults.seams import Seams
from stages.supervisor import Supervisor


@dataclass(frozen=True)
class EncoderStack:
    """``info``: the encoder fields of ``/server_info`` (role, model, encoder id, vision fingerprint,
    dtype, device, batching, Redis, limits, video)."""

    service: EncodeService
    worker: EncoderWorker
    metrics: EncoderMetrics
    info: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        return self.info["vision_fingerprint"]

    @property
    def encoder_id(self) -> str:
        return self.info["encoder_id"]

    def start(self, supervisor: Supervisor) -> None:
        """Start the encoder thread and the claim-renewal loop (``supervisor`` reports either's death)."""
        self.worker.start()
        self.service.start(supervisor)
        supervisor.watch_thread("encoder thread", lambda: self.worker.alive)

    async def stop(self) -> None:
        """Cancel queued work, let flights report their end (bounded), stop the encoder thread."""
        await self.service.flights.shutdown()
        self.worker.stop()


def build_stack(config: ServerConfig, adapter: ModelAdapter, cache: EmbeddingCache, seams: Seams,
                registry: CollectorRegistry | None = None) -> EncoderStack:
    """The encoder's parts over ``adapter``'s vision half (``config.encoder`` must be set). Its series
    go on ``registry`` (a new one when None, with the cache's ``epd_cache_*``; given, the caller has
    registered those)."""
    from transformers import AutoImageProcessor

    from cache.keys import vision_fingerprint, weights_digest
    from stages.resources import limits_info, video_info
    from stages.video_preprocess import VideoConfig

    encoder = config.encoder
    assert encoder is not None
    dtype = config.engine.dtype_choice
    image_processor = AutoImageProcessor.from_pretrained(config.engine.model)
    fingerprint = vision_fingerprint(adapter.vision_identity(), image_processor.to_dict(), dtype=dtype.name,
                                     weights=weights_digest(adapter.vision_state()))
    batcher = Batcher(encoder.max_batch_images)
    metrics = EncoderMetrics(lambda: batcher.depth, cache.stats if registry is None else None, registry)
    flights = Flights(encoder, cache, batcher, new_encoder_id())
    video = None
    if adapter.video_rule is not None:
        video_config = VideoConfig.load(config.engine.model, adapter.video_rule)
        video = VideoSetup(video_config, videos.server_sampling(video_config.sampling, config.video), config.video,
                           metrics.video)
    service = EncodeService(encoder, config.limits, flights, adapter, image_processor, video)
    worker = EncoderWorker(adapter, batcher, flights.deliver, metrics, seams.encoder())
    info = {"role": "encoder", "model": config.model_name, "encoder_id": flights.encoder_id,
            "vision_fingerprint": fingerprint, "num_parameters": adapter.num_parameters, "dtype": dtype.name,
            "dtype_source": dtype.source, "device": str(config.engine.torch_device),
            "max_batch_images": encoder.max_batch_images, "video_encode_frames": encoder.video_encode_frames,
            "redis_url": encoder.cache.safe_url, "limits": limits_info(config),
            "video": video_info(None if video is None else video.sampling, config.video)}
    return EncoderStack(service, worker, metrics, info)


def new_encoder_id() -> str:
    """Unique per process: ``enc-<host>-<pid>-<random>``."""
    return f"enc-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
