"""``cache.video_bytes``, the one video parser, on real files encoded by PyAV (``tests/support/videos.py``),
no mocks: data URLs and their byte limit, the probe of MP4/WebM/QuickTime (size, frames counted from
packets, fps, codec), the sampled frames equal to a full decode's, every limit (bytes, pixels, seconds,
wall time), files that are no video, cut short, with more packets than frames or a size change, and a
fuzz of truncated and bit-flipped files that must end in a 400/413 refusal or an answer, nothing else."""

from __future__ import annotations

import base64
import collections
import time

import numpy
import pytest

from cache.video_bytes import VIDEO_MIME, VideoBounds, VideoRefused, data_url_bytes, decode_frames, probe
from contract.errors import Code
from contract.video import VideoPlanError, VideoSampling, plan
from tests.support.stage_api import png
from tests.support.videos import audio_only, data_url, make_video, size_change, with_hidden_frames

pytestmark = pytest.mark.unit

BOUNDS = VideoBounds(max_bytes=1_000_000, max_pixels=640 * 480, max_seconds=60, decode_timeout_s=10)
CONTAINERS = {"mp4": ("h264", "video/mp4"), "webm": ("vp9", "video/webm"), "mov": ("h264", "video/quicktime")}
QWEN2 = VideoSampling.from_processor_config("qwen2_vl", {})


def refused(fn, *args) -> VideoRefused:
    with pytest.raises(VideoRefused) as info:
        fn(*args)
    return info.value


def all_frames(data: bytes) -> list[numpy.ndarray]:
    return decode_frames(data, range(probe(data, BOUNDS).frames), BOUNDS)


# data: URLs

def test_data_url_gives_the_bytes():
    video = make_video()
    assert data_url_bytes(data_url(video), BOUNDS) == video
    assert data_url_bytes(data_url(video, "video/webm;codecs=vp9"), BOUNDS) == video
    assert data_url_bytes(data_url(video, "application/octet-stream"), BOUNDS) == video
    assert "video/mp4" in VIDEO_MIME


@pytest.mark.parametrize("url, code", [
    ("https://example.com/a.mp4", Code.REMOTE_IMAGE_URL),
    ("http://example.com/a.mp4", Code.REMOTE_IMAGE_URL),
    ("file:///etc/passwd", Code.INVALID_VIDEO_URL),
    ("AAAA", Code.INVALID_VIDEO_URL),
    ("data:video/mp4,AAAA", Code.INVALID_VIDEO_URL),
    ("data:video/mp4;base64", Code.INVALID_VIDEO_URL),
    ("data:image/png;base64,AAAA", Code.INVALID_VIDEO_URL),
    ("data:;base64,AAAA", Code.INVALID_VIDEO_URL),
    ("data:video/mp4;base64,not base64!", Code.INVALID_BASE64),
    ("data:video/mp4;base64,AAA", Code.INVALID_BASE64),
])
def test_bad_data_urls_are_400(url, code):
    error = refused(data_url_bytes, url, BOUNDS)
    assert (error.code, error.status) == (code, 400)


def test_data_url_over_the_byte_limit_is_413_before_decoding():
    bounds = VideoBounds(max_bytes=1_000, max_pixels=10**6, max_seconds=60, decode_timeout_s=10, holder="router")
    error = refused(data_url_bytes, "data:video/mp4;base64," + "!" * 2_000, bounds)  # not base64: never decoded
    assert (error.code, error.status) == (Code.VIDEO_TOO_LARGE, 413)
    assert "this router accepts at most 1000 bytes" in error.message and "--max-video-mb" in error.message
    exact = base64.b64encode(b"x" * 1_001).decode()  # within the encoded-length slack: counted after decoding
    assert refused(data_url_bytes, "data:video/mp4;base64," + exact, bounds).status == 413
    assert refused(probe, b"x" * 1_001, bounds).status == 413
    assert refused(decode_frames, b"x" * 1_001, [0], bounds).status == 413


# probe

@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_probe_reads_size_frames_fps_and_codec(container):
    codec, _ = CONTAINERS[container]
    found = probe(make_video(frames=16, width=64, height=48, fps=8, container=container), BOUNDS)
    assert (found.width, found.height, found.frames, found.fps, found.codec) == (64, 48, 16, 8.0, codec)
    assert found.duration_s == 2.0
    other = probe(make_video(frames=30, width=32, height=64, fps=15, container=container), BOUNDS)
    assert (other.width, other.height, other.frames, other.fps) == (32, 64, 30, 15.0)


