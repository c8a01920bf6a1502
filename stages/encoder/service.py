"""The encoder's request logic: which images of a request to encode, and waiting for them.

For each image of a request (key = ``cache.keys.image_key(bytes, vision_fingerprint)``):

- cached -> ``cached`` (nothing to do);
- in flight in this process (another request asked first) -> the request joins that flight;
- otherwise a new flight (``flights.py``): encoded here if this encoder holds or wins the key's
  claim, else ``pending_elsewhere`` (a prefill waits for it with ``wait_ready``).

So N requests for one image cost one encode here, and the claim makes it one across encoders.
Every image is decoded and preprocessed before anything is claimed, so bad input costs nothing.

A video (``Upload.video``: its sampling, checked by the server) is one key
(``cache.keys.video_key(bytes, sampling, fingerprint)``) and one flight, as an image: probed, planned
(``contract.video.plan``), only its planned frames decoded (``stages.api.videos``, under ``--max-video-*``
and ``--video-decode-timeout-s``) and preprocessed (``stages.video_preprocess``) in a worker thread before
anything is claimed; the encoder thread encodes it in chunks of ``--video-encode-frames``.

Rooms: ``abort(room)`` answers the room's waiting requests with 409 at once, refuses its later ones,
and cancels queued work that no other request waits for. A request that ends any other way
(deadline, error) likewise stops waiting for its flights.

Deadlines: a request returns within ``encode_timeout_s`` (504 after it); every Redis call has the
cache's deadline (503 naming Redis).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any

from PIL import Image

from cache.errors import CacheUnavailable
from contract.encode import CACHED, ENCODED, ImageStatus
from contract.errors import Code
from contract.video import VideoSampling
from stages.api import videos
from stages.api.errors import APIError, ErrorFields, bad_request
from stages.api.images import open_image
from stages.config import EncoderConfig, ImageLimits, VideoLimits
from stages.encoder.batcher import Job, RecentRooms, Tower
from stages.encoder.flights import Failure, Flight, Flights, redis_failure
from stages.engine.models.base import ModelAdapter
from stages.engine.multimodal import ImageInput
from stages.metrics import VideoMetrics
from stages.prompt import preprocess_image
from stages.supervisor import Supervisor
from stages.video_preprocess import VideoConfig, preprocess_video


@dataclass(frozen=True)
class Upload:
    """One image or video of an encode request: its bytes (decoded from base64) and its cache key;
    ``video``: a video's sampling (checked within this encoder's bounds), None for an image."""

    key: str
    data: bytes
    video: VideoSampling | None = None


@dataclass(frozen=True)
class VideoSetup:
    """How this encoder takes videos (None where its model takes none): the checkpoint's video
    processing, the sampling every video starts from (``stages.api.videos.server_sampling``), the
    limits of one video, and the series its reads are counted in."""

    config: VideoConfig
    sampling: VideoSampling
    limits: VideoLimits
    metrics: VideoMetrics


@dataclass(frozen=True)
class VideoRead:
    """A video this request read: its sampled frames, the seconds to probe and decode them, and when it
    was done (wall clock, ``time.time()``)."""

    frames: int
    seconds: float
    at: float


@dataclass(frozen=True)
class _Prepared:
    """One fresh upload, ready for the vision tower: its job, and for a video the read."""

    job: Job
    read: VideoRead | None = None


@dataclass(frozen=True)
class ImageResult:
    key: str
    status: ImageStatus
    num_tokens: int | None  # the embedding's rows, for "encoded"
    seconds: float  # request arrival -> the embedding is in the cache, for "encoded"
    frames: int | None = None  # a video's sampled frames, for "encoded"
    read: VideoRead | None = None  # a video this request decoded itself
    cached_at: float = 0.0  # wall clock (``time.time()``) when its entry began to be written, for "encoded"
    tower: Tower | None = None  # the vision-tower call that encoded it here, for "encoded"


@dataclass
class _Request:
    room: int
    aborted: asyncio.Future


class EncodeService:
    def __init__(self, config: EncoderConfig, limits: ImageLimits, flights: Flights, adapter: ModelAdapter,
                 image_processor: Any, video: VideoSetup | None = None) -> None:
        self.config = config
        self.limits = limits
        self.video = video
        self.flights = flights
        self.adapter = adapter
        self.image_processor = image_processor
        self._requests: dict[int, _Request] = {}
        self._serials = itertools.count()
        self._aborted = RecentRooms()

    def busy(self) -> str | None:
        """What this service still has in flight (requests waiting, flights not ended), or None."""
        if self._requests or len(self.flights):
            return f"{len(self._requests)} encode request(s) in flight, {len(self.flights)} image(s) being encoded"
        return None

    def start(self, supervisor: Supervisor) -> None:
        """Call once from the server's event loop (lifespan), before the first request."""
        self.flights.attach(asyncio.get_running_loop())
        supervisor.spawn("claim renewal", self.flights.renew_claims())

    async def encode(self, room: int, uploads: list[Upload]) -> list[ImageResult]:
        """Make every image of ``uploads`` cached or pending elsewhere; one result per upload, in
        order. Raises APIError: 400/413 for a bad image (before anything is claimed), 409 if the room
        is aborted, 503 naming Redis, 500 if an encode failed, 504 past ``encode_timeout_s``."""
        if room in self._aborted:
            raise room_aborted(room)
        start = time.monotonic()
        serial = next(self._serials)
        self._requests[serial] = _Request(room, asyncio.get_running_loop().create_future())
        try:
            async with asyncio.timeout(self.config.encode_timeout_s):
                return await self._encode(serial, room, uploads, start)
        except TimeoutError:
            raise APIError(504, f"The images were not encoded within {self.config.encode_timeout_s:g} s "
                           "(--encode-timeout-s).", code=Code.ENCODE_TIMEOUT, fields=ErrorFields(room=room)) from None
        finally:
            del self._requests[serial]
            self.flights.forget(lambda s, _room: s == serial)

    def abort(self, room: int) -> int:
        """Cancel ``room``: its waiting requests answer 409, later ones are refused, and queued work
        no other room waits for is cancelled. Returns how many images were cancelled."""
        self._aborted.add(room)
        for request in self._requests.values():
            if request.room == room and not request.aborted.done():
                request.aborted.set_result(None)
        return self.flights.forget(lambda _serial, r: r == room)

    async def _encode(self, serial: int, room: int, uploads: list[Upload], start: float) -> list[ImageResult]:
        first = {u.key: u for u in reversed(uploads)}  # one upload per key
        try:
            cached = await self.flights.cached(first)
        except CacheUnavailable as exc:
            failure = redis_failure(exc)
            raise APIError(failure.status, failure.message, code=failure.code, fields=ErrorFields(room=room)) from None
        todo = [first[key] for key in dict.fromkeys(u.key for u in uploads) if key not in cached]
        fresh = [u for u in todo if self.flights.get(u.key) is None]
        inputs = dict(zip([u.key for u in fresh], await asyncio.to_thread(self._prepare, fresh, uploads)))
        joined = {upload.key: await self._join(serial, room, upload, inputs, uploads) for upload in todo}
        await self._wait(serial, room, list(joined.values()))
        results = {key: ImageResult(key, CACHED, None, 0.0) for key in cached}
        reads = {key: prepared.read for key, prepared in inputs.items()}
        for key, flight in joined.items():
            outcome = flight.result.result()
            if isinstance(outcome, Failure):
                index = next(i for i, u in enumerate(uploads) if u.key == key)
                raise APIError(outcome.status, outcome.message, param=f"images[{index}]", code=outcome.code,
                               fields=ErrorFields(room=room, image_key=key))
            encoded = outcome == ENCODED
            seconds = round(flight.ended_at - start, 6) if encoded else 0.0
            cached_at = time.time() - (time.monotonic() - flight.encoded_at) if encoded else 0.0
            results[key] = ImageResult(key, outcome, flight.job.image.num_tokens if encoded else None, seconds,
                                       flight.job.frames or None if encoded else None, reads.get(key), cached_at,
                                       flight.job.tower if encoded else None)
        return [results[u.key] for u in uploads]

    async def _join(self, serial: int, room: int, upload: Upload, inputs: dict[str, _Prepared],
                    uploads: list[Upload]) -> Flight:
        """The flight for ``upload.key``, joined by request ``serial``: the one in flight, or a new one."""
        while (flight := self.flights.get(upload.key)) is not None and flight.cancelled:
            await asyncio.shield(flight.result)  # a cancelled flight is ending: start afresh after it
        if flight is None:
            prepared = inputs.get(upload.key)
            if prepared is None:  # its flight ended after this request looked: prepare it now
                prepared = (await asyncio.to_thread(self._prepare, [upload], uploads))[0]
            if (flight := self.flights.get(upload.key)) is None:  # nobody started it meanwhile
                return await self.flights.start(prepared.job, serial, room)
        flight.interests[serial] = room
        return flight

    async def _wait(self, serial: int, room: int, flights: list[Flight]) -> None:
        """Until every flight has ended; 409 at once if the room is aborted meanwhile."""
        aborted = self._requests[serial].aborted
        while pending := [f.result for f in flights if not f.result.done()]:
            await asyncio.wait([*pending, aborted], return_when=asyncio.FIRST_COMPLETED)
            if aborted.done():
                raise room_aborted(room)
        if aborted.done():
            raise room_aborted(room)

    def _prepare(self, fresh: list[Upload], uploads: list[Upload]) -> list[_Prepared]:
        """Decode and preprocess (runs in a worker thread); 400/413 naming the first bad image or video."""
        inputs = []
        for upload in fresh:
            param = f"images[{uploads.index(upload)}]"
            if upload.video is not None:
                inputs.append(self._prepare_video(upload, upload.video, param))
                continue
            image = _preprocess(self.image_processor, self.adapter, open_image(upload.data, self.limits, param), param)
            inputs.append(_Prepared(Job(upload.key, image)))
        return inputs

    def _prepare_video(self, upload: Upload, sampling: VideoSampling, param: str) -> _Prepared:
        """Probe, plan, decode the planned frames only, preprocess; 400/413 naming ``param``."""
        setup = self.video
        if setup is None:  # the server refuses a video part first; this is a bug's safety net
            raise bad_request(f"This {self.adapter.family} model takes no video.", param, Code.VIDEO_NOT_SUPPORTED)
        start = time.monotonic()
        plan = videos.planned(videos.probe(upload.data, setup.limits, param), sampling, param)
        frames = videos.frames(upload.data, plan, setup.limits, param)
        seconds = time.monotonic() - start
        setup.metrics.observe_decode(len(frames), seconds, len(upload.data))
        read = VideoRead(len(frames), round(seconds, 6), time.time())
        try:
            video = preprocess_video(frames, plan, setup.config)
        except ValueError as exc:
            raise bad_request(f"The video could not be preprocessed: {exc}", param, Code.INVALID_VIDEO) from None
        chunk = max(1, self.config.video_encode_frames // sampling.temporal_patch_size)
        return _Prepared(Job(upload.key, video, frames=len(frames), chunk=chunk), read)


def room_aborted(room: int) -> APIError:
    return APIError(409, f"Room {room} was aborted on this encoder.", param="room", code=Code.ROOM_ABORTED,
                    fields=ErrorFields(room=room))


def _preprocess(image_processor: Any, adapter: ModelAdapter, image: Image.Image, param: str) -> ImageInput:
    try:
        return preprocess_image(image_processor, adapter, image)
    except ValueError as exc:  # e.g. an aspect ratio the processor refuses
        raise bad_request(f"The image processor refused the image: {exc}", param, Code.INVALID_IMAGE) from None
