"""Small deterministic test videos, encoded in memory with PyAV (its wheel's FFmpeg: libx264, libvpx, ...),
each built once per process (``functools.cache``: bytes are immutable).

``make_video``: frames that differ from one another (a gradient moving across, a square of a seeded
colour at a seeded place); ``data_url``; ``audio_only`` (an M4A with one AAC stream and no video);
``with_hidden_frames`` (a VP8 WebM whose last packets are frames never shown: more packets than frames);
``size_change`` (an MPEG-TS whose H.264 stream changes size mid-stream).
"""

from __future__ import annotations

import base64
import functools
import io
from fractions import Fraction

import av
import numpy

FORMATS = {"mp4": "mp4", "webm": "webm", "mov": "mov", "mkv": "matroska", "ts": "mpegts", "avi": "avi"}


def default_codec(container: str) -> str:
    """h264 where this FFmpeg can encode it (mpeg4 otherwise); vp9 for WebM."""
    if container == "webm":
        return "vp9"
    try:
        av.codec.Codec("libx264", "w")
    except av.error.FFmpegError:
        return "mpeg4"
    return "h264"


def frame_pixels(index: int, width: int, height: int, rng: numpy.random.Generator) -> numpy.ndarray:
    """Frame ``index``'s RGB pixels: a horizontal gradient shifted by the index, a seeded square."""
    x = (numpy.arange(width) * 255 // max(width - 1, 1) + index * 23) % 256
    y = numpy.arange(height) * 255 // max(height - 1, 1)
    pixels = numpy.empty((height, width, 3), numpy.uint8)
    pixels[..., 0] = x[None, :]
    pixels[..., 1] = y[:, None]
    pixels[..., 2] = (index * 37) % 256
    side = max(2, min(width, height) // 4)
    top, left = int(rng.integers(0, height - side + 1)), int(rng.integers(0, width - side + 1))
    pixels[top:top + side, left:left + side] = rng.integers(0, 256, 3, dtype=numpy.uint8)
    return pixels


@functools.cache
def make_video(frames: int = 16, width: int = 64, height: int = 48, fps: int | Fraction = 8,
               container: str = "mp4", codec: str | None = None, seed: int = 0) -> bytes:
    """A ``frames``-frame ``width x height`` video at ``fps`` in ``container`` (a key of ``FORMATS``),
    yuv420p (even sides), every frame different."""
    buffer = io.BytesIO()
    rng = numpy.random.default_rng(seed)
    with av.open(buffer, mode="w", format=FORMATS[container]) as output:
        stream = output.add_stream(codec or default_codec(container), rate=fps)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if stream.codec_context.name == "libx264":
            stream.codec_context.options = {"preset": "ultrafast"}
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(index, width, height, rng), format="rgb24")
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return buffer.getvalue()


def data_url(video: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(video).decode()


@functools.cache
def audio_only(seconds: float = 0.5, rate: int = 8000) -> bytes:
    """An M4A (the mov demuxer's) with one AAC stream: a file that opens, with no video stream."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as output:
        stream = output.add_stream("aac", rate=rate)
        assert isinstance(stream, av.AudioStream)
        samples = int(seconds * rate)
        tone = (numpy.sin(numpy.arange(samples) / rate * 2 * numpy.pi * 440) * 0.2).astype(numpy.float32)
        step = 1024
        for start in range(0, samples, step):
            frame = av.AudioFrame.from_ndarray(tone[None, start:start + step].copy(), format="fltp", layout="mono")
            frame.sample_rate = rate
            frame.pts = start
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return buffer.getvalue()


@functools.cache
def with_hidden_frames(frames: int = 16, hidden: int = 4) -> bytes:
    """A VP8 WebM of ``frames`` shown frames then ``hidden`` packets that decode to no frame (its first
    keyframe with the frame tag's show_frame bit cleared): ``frames + hidden`` packets, ``frames`` frames."""
    source = make_video(frames=frames, container="webm", codec="vp8")
    buffer = io.BytesIO()
    with av.open(io.BytesIO(source), mode="r") as given, av.open(buffer, mode="w", format="webm") as output:
        stream = given.streams.video[0]
        copy = output.add_stream_from_template(stream)
        first: bytes | None = None
        pts = duration = 0
        time_base: Fraction | None = None
        for packet in given.demux(stream):
            if packet.dts is None:
                continue
            first = first if first is not None else bytes(packet)
            pts, duration, time_base = packet.pts or 0, packet.duration or 1, packet.time_base
            packet.stream = copy
            output.mux(packet)
        assert first is not None
        invisible = bytes([first[0] & ~0x10]) + first[1:]
        assert time_base is not None
        for k in range(hidden):
            extra = av.Packet(invisible)
            extra.stream, extra.time_base = copy, time_base
            extra.pts = extra.dts = pts + (k + 1) * duration
            extra.duration = duration
            output.mux(extra)
    return buffer.getvalue()


@functools.cache
def size_change(frames: int = 8) -> bytes:
    """An MPEG-TS of ``frames`` 64x48 H.264 frames then ``frames`` 32x24 ones (two encodes, concatenated)."""
    return (make_video(frames=frames, width=64, height=48, container="ts")
            + make_video(frames=frames, width=32, height=24, container="ts", seed=1))