def test_probe_of_vp8_and_matroska_and_mpeg_ts():
    assert probe(make_video(container="webm", codec="vp8"), BOUNDS).codec == "vp8"
    assert probe(make_video(container="mkv"), BOUNDS).frames == 16
    assert probe(make_video(container="ts"), BOUNDS).frames == 16


def test_over_the_pixel_limit_is_413():
    bounds = VideoBounds(max_bytes=10**6, max_pixels=64 * 48 - 1, max_seconds=60, decode_timeout_s=10)
    for call in (lambda: probe(make_video(), bounds), lambda: decode_frames(make_video(), [0], bounds)):
        with pytest.raises(VideoRefused) as info:
            call()
        assert (info.value.code, info.value.status) == (Code.VIDEO_TOO_LARGE, 413)
        assert "64x48 = 3072 pixels" in info.value.message and "--max-video-pixels" in info.value.message


def test_over_the_seconds_limit_is_413():
    video = make_video(frames=40, fps=8)  # 5 s
    at_limit = VideoBounds(max_bytes=10**6, max_pixels=10**6, max_seconds=5, decode_timeout_s=10)
    assert probe(video, at_limit).duration_s == 5
    under = VideoBounds(max_bytes=10**6, max_pixels=10**6, max_seconds=4.9, decode_timeout_s=10)
    error = refused(probe, video, under)
    assert (error.code, error.status) == (Code.VIDEO_TOO_LARGE, 413)
    assert "at least 40 frames at 8 fps" in error.message and "--max-video-seconds" in error.message


@pytest.mark.parametrize("call", [probe, lambda data, bounds: decode_frames(data, [0, 1, 15], bounds)])
def test_a_tiny_decode_timeout_is_400(call):
    bounds = VideoBounds(max_bytes=10**6, max_pixels=10**6, max_seconds=60, decode_timeout_s=1e-9)
    error = refused(call, make_video(), bounds)
    assert (error.code, error.status) == (Code.INVALID_VIDEO, 400)
    assert "took longer than 1e-09 s to read" in error.message


@pytest.mark.parametrize("data", [png(), b"", bytes(range(256)) * 8, numpy.random.default_rng(0).bytes(5000),
                                  b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 100])
def test_what_is_no_video_is_400(data):
    for call in (lambda: probe(data, BOUNDS), lambda: decode_frames(data, [0], BOUNDS)):
        with pytest.raises(VideoRefused) as info:
            call()
        assert (info.value.code, info.value.status) == (Code.INVALID_VIDEO, 400)


def test_a_png_is_not_opened_as_a_one_frame_video():
    error = refused(probe, png(), BOUNDS)
    assert "not a video in a supported container" in error.message


def test_no_video_stream_is_400():
    error = refused(probe, audio_only(), BOUNDS)
    assert (error.code, error.status, error.message) == (Code.INVALID_VIDEO, 400, "The video has no video stream.")


