"""Video parts of a chat body: the stages' published video settings, the router's refusals, each video
checked and planned (``RefVideo``) before any fan-out. Pure but for PyAV's CPU work (``ref_videos``
reads each file's header and packets: run it off the event loop).

The stages publish in ``/server_info`` a top-level ``video``: null (the model takes no video: every
video part is a 400 ``video_not_supported``), or the sampling every video starts from and the limits of
one video (``stages.resources.video_info``), read into ``PublishedVideo``. Workers that publish
different settings (they serve one model, so only their limits can differ) are merged into the
tightest: the smallest of each limit, the sampling of the first; one that publishes null makes video
unsupported; a worker that publishes no ``video`` key (or a malformed one) is left out, and when no
worker publishes one the router checks nothing of a video (the stages do).

For each video part (a ``data:`` URL by now: remote ones were fetched by ``router.plan.image_fetch``)
the router reads the bytes (``cache.video_bytes.data_url_bytes``), probes them (header and packets, no
frame decoded), resolves the request's sampling (the published one with the body's
``mm_processor_kwargs``, ``contract.video.within``) and plans it (``contract.video.plan``), refusing
with the stage's status, code and message, naming the part; in EPD mode each video then becomes a
``video_ref`` part for the prefill and the decode and an encoder's ``EncodeImage`` with ``video``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cache.keys import video_key
from cache.video_bytes import VideoBounds, VideoRefused, data_url_bytes, probe
from contract.encode import EncodeImage
from contract.errors import Code
from contract.video import VideoPlanError, VideoProbe, VideoSampling, VideoSettingError, plan, within
from router.errors import RouterError, bad_request
from router.plan.images import ImagePart, media_parts
from router.plan.limits import too_many_videos

TOKEN_CHARS = 4  # prefix routing weighs text in characters: a video's tokens at about this many each
_LIMITS = ("max_bytes", "max_pixels", "max_seconds", "max_frames", "decode_timeout_s")
_INTEGERS = ("max_bytes", "max_pixels", "max_frames")


@dataclass(frozen=True)
class PublishedVideo:
    """A stage's ``/server_info`` ``video`` object: the sampling every video starts from, one video's limits."""

    sampling: VideoSampling
    max_bytes: int
    max_pixels: int
    max_seconds: float
    max_frames: int
    decode_timeout_s: float

    @property
    def bounds(self) -> VideoBounds:
        """The limits as ``cache.video_bytes`` holds a video to them, refusals naming "this router"."""
        return VideoBounds(self.max_bytes, self.max_pixels, self.max_seconds, self.decode_timeout_s, holder="router")


def video_published(info: dict) -> tuple[bool | None, PublishedVideo | None]:
    """(takes video, its settings) from a stage's ``/server_info``: (None, None) when it publishes no
    ``video`` key or a malformed one (unknown), (False, None) for null, (True, settings) otherwise."""
    if "video" not in info:
        return None, None
    entry = info["video"]
    if entry is None:
        return False, None
    if not isinstance(entry, dict) or not isinstance(entry.get("sampling"), dict):
        return None, None
    values: dict[str, Any] = {name: entry.get(name) for name in _LIMITS}
    for name, value in values.items():
        wanted = int if name in _INTEGERS else (int, float)
        if isinstance(value, bool) or not isinstance(value, wanted) or not (math.isfinite(value) and value > 0):
            return None, None
    try:
        sampling = VideoSampling.from_json(entry["sampling"])
    except (TypeError, ValueError):
        return None, None
    return True, PublishedVideo(sampling, int(values["max_bytes"]), int(values["max_pixels"]),
                                float(values["max_seconds"]), int(values["max_frames"]),
                                float(values["decode_timeout_s"]))


def merged(each: Iterable[tuple[bool | None, PublishedVideo | None]]) -> tuple[bool | None, PublishedVideo | None]:
    """The workers' published video settings as one (see the module doc): (False, None) if any takes no
    video, else the smallest of each limit with the first one's sampling, else (None, None)."""
    found: PublishedVideo | None = None
    for takes, video in each:
        if takes is False:
            return False, None
        if video is None:
            continue
        found = video if found is None else replace(found, **{name: min(getattr(found, name), getattr(video, name))
                                                               for name in _LIMITS})
    return (None, None) if found is None else (True, found)


