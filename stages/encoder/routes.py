"""The encoder's routes (wire format in ``docs/protocol.md``), on an encoder's app or a switchable
worker's (``stages.disagg.switchable``):

    POST /v1/encode   {"room": int, "images": [{"key"?: str, "data": base64 | "url": "data:...", "video"?: {...}}]}
                      -> {"room", "images": [{"key", "status", "num_tokens", "seconds"}]}
    POST /v1/abort    {"room": int} -> {"room", "cancelled": int}
    GET  /rooms/{room}  the room's encoder events (``stages.timeline``)

An item with ``video`` (its resolved ``contract.video.VideoSampling`` as JSON, within this encoder's
``/server_info`` ``video`` bounds) is a video: its key is ``cache.keys.video_key`` of its bytes and that
sampling; a model without video answers it 400 ``video_not_supported``.

Bad input is refused before anything is claimed or queued (400/413 naming ``images[i]``); the
server stays healthy. ``refusal`` (a switchable worker's) is asked before each encode: an APIError
it returns is the answer (the worker serves a role that takes no encode calls now).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.concurrency import run_in_threadpool

from cache.keys import check_key, image_key, video_key
from contract.bootstrap import ROOM_MAX
from contract.encode import CACHED, ENCODED, AbortAnswer, EncodeAnswer, EncodedImage
from contract.errors import Code
from contract.paths import ABORT_PATH, ENCODE_PATH
from contract.video import VideoSampling, VideoSettingError, check_resolved
from stages.api import videos
from stages.api.admission import Admission
from stages.api.body import read_body
from stages.api.errors import APIError, bad_request, overloaded, validation_error
from stages.api.images import decode_base64, decode_data_url
from stages.api.json_depth import check_json_depth
from stages.api.schema_types import AsInteger
from stages.config import ImageLimits, ServerConfig
from stages import tracing
from stages.encoder.batcher import Tower
from stages.encoder.openapi import ABORT_ROUTE, ENCODE_ROUTE
from stages.encoder.service import EncodeService, ImageResult, Upload, VideoSetup
from stages.timeline import FAILED, RoomTimeline

M = TypeVar("M", bound=BaseModel)
Refusal = Callable[[], APIError | None]


class ImagePart(BaseModel):
    """One image or video: its file bytes as base64 (``data``) or as a ``data:`` URL (``url``), and
    optionally its cache key (checked against the bytes; computed when absent). ``video``: set for a
    video, its sampling (``contract.video.VideoSampling.to_json()``, resolved by the router)."""

    model_config = ConfigDict(extra="forbid")
    key: str | None = None
    data: str | None = None
    url: str | None = None
    video: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ImagePart:
        if (self.data is None) == (self.url is None):
            raise ValueError("give exactly one of 'data' (base64) and 'url' (a data: URL)")
        return self


Room = Annotated[int, Field(ge=0, le=ROOM_MAX, strict=True), AsInteger]  # not true, not "7"; 7.0 is 7


class EncodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    room: Room
    images: list[ImagePart]


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    room: Room


def add_encode_routes(app: FastAPI, service: EncodeService, config: ServerConfig, timeline: RoomTimeline,
                      fingerprint: str, refusal: Refusal = lambda: None) -> None:
    """``POST /v1/encode`` and ``POST /v1/abort`` over ``service``, the room's events into ``timeline``;
    keys under ``fingerprint``. At most ``config.max_in_flight`` encode requests at once (503 past it)."""
    gate = Admission(config.max_in_flight)

    @app.post(ENCODE_PATH, **ENCODE_ROUTE)
    async def encode(request: Request) -> dict:
        if (refused := refusal()) is not None:
            raise refused
        if not gate.enter():
            raise overloaded(gate.limit)
        trace = tracing.current()  # None: tracing off
        try:
            body = _parse(EncodeRequest, await read_body(request, config.max_body_bytes))
            _check_counts(body.images, config)
            timeline.mark(body.room, "queued", images=len(body.images))
            try:
                uploads = await run_in_threadpool(_uploads, body.images, config.limits, service.video, fingerprint)
                results = await service.encode(body.room, uploads)
            except APIError as exc:
                timeline.mark(body.room, FAILED, reason=exc.message)
                if trace is not None:
                    trace.record("encoder", timeline.events(body.room), body.room)
                raise
        finally:
            gate.leave()
        _mark_results(timeline, body.room, results)
        if trace is not None:
            trace.record("encoder", timeline.events(body.room), body.room)
        return msgspec.to_builtins(EncodeAnswer(body.room, [
            EncodedImage(r.key, r.status, r.num_tokens, r.seconds) for r in results]))

    @app.post(ABORT_PATH, **ABORT_ROUTE)
    async def abort(request: Request) -> dict:
        body = _parse(AbortRequest, await read_body(request, config.max_body_bytes))
        return msgspec.to_builtins(AbortAnswer(body.room, service.abort(body.room)))


def _mark_results(timeline: RoomTimeline, room: int, results: list[ImageResult]) -> None:
    """Each image's outcome in the room's timeline, in time order: a video this request read
    (``video_decoded`` {key, frames, seconds}) when its frames were decoded, each vision-tower call that
    encoded images of the room (``batch`` {since, keys, batch_images}: the call's start and end, the
    room's keys in it, the images it took in all), encoded at the time its embedding was ready and its
    entry's write began, before any prefill could read it (a video's with its ``frames``), the others now."""
    now = time.time()
    marks: list[tuple[float, str, dict]] = []
    towers: dict[int, tuple[Tower, list[str]]] = {}  # id -> a vision-tower call that encoded images of this room
    for r in results:
        if r.tower is not None:
            towers.setdefault(id(r.tower), (r.tower, []))[1].append(r.key)
        if r.read is not None:
            marks.append((r.read.at, "video_decoded", {"key": r.key, "frames": r.read.frames,
                                                       "seconds": r.read.seconds}))
        if r.status == ENCODED:
            fields: dict = {"key": r.key, "num_tokens": r.num_tokens}
            marks.append((r.cached_at, "encoded", fields if r.frames is None else {**fields, "frames": r.frames}))
        else:
            marks.append((now, "cache_hit" if r.status == CACHED else r.status, {"key": r.key}))
    for tower, keys in towers.values():  # batch: since = the call's start, t = its end
        marks.append((tower.end, "batch", {"since": tower.start, "keys": keys, "batch_images": len(tower.keys)}))
    for at, event, fields in sorted(marks, key=lambda mark: mark[0]):
        timeline.mark(room, event, at=min(at, now), **fields)


def _check_counts(parts: list[ImagePart], config: ServerConfig) -> None:
    """400 for more images than ``--max-images-per-request``, or more videos than ``--max-videos-per-request``."""
    counted = sum(part.video is not None for part in parts)
    for count, most, what, code in ((len(parts) - counted, config.limits.max_images, "images", Code.TOO_MANY_IMAGES),
                                    (counted, config.video.max_videos, "videos", Code.TOO_MANY_VIDEOS)):
        if count > most:
            raise bad_request(f"The request has {count} {what}; this server accepts at most {most} per request.",
                              "images", code)


def _parse(model: type[M], raw: bytes | bytearray) -> M:
    """``raw`` validated as ``model``; 400 as the chat route's (nesting bound included)."""
    check_json_depth(raw)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _uploads(parts: list[ImagePart], limits: ImageLimits, video: VideoSetup | None, fingerprint: str) -> list[Upload]:
    """Each part's bytes and key (a video's with its sampling); 400/413 naming the first bad part (runs
    in a worker thread)."""
    uploads = []
    for i, part in enumerate(parts):
        param = f"images[{i}]"
        if part.video is not None:
            upload = _video_upload(part, video, fingerprint, param)
        else:
            data = decode_data_url(part.url, limits, param) if part.url is not None else \
                decode_base64(part.data or "", limits, param)
            upload = Upload(image_key(data, fingerprint), data)
        if part.key is not None:
            try:
                check_key(part.key)
            except ValueError as exc:
                raise bad_request(str(exc), f"{param}.key", "invalid_key") from None
            if part.key != upload.key:
                what = "image bytes" if upload.video is None else "video bytes and sampling"
                raise bad_request(f"The key does not match the {what} under this encoder's vision fingerprint "
                                  f"(expected {upload.key}).", f"{param}.key", "key_mismatch")
        uploads.append(upload)
    return uploads