def test_a_truncated_mp4_is_400():
    video = make_video(frames=32)  # moov at the end: the first half has no index
    error = refused(probe, video[:len(video) // 2], BOUNDS)
    assert (error.code, error.status) == (Code.INVALID_VIDEO, 400)


def test_a_truncated_webm_probes_fewer_frames_and_decodes_them():
    video = make_video(frames=32, container="webm")
    cut = video[:len(video) // 2]
    found = probe(cut, BOUNDS)
    assert 0 < found.frames < 32
    frames = decode_frames(cut, range(found.frames), BOUNDS)
    full = all_frames(video)
    assert all(numpy.array_equal(a, b) for a, b in zip(frames[:-1], full))  # the last may be cut itself


# decode_frames

@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_decode_gives_exactly_the_sampled_frames(container):
    video = make_video(frames=40, container=container)
    full = all_frames(video)
    assert len(full) == 40 and all(f.shape == (48, 64, 3) and f.dtype == numpy.uint8 for f in full)
    assert all(not numpy.array_equal(a, b) for a, b in zip(full, full[1:]))  # the frames differ
    indices = list(plan(probe(video, BOUNDS), QWEN2).indices)
    assert len(indices) >= 4
    sampled = decode_frames(video, indices, BOUNDS)
    assert len(sampled) == len(indices)
    assert numpy.array_equal(numpy.stack(sampled), numpy.stack(full)[indices])


def test_repeated_indices_repeat_the_frame():
    video = make_video()
    full = all_frames(video)
    sampled = decode_frames(video, [0, 0, 3, 3, 3, 15], BOUNDS)
    assert [numpy.array_equal(s, full[i]) for s, i in zip(sampled, [0, 0, 3, 3, 3, 15])] == [True] * 6


def test_decode_stops_after_the_last_index():
    long = make_video(frames=240, container="mp4")
    assert probe(long, BOUNDS).frames == 240
    start = time.perf_counter()
    first = decode_frames(long, [0], BOUNDS)
    one = time.perf_counter() - start
    assert len(first) == 1 and numpy.array_equal(first[0], all_frames(long)[0])
    assert one < 1.0
    # past the stream's end: what it has is not enough, and the refusal says how many there were
    error = refused(decode_frames, long, [0, 240], BOUNDS)
    assert "ended after 240 decoded frames" in error.message


def test_empty_and_bad_indices():
    assert decode_frames(b"not even read", [], BOUNDS) == []
    with pytest.raises(ValueError):
        decode_frames(make_video(), [3, 2], BOUNDS)
    with pytest.raises(ValueError):
        decode_frames(make_video(), [-1, 2], BOUNDS)


def test_fewer_frames_than_packets_is_400():
    video = with_hidden_frames(frames=16, hidden=4)
    found = probe(video, BOUNDS)
    assert found.frames == 20  # packets counted, as promised
    assert len(decode_frames(video, range(16), BOUNDS)) == 16
    error = refused(decode_frames, video, [0, 19], BOUNDS)
    assert (error.code, error.status) == (Code.INVALID_VIDEO, 400)
    assert error.message == ("The video ended after 16 decoded frames; its packets promise 20 (frame 19 was to be "
                             "sampled).")


def test_a_size_change_mid_stream_is_400():
    video = size_change(frames=8)
    assert (probe(video, BOUNDS).width, probe(video, BOUNDS).height) == (64, 48)
    assert len(decode_frames(video, range(8), BOUNDS)) == 8
    error = refused(decode_frames, video, [0, 9], BOUNDS)
    assert (error.code, error.status) == (Code.INVALID_VIDEO, 400)
    assert "frame 8 is 32x24, the stream's header says 64x48" in error.message


# fuzz

def mutations(video: bytes, rng: numpy.random.Generator, count: int):
    """``count`` broken copies of ``video``: half cut at a random length, half with 1..64 random bytes
    XORed with a random non-zero value."""
    for k in range(count):
        if k % 2 == 0:
            yield "truncated", video[:int(rng.integers(0, len(video)))]
        else:
            data = bytearray(video)
            for at in rng.integers(0, len(data), int(rng.integers(1, 65))):
                data[at] ^= int(rng.integers(1, 256))
            yield "flipped", bytes(data)


def outcome(data: bytes) -> str:
    """What the parser made of ``data``: any exception but a 400/413 refusal fails the test."""
    try:
        found = probe(data, BOUNDS)
    except VideoRefused as exc:
        assert exc.status in (400, 413), exc.message
        return f"probe {exc.status} {exc.code} {exc.message.split(':')[0][:40]}"
    try:
        indices = plan(found, QWEN2).indices
    except VideoPlanError:
        return "probed, not sampleable"
    try:
        frames = decode_frames(data, indices, BOUNDS)
    except VideoRefused as exc:
        assert exc.status in (400, 413), exc.message
        return f"decode {exc.status} {exc.code} {exc.message.split(':')[0][:40]}"
    assert len(frames) == len(indices)
    assert all(f.shape == (found.height, found.width, 3) and f.dtype == numpy.uint8 for f in frames)
    return "decoded"


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_fuzz_broken_files_end_in_a_refusal_or_an_answer(container):
    video = make_video(frames=24, width=48, height=32, fps=8, container=container)
    rng = numpy.random.default_rng(sum(map(ord, container)))
    seen: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    for kind, data in mutations(video, rng, 200):
        seen[f"{kind}: {outcome(data)}"] += 1
    elapsed = time.perf_counter() - start
    print(f"\n{container}: 200 mutations in {elapsed:.2f} s")
    for name, n in sorted(seen.items()):
        print(f"  {n:4d}  {name}")
    assert elapsed < 60
    assert sum(seen.values()) == 200
    assert any("400" in name for name in seen)  # the broken files were noticed, some of them at least