def video_parts(body: dict) -> list[ImagePart]:
    """Every ``video_url`` part (``{"url": ...}`` or the URL itself), in conversation order."""
    return media_parts(body, "video_url")


def check_video_count(count: int, own: int, stages: int | None) -> None:
    """400 ``too_many_videos`` over the router's ``--max-videos-per-request`` (``own``) or the stages'
    tighter limit (``stages``; None: unknown), in the words of whose limit it is."""
    if stages is not None and stages < own and count > stages:
        raise too_many_videos(count, stages)
    if count > own:
        raise bad_request(f"The request has {count} videos; this router accepts at most {own} "
                          "(--max-videos-per-request).", "messages", Code.TOO_MANY_VIDEOS)


def not_supported(model: str, param: str) -> RouterError:
    """The 400 for a video part when the stages published ``video: null``."""
    return bad_request(f"The model {model} does not take video input.", param, Code.VIDEO_NOT_SUPPORTED)


def request_sampling(base: VideoSampling, overrides: object) -> VideoSampling:
    """The request's sampling: ``base`` with the body's ``mm_processor_kwargs`` (None: none), within the
    stages' bounds; 400 ``invalid_value`` naming ``mm_processor_kwargs`` or ``mm_processor_kwargs.<key>``."""
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        raise bad_request("Invalid value for 'mm_processor_kwargs': must be an object.", "mm_processor_kwargs",
                          Code.INVALID_VALUE)
    try:
        return within(base, overrides)
    except VideoSettingError as exc:
        param = "mm_processor_kwargs" if exc.key is None else f"mm_processor_kwargs.{exc.key}"
        raise bad_request(f"Invalid video setting: {exc}", param, Code.INVALID_VALUE) from None


@dataclass(frozen=True)
class RefVideo:
    """A video part, checked and planned: ``key`` its cache key in EPD mode (None in other modes)."""

    part: dict  # the client's content part (not modified)
    url: str  # its data: URL, as an encoder takes it
    key: str | None
    probe: VideoProbe
    sampling: VideoSampling  # the request's, resolved
    num_tokens: int  # the plan's placeholder tokens
    param: str  # messages[i].content[j].video_url

    def ref(self) -> dict:
        """The ``video_ref`` part the prefill and the decode get in its place."""
        return {"type": "video_ref", "video_ref": {"key": self.key, "probe": self.probe.to_json(),
                                                   "sampling": self.sampling.to_json()}}

    def encoded(self) -> EncodeImage:
        """The encoder's ``EncodeImage``: the data: URL, the key, the resolved sampling."""
        return EncodeImage(key=self.key, url=self.url, video=self.sampling.to_json())

    @property
    def weight(self) -> int:
        """Prefix routing's weight of the video: its tokens, in characters of text."""
        return self.num_tokens * TOKEN_CHARS


def ref_videos(parts: Sequence[ImagePart], video: PublishedVideo, overrides: object,
               fingerprint: str | None) -> tuple[RefVideo, ...]:
    """Each video part checked, probed and planned under the request's sampling (``overrides``: the
    body's ``mm_processor_kwargs``), keyed under ``fingerprint`` (EPD; None: no key). Blocking (PyAV):
    call it in a thread. Raises RouterError (400 or 413) naming the part, or ``mm_processor_kwargs``."""
    if not parts:
        return ()
    sampling = request_sampling(video.sampling, overrides)
    return tuple(_ref_video(part, video.bounds, sampling, fingerprint) for part in parts)


def _ref_video(part: ImagePart, bounds: VideoBounds, sampling: VideoSampling, fingerprint: str | None) -> RefVideo:
    try:
        data = data_url_bytes(part.url, bounds)
        found = probe(data, bounds)
    except VideoRefused as exc:
        raise RouterError(exc.status, exc.message, code=exc.code, param=part.param) from None
    try:
        tokens = plan(found, sampling).num_tokens
    except VideoPlanError as exc:
        raise bad_request(f"The video cannot be sampled: {exc}.", part.param, Code.INVALID_VIDEO) from None
    key = None if fingerprint is None else video_key(data, sampling.to_json(), fingerprint)
    return RefVideo(part.part, part.url, key, found, sampling, tokens, part.param)
