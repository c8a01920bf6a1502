"""The encoder thread: the only thread that runs the vision tower.

It takes batches from the ``Batcher`` (blocking at most ``IDLE_WAIT_S`` at a time, so ``stop`` is
seen), runs the adapter's ``encode`` over the whole batch, and hands each job's result to
``deliver(job, result)``: an ``ImageEmbedding``, or a string saying why that image failed. One
image's failure is its own: if a batch call raises, its images are retried one by one.

A video (``Job.frames`` > 0) is encoded on its own, in chunks of at most ``Job.chunk`` temporal patches
(``--video-encode-frames``), their embeddings (and Qwen3-VL's deepstack rows) concatenated: a Qwen
vision tower attends within a temporal patch only, so the chunks give the embedding one whole call
would (tests/stages/encoder/test_encoder_video.py checks it bit for bit), with the activations of one
chunk. The images of a batch are encoded together, as before.

Contract for ``deliver``: called on the encoder thread, exactly once per taken job, after the job is
ENDED; it must not raise or block (``Flights.deliver`` crosses to the event loop with
``call_soon_threadsafe``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from stages.encoder.batcher import Batcher, Job, Tower
from stages.encoder.metrics import EncoderMetrics
from stages.engine.models.base import ModelAdapter
from stages.engine.multimodal import ImageEmbedding, ImageInput

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5
Deliver = Callable[[Job, "ImageEmbedding | str"], None]


class EncoderHooks:
    """Where something may be plugged into the encoder thread; it calls both, on that thread, every
    time. These defaults do nothing; ``--debug-faults`` plugs in the ``encoder.*`` fault points
    (``stages.faults.encoder``)."""

    def batch_taken(self, batch: list[Job]) -> None:
        """A batch taken from the batcher, before it is encoded (may sleep: the queue waits)."""

    def before_encode(self, batch: list[Job]) -> None:
        """Each vision-tower call (a batch, or one image of a failed batch's retry), inside it: raising
        fails that call as the tower raising would."""


class EncoderWorker:
    def __init__(self, adapter: ModelAdapter, batcher: Batcher, deliver: Deliver, metrics: EncoderMetrics,
                 hooks: EncoderHooks) -> None:
        self.adapter = adapter
        self.batcher = batcher
        self._deliver = deliver
        self._metrics = metrics
        self._hooks = hooks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="encoder", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to end after its current batch; wait at most ``timeout_s``."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self.batcher.take(IDLE_WAIT_S)
            if not batch:
                continue
            self._hooks.batch_taken(batch)
            images = [job for job in batch if not job.frames]
            for job, result in zip(images, self._encode(images) if images else [], strict=True):
                self.batcher.finish(job)
                self._deliver(job, result)
            for job in batch:
                if job.frames:
                    result = self._encode_video(job)
                    self.batcher.finish(job)
                    self._deliver(job, result)

    def _encode_video(self, job: Job) -> ImageEmbedding | str:
        """One video, ``job.chunk`` temporal patches per vision-tower call; the chunks' rows concatenated."""
        start, wall = time.monotonic(), time.time()
        try:
            self._hooks.before_encode([job])
            embedding = encode_chunked(self.adapter, job.image, job.chunk)
        except Exception as exc:
            log.exception("the vision tower failed on video %s", job.key)
            return f"the vision tower failed: {type(exc).__name__}: {exc}"
        self._metrics.observe_video(job.frames, time.monotonic() - start)
        job.tower = Tower(wall, time.time(), (job.key,))
        return _checked(job, embedding)

    def _encode(self, batch: list[Job]) -> list[ImageEmbedding | str]:
        """One vision-tower call over ``batch``; if it raises, one call per image."""
        start, wall = time.monotonic(), time.time()
        try:
            self._hooks.before_encode(batch)
            embeddings = self.adapter.encode([job.image for job in batch])
        except Exception as exc:
            if len(batch) > 1:
                log.warning("a vision-tower call over %d images failed (%s: %s); encoding them one by one",
                            len(batch), type(exc).__name__, exc)
                return [result for job in batch for result in self._encode([job])]
            log.exception("the vision tower failed on image %s", batch[0].key)
            return [f"the vision tower failed: {type(exc).__name__}: {exc}"]
        self._metrics.observe_call(len(batch), time.monotonic() - start)
        tower = Tower(wall, time.time(), tuple(job.key for job in batch))
        for job in batch:
            job.tower = tower
        return [_checked(job, embedding) for job, embedding in zip(batch, embeddings, strict=True)]


def encode_chunked(adapter: ModelAdapter, video: ImageInput, chunk: int) -> ImageEmbedding:
    """``adapter.encode([video])`` in calls of at most ``chunk`` temporal patches (0: one call), the
    chunks' embeddings and deepstack rows concatenated in order. ``video``'s patches are temporal-patch
    major (``stages.video_preprocess``): temporal patch k is rows ``k*h*w`` to ``(k+1)*h*w``."""
    if video.grid_thw is None:
        raise ValueError("only an item with a grid (a Qwen video) can be encoded in chunks")
    t, h, w = video.grid_thw
    if chunk <= 0 or chunk >= t:
        return adapter.encode([video])[0]
    rows, tokens = h * w, video.num_tokens // t
    parts = []
    for first in range(0, t, chunk):
        n = min(chunk, t - first)
        part = ImageInput(video.pixel_values[first * rows:(first + n) * rows], (n, h, w), n * tokens)
        parts.extend(adapter.encode([part]))
    deepstack = [part.deepstack for part in parts]
    return ImageEmbedding(torch.cat([part.embeds for part in parts]), video.grid_thw,
                          None if deepstack[0] is None else torch.cat([d for d in deepstack if d is not None], dim=1))


def _checked(job: Job, embedding: ImageEmbedding) -> ImageEmbedding | str:
    """The embedding if it fills as many placeholder tokens as the prompt rule says, else why not."""
    if embedding.num_tokens != job.image.num_tokens:
        what = "a video" if job.frames else "an image"
        return (f"the vision tower gave {embedding.num_tokens} embedding rows for {what} that fills "
                f"{job.image.num_tokens} placeholder tokens")
    return embedding
