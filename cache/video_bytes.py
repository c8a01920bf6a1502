"""A video as a client sends it -> its checked bytes, what its header and packets say (``VideoProbe``), its frames.

The one place that parses video ``data:`` URLs and video files (PyAV, whose wheel bundles FFmpeg): the
router reads the probe for its limits and the video's cache key (``cache.keys.video_key``, with the plan
of ``contract.video``), every stage that takes a video probes it and decodes the frames the plan samples,
and so does the encoder. It lives in ``cache`` for the reasons ``cache.image_bytes`` does (the router may
import ``cache``, nothing of ``stages``). Pure: no I/O besides the bytes in memory, no torch (the router
imports it), nothing else of ours but ``contract`` and ``cache.image_bytes``; no metrics (callers time it).

Each limit is checked before the expensive step it protects: the encoded length before base64 decoding
(``--max-video-mb``, as bytes), the byte count again before the file is opened; the first video
stream's width x height from its header (``--max-video-pixels``) before any packet is read; its
duration (``--max-video-seconds``: packets counted / average frame rate) while counting, stopping at
the first packet past the limit; and only ``decode_frames`` decodes, frame by frame up to the last
sampled index, each frame's size held to the header's (and FFmpeg's own ``max_pixels`` to the limit,
so a frame that grows mid-stream is refused before it is allocated). Opening a file probes it: FFmpeg
reads up to its ``probesize`` (5 MB) and may decode a frame or two to fill in the stream's parameters,
before the pixel limit can be checked. Only the demuxers of ``DEMUXERS`` are tried (``format_whitelist``:
no image pipe, no playlist format that opens other files). Every read is bounded in wall time by
``--video-decode-timeout-s``, checked between packets and frames.

A refusal is ``VideoRefused`` (an HTTP status, a code, a message), always a 400 or a 413: the file is
the client's, so whatever FFmpeg makes of it (an ``av.error.FFmpegError``, an ``OSError``, a
``ValueError``, ...) is a 400 ``invalid_video``; the caller names the part (``param``) and raises its own
error.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction

import av
import av.error
import numpy

from cache.image_bytes import PayloadRefused, decode_payload, url_scheme
from contract.errors import Code
from contract.video import VideoProbe

# What a video data: URL may say it is (its parameters, ";codecs=...", aside). The bytes decide: the
# demuxer is found from the data, among ``DEMUXERS``, whatever the type says.
VIDEO_MIME = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/matroska",
              "video/x-msvideo", "video/avi", "video/mp2t", "video/mpeg", "video/ogg", "video/3gpp",
              "video/3gpp2", "application/octet-stream")
# FFmpeg's demuxers tried on the bytes (their short names: "mov" is mov/mp4/m4a/3gp, "matroska" is mkv/webm)
DEMUXERS = ("mov", "matroska", "avi", "mpegts", "mpeg", "ogg")
_CONTAINERS = "MP4/QuickTime, Matroska/WebM, AVI, MPEG-TS, MPEG-PS or Ogg"
# What FFmpeg and PyAV raise on a broken file (av.error.FFmpegError's kinds subclass these builtins too)
_READ_ERRORS = (av.error.FFmpegError, OSError, ValueError, EOFError, LookupError, ArithmeticError)


@dataclass(frozen=True)
class VideoBounds:
    """The limits on one video, and who holds them (named in the refusals: "this server", "this router")."""

    max_bytes: int  # --max-video-mb (as bytes): the file's size
    max_pixels: int  # --max-video-pixels: the source frame's width * height
    max_seconds: float  # --max-video-seconds: frames / fps
    decode_timeout_s: float  # --video-decode-timeout-s: wall time of one read (probe and frames each)
    holder: str = "server"

    def __post_init__(self) -> None:
        if not (self.max_bytes > 0 and self.max_pixels > 0 and self.max_seconds > 0 and self.decode_timeout_s > 0):
            raise ValueError(f"video limits must be > 0, got {self.max_bytes} bytes, {self.max_pixels} pixels, "
                             f"{self.max_seconds} s, a {self.decode_timeout_s} s decode timeout")


class VideoRefused(Exception):
    """A video refused: ``code`` a video code of ``contract.errors.Code`` (or ``remote_image_url``),
    ``status`` its (400 or 413), ``message`` for the client."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.status = code.status
        self.code = code
        self.message = message


