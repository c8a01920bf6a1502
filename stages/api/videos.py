"""The stage's side of a video: ``cache.video_bytes`` with its ``--max-video-*`` limits, the server's
sampling (``contract.video``), and each refusal as an ``APIError`` naming the part (``param``).

Stage servers take ``data:`` URLs only (the router fetches remote ones, from its allow-list). A video
costs, in order: its base64 length (before decoding), its byte count, its header and packets (``probe``:
size, duration, frame count, a decodable codec), its plan (``contract.video.plan``: frames and size),
then only the planned frames are decoded (within ``--video-decode-timeout-s``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from cache import video_bytes
from cache.video_bytes import VideoBounds, VideoRefused
from contract.errors import Code
from contract.video import VideoPlan, VideoPlanError, VideoProbe, VideoSampling, VideoSettingError, plan, within
from stages.api.errors import APIError, bad_request
from stages.config import VideoLimits
from stages.resources import video_info
from stages.video_preprocess import VideoConfig

T = TypeVar("T")


def server_sampling(checkpoint: VideoSampling, limits: VideoLimits) -> VideoSampling:
    """The sampling a server starts every video from: the checkpoint's, with ``--mm-processor-kwargs``,
    frames capped at ``--max-video-frames``. ValueError naming the flag for settings it cannot take."""
    try:
        sampling = checkpoint.with_overrides(dict(limits.sampling))
    except ValueError as exc:
        raise ValueError(f"--mm-processor-kwargs: {exc}") from None
    most = limits.max_frames
    return replace(sampling, max_frames=min(sampling.max_frames, most), min_frames=min(sampling.min_frames, most),
                   num_frames=None if sampling.num_frames is None else min(sampling.num_frames, most))


def published(config: VideoConfig | None, limits: VideoLimits) -> dict | None:
    """``/server_info`` ``video`` of a stage whose prompt builder has ``config`` (None: no video)."""
    return video_info(None if config is None else server_sampling(config.sampling, limits), limits)


def request_sampling(base: VideoSampling, overrides: Mapping[str, Any] | None) -> VideoSampling:
    """A request's sampling: ``base`` with its ``mm_processor_kwargs`` within the server's bounds; 400
    ``invalid_value`` naming ``mm_processor_kwargs.<key>``."""
    try:
        return within(base, overrides or {})
    except VideoSettingError as exc:
        param = "mm_processor_kwargs" if exc.key is None else f"mm_processor_kwargs.{exc.key}"
        raise bad_request(f"Invalid video setting: {exc}", param, Code.INVALID_VALUE) from None


def bounds(limits: VideoLimits) -> VideoBounds:
    return VideoBounds(limits.max_bytes, limits.max_pixels, limits.max_seconds, limits.decode_timeout_s)


def decode_data_url(url: str, limits: VideoLimits, param: str | None = None) -> bytes:
    """``data:video/mp4;base64,...`` -> the file's bytes. Raises APIError (400 or 413)."""
    return _as_api_error(param, video_bytes.data_url_bytes, url, bounds(limits))


def probe(data: bytes, limits: VideoLimits, param: str | None = None) -> VideoProbe:
    """The file's header and packets, within the limits (no frame decoded). Raises APIError (400 or 413)."""
    return _as_api_error(param, video_bytes.probe, data, bounds(limits))


def planned(probe_: VideoProbe, sampling: VideoSampling, param: str | None = None) -> VideoPlan:
    """The video's plan under ``sampling``; 400 ``invalid_video`` if it cannot be sampled so."""
    try:
        return plan(probe_, sampling)
    except VideoPlanError as exc:
        raise bad_request(f"The video cannot be sampled: {exc}.", param, Code.INVALID_VIDEO) from None


def frames(data: bytes, video_plan: VideoPlan, limits: VideoLimits, param: str | None = None) -> list[np.ndarray]:
    """The plan's frames, decoded (and nothing past the last). Raises APIError 400."""
    return _as_api_error(param, video_bytes.decode_frames, data, video_plan.indices, bounds(limits))


def _as_api_error(param: str | None, parse: Callable[..., T], *args: Any) -> T:
    """``parse(*args)``; its ``VideoRefused`` as an APIError of the same status, code and message naming ``param``."""
    try:
        return parse(*args)
    except VideoRefused as exc:
        raise APIError(exc.status, exc.message, param=param, code=exc.code) from None