def _video_upload(part: ImagePart, video: VideoSetup | None, fingerprint: str, param: str) -> Upload:
    """A video part's bytes (under ``--max-video-mb``), its sampling (checked by ``video_sampling``) and key."""
    if video is None:
        raise bad_request("This encoder's model takes no video.", f"{param}.video", Code.VIDEO_NOT_SUPPORTED)
    assert part.video is not None
    sampling = video_sampling(part.video, video.sampling, f"{param}.video")
    url = part.url if part.url is not None else "data:application/octet-stream;base64," + (part.data or "")
    data = videos.decode_data_url(url, video.limits, param)
    return Upload(video_key(data, sampling.to_json(), fingerprint), data, sampling)


def video_sampling(raw: dict[str, Any], base: VideoSampling, param: str) -> VideoSampling:
    """A video part's sampling, as the router resolved it, checked against this encoder's ``base``
    (``contract.video.check_resolved``). 400 ``invalid_value`` naming ``param`` (and the key) otherwise."""
    try:
        sampling = VideoSampling.from_json(raw)
        check_resolved(base, sampling, "encoder")
    except VideoSettingError as exc:
        raise bad_request(f"Invalid video sampling: {exc}.", param if exc.key is None else f"{param}.{exc.key}",
                          Code.INVALID_VALUE) from None
    except (TypeError, ValueError) as exc:
        raise bad_request(f"Invalid video sampling: {exc}", param, Code.INVALID_VALUE) from None
    return sampling