def data_url_bytes(url: str, bounds: VideoBounds) -> bytes:
    """``data:video/mp4;base64,...`` -> the file's bytes (not yet known to be a video): 400
    ``remote_image_url`` for http(s), ``invalid_video_url`` (not a data: URL, not base64, a type not in
    ``VIDEO_MIME``), ``invalid_base64``; 413 ``video_too_large``, from the encoded length before decoding."""
    scheme = url_scheme(url)
    if scheme in ("http", "https"):
        raise VideoRefused(Code.REMOTE_IMAGE_URL, "Remote video URLs are not fetched by stage servers; send the "
                           "video as a data: URL (data:video/mp4;base64,...).")
    if scheme != "data":
        raise VideoRefused(Code.INVALID_VIDEO_URL, "video_url must be a data: URL (data:video/mp4;base64,...).")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise VideoRefused(Code.INVALID_VIDEO_URL,
                           "Video data URLs must be base64 encoded (data:video/mp4;base64,...).")
    mime = header.split(";", 1)[0].strip().lower()
    if mime not in VIDEO_MIME:
        raise VideoRefused(Code.INVALID_VIDEO_URL, f"A video data URL's type must be one of {', '.join(VIDEO_MIME)}; "
                           f"got {mime[:40]!r}.")
    try:
        return decode_payload(payload, bounds.max_bytes)
    except PayloadRefused as exc:
        raise (VideoRefused(Code.INVALID_BASE64, "The video data URL is not valid base64.") if exc.size is None
               else too_many_bytes(exc.size, bounds)) from None


def probe(data: bytes, bounds: VideoBounds) -> VideoProbe:
    """What the file says of its first video stream, read from its header and by demuxing it (no frame is
    decoded; FFmpeg's own probing at open aside): 400 ``invalid_video`` (not a video, no video stream, no
    decoder for its codec, no frames, no frame rate, unreadable, too slow), 413 ``video_too_large``
    (bytes, pixels, seconds). ``frames`` counts the stream's packets with a payload (the container's own
    count is 0 for WebM and may lie)."""
    _check_bytes(data, bounds)
    deadline = time.monotonic() + bounds.decode_timeout_s
    with _reading(), _opened(data) as container:
        stream = _video_stream(container)
        width, height, codec = _checked_stream(stream, bounds)
        rate = _rate(stream)
        most = math.floor(bounds.max_seconds * rate) if rate else None  # the frames within --max-video-seconds
        frames = 0
        for packet in container.demux(stream):
            _check_deadline(deadline, bounds)
            if packet.size:
                frames += 1
                if most is not None and rate is not None and frames > most:
                    raise _too_long(f"at least {frames / rate:.3g}", f"at least {frames} frames at {rate:g} fps",
                                    bounds)
        if frames == 0:
            raise VideoRefused(Code.INVALID_VIDEO, "The video has no frames.")
        fps = rate or _rate_from_duration(stream, container, frames)
    if fps is None:
        raise VideoRefused(Code.INVALID_VIDEO, "The video's frame rate could not be read.")
    if frames / fps > bounds.max_seconds:
        raise _too_long(f"{frames / fps:.3g}", f"{frames} frames at {fps:g} fps", bounds)
    return VideoProbe(width=width, height=height, frames=frames, fps=fps, codec=codec)


def decode_frames(data: bytes, indices: Sequence[int], bounds: VideoBounds) -> list[numpy.ndarray]:
    """The frames at ``indices`` (ascending, repeats allowed: ``contract.video.plan``'s), counted from 0 in
    the first video stream's output order, each ``height x width x 3`` uint8 RGB; a repeated index gives
    the same array again. Decodes sequentially and stops after the last index, holding only the sampled
    frames. 400 ``invalid_video``: fewer frames than the indices need (the packets promised more), a frame
    whose size differs from the header's, unreadable, too slow; 413 ``video_too_large`` (bytes, pixels).
    ValueError for indices that are not ascending and >= 0 (the caller's mistake, not the client's)."""
    wanted = list(indices)
    if (wanted and wanted[0] < 0) or any(b < a for a, b in zip(wanted, wanted[1:])):
        raise ValueError(f"frame indices must be >= 0 and ascending, got {wanted[:20]}")
    if not wanted:
        return []
    _check_bytes(data, bounds)
    deadline = time.monotonic() + bounds.decode_timeout_s
    frames: list[numpy.ndarray] = []
    with _reading(), _opened(data) as container:
        stream = _video_stream(container)
        width, height, _ = _checked_stream(stream, bounds)
        stream.thread_type = "AUTO"
        stream.codec_context.options = {"max_pixels": str(bounds.max_pixels)}
        packets = decoded = 0
        for packet in container.demux(stream):
            _check_deadline(deadline, bounds)
            packets += 1 if packet.size else 0
            for frame in packet.decode():
                if (frame.width, frame.height) != (width, height):
                    raise VideoRefused(Code.INVALID_VIDEO, f"The video's frames change size mid-stream: frame "
                                       f"{decoded} is {frame.width}x{frame.height}, the stream's header says "
                                       f"{width}x{height}.")
                if decoded == wanted[len(frames)]:
                    array = frame.to_ndarray(format="rgb24")
                    while len(frames) < len(wanted) and wanted[len(frames)] == decoded:
                        frames.append(array)
                    if len(frames) == len(wanted):
                        return frames
                decoded += 1
                _check_deadline(deadline, bounds)
    raise VideoRefused(Code.INVALID_VIDEO, f"The video ended after {decoded} decoded frames; its packets promise "
                       f"{packets} (frame {wanted[len(frames)]} was to be sampled).")


def too_many_bytes(size: int | str, bounds: VideoBounds) -> VideoRefused:
    """413 ``video_too_large`` for a file of ``size`` bytes (a number, or "more than N" mid-read)."""
    return VideoRefused(Code.VIDEO_TOO_LARGE, f"The video is {size} bytes; this {bounds.holder} accepts at most "
                        f"{bounds.max_bytes} bytes per video (--max-video-mb).")


def _check_bytes(data: bytes, bounds: VideoBounds) -> None:
    if len(data) > bounds.max_bytes:
        raise too_many_bytes(len(data), bounds)


def _check_deadline(deadline: float, bounds: VideoBounds) -> None:
    if time.monotonic() > deadline:
        raise VideoRefused(Code.INVALID_VIDEO, f"The video took longer than {bounds.decode_timeout_s:g} s to read "
                           "(--video-decode-timeout-s).")


def _too_long(seconds: str, detail: str, bounds: VideoBounds) -> VideoRefused:
    return VideoRefused(Code.VIDEO_TOO_LARGE, f"The video is {seconds} seconds long ({detail}); this "
                        f"{bounds.holder} accepts at most {bounds.max_seconds:g} seconds per video "
                        "(--max-video-seconds).")


@contextmanager
def _opened(data: bytes) -> Iterator[av.container.InputContainer]:
    """The file opened by one of ``DEMUXERS`` (400 ``invalid_video`` if none takes it), closed on exit."""
    try:
        container = av.open(io.BytesIO(data), mode="r", options={"format_whitelist": ",".join(DEMUXERS)},
                            metadata_errors="ignore")
    except _READ_ERRORS as exc:
        raise VideoRefused(Code.INVALID_VIDEO, f"The data is not a video in a supported container ({_CONTAINERS}): "
                           f"{_reason(exc)}") from None
    with container:
        yield container


@contextmanager
def _reading() -> Iterator[None]:
    """FFmpeg's and PyAV's failures while reading the file as ``VideoRefused`` (our own refusals pass)."""
    try:
        yield
    except _READ_ERRORS as exc:
        raise VideoRefused(Code.INVALID_VIDEO, f"The video could not be read: {_reason(exc)}") from None


def _video_stream(container: av.container.InputContainer) -> av.VideoStream:
    if not container.streams.video:
        raise VideoRefused(Code.INVALID_VIDEO, "The video has no video stream.")
    return container.streams.video[0]


def _checked_stream(stream: av.VideoStream, bounds: VideoBounds) -> tuple[int, int, str]:
    """(width, height, codec) of the stream, from its header: 400 for a codec this FFmpeg cannot decode or
    an empty frame size, 413 over ``bounds.max_pixels``."""
    if stream.codec_context is None:  # PyAV found no decoder for the stream's codec id (nor can name it then)
        raise VideoRefused(Code.INVALID_VIDEO, f"The video's codec cannot be decoded by this {bounds.holder} (no "
                           "decoder for it in this FFmpeg).")
    codec = stream.codec_context.codec.canonical_name  # the codec's name ("h264", "av1"), not the decoder's
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > bounds.max_pixels:
        raise VideoRefused(Code.VIDEO_TOO_LARGE, f"The video is {width}x{height} = {width * height} pixels a frame; "
                           f"this {bounds.holder} accepts at most {bounds.max_pixels} pixels per frame "
                           "(--max-video-pixels).")
    if width <= 0 or height <= 0:
        raise VideoRefused(Code.INVALID_VIDEO, "The video's frame size could not be read.")
    return width, height, codec


def _rate(stream: av.VideoStream) -> float | None:
    """The stream's average frame rate (else FFmpeg's guess), if a positive finite one."""
    for rate in (stream.average_rate, stream.guessed_rate):
        if rate is not None and rate.denominator and 0 < rate < 10**6:
            return float(rate)
    return None


def _rate_from_duration(stream: av.VideoStream, container: av.container.InputContainer, frames: int) -> float | None:
    """frames / the stream's (else the container's) duration, for a file that states no frame rate."""
    seconds: Fraction | float | None = None
    if stream.duration and stream.time_base:
        seconds = stream.duration * stream.time_base
    elif container.duration:
        seconds = container.duration / av.time_base
    if seconds is None or not seconds > 0:
        return None
    fps = frames / float(seconds)
    return fps if math.isfinite(fps) and 0 < fps < 10**6 else None


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return f"{reason}." if not reason.endswith(".") else reason
