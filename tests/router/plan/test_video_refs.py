"""Video parts at the router (router/plan/videos.py, the video side of image_refs.py and prefix_tree.py):
the stages' published video settings read and merged, the counts, the request's sampling, each video
probed and planned from real PyAV-made files (tests/support/videos.py) and refused naming its part,
its reference and its encoder item. Pure: no sockets."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from cache.keys import video_key
from contract.errors import Code
from contract.video import VideoProbe, VideoSampling, plan
from router.errors import RouterError
from router.plan.image_refs import encode_body, with_refs
from router.plan.modes import Call
from router.plan.prefix_tree import IMAGE_CHARS, chat_units
from router.plan.videos import (TOKEN_CHARS, PublishedVideo, check_video_count, merged, ref_videos,
                                request_sampling, video_parts, video_published)
from tests.support.router_epd import FP
from tests.support.videos import data_url, make_video

pytestmark = pytest.mark.unit

SAMPLING = VideoSampling.from_processor_config("qwen2_vl", {})
PARAM = "messages[0].content[0].video_url"


def info(**changes) -> dict:
    return {"sampling": SAMPLING.to_json(), "max_bytes": 1 << 20, "max_pixels": 640 * 480, "max_seconds": 60.0,
            "max_frames": 64, "decode_timeout_s": 10.0, **changes}


PUBLISHED = video_published({"video": info()})[1]
assert PUBLISHED is not None


def body_of(*urls: str, **fields) -> dict:
    parts = [{"type": "video_url", "video_url": {"url": url}} for url in urls]
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
            **fields}


def refused(call) -> RouterError:
    with pytest.raises(RouterError) as caught:
        call()
    return caught.value


# --- /server_info "video" -------------------------------------------------------------------------
def test_the_published_video_settings_are_read_null_unknown_or_malformed():
    assert video_published({}) == (None, None)  # an older stage: unknown, nothing checked
    assert video_published({"video": None}) == (False, None)  # the model takes no video
    takes, video = video_published({"video": info()})
    assert takes is True and video == PublishedVideo(SAMPLING, 1 << 20, 640 * 480, 60.0, 64, 10.0)
    assert video.bounds.holder == "router" and video.bounds.max_bytes == 1 << 20
    for bad in (info(max_bytes=0), info(max_frames=2.5), info(max_seconds=True), info(sampling={"rule": "x"}),
                info(sampling=None), "video"):
        assert video_published({"video": bad}) == (None, None), bad


def test_workers_that_disagree_give_the_tightest_limits_and_the_first_ones_sampling():
    other = VideoSampling.from_processor_config("qwen2_vl", {"fps": 1.0})
    first = video_published({"video": info(max_bytes=100, max_seconds=30.0)})
    second = video_published({"video": info(sampling=other.to_json(), max_pixels=1000, decode_timeout_s=2.0)})
    takes, video = merged([(None, None), first, second])
    assert takes is True and video == PublishedVideo(SAMPLING, 100, 1000, 30.0, 64, 2.0)
    assert merged([first, (False, None), second]) == (False, None)  # one takes none: no video
    assert merged([(None, None)]) == merged([]) == (None, None)


# --- counts, the request's sampling ---------------------------------------------------------------
@pytest.mark.parametrize("count, own, stages, message", [
    (3, 2, None, "The request has 3 videos; this router accepts at most 2 (--max-videos-per-request)."),
    (2, 2, 1, "The request has 2 videos; the stages behind this router accept at most 1 per request "
              "(their --max-videos-per-request)."),
    (3, 2, 4, "The request has 3 videos; this router accepts at most 2 (--max-videos-per-request)."),
])
def test_too_many_videos_names_whose_limit_it_is(count, own, stages, message):
    error = refused(lambda: check_video_count(count, own, stages))
    assert (error.status, error.code, error.param, error.message) == (400, Code.TOO_MANY_VIDEOS, "messages", message)
    check_video_count(own, own, None)


def test_the_requests_sampling_is_the_published_one_with_its_mm_processor_kwargs():
    assert request_sampling(SAMPLING, None) == SAMPLING
    assert request_sampling(SAMPLING, {"num_frames": 8}) == dataclasses.replace(SAMPLING, fps=None, num_frames=8)


@pytest.mark.parametrize("kwargs, param, message", [
    ([1], "mm_processor_kwargs", "Invalid value for 'mm_processor_kwargs': must be an object."),
    ({"frames": 2}, "mm_processor_kwargs.frames", "Invalid video setting: unknown video setting 'frames'; the "
                                                  "settings are fps, num_frames, min_frames, max_frames, min_pixels, "
                                                  "max_pixels"),
    ({"max_frames": 1000}, "mm_processor_kwargs.max_frames",
     "Invalid video setting: max_frames is 1000; this server samples at most 768"),
    ({"min_frames": 9, "max_frames": 8}, "mm_processor_kwargs",
     "Invalid video setting: min_frames (9) is more than max_frames (8)"),
])
def test_bad_mm_processor_kwargs_are_invalid_values_naming_the_key(kwargs, param, message):
    error = refused(lambda: request_sampling(SAMPLING, kwargs))
    assert (error.status, error.code, error.param, error.message) == (400, Code.INVALID_VALUE, param, message)


# --- each video probed, planned, keyed --------------------------------------------------------------
def test_video_parts_in_order_in_both_shapes():
    body = body_of("data:video/mp4;base64,AA==")
    body["messages"][0]["content"].append({"type": "video_url", "video_url": "data:video/webm;base64,AA=="})
    body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}})
    parts = video_parts(body)
    assert [(p.url, p.param, p.kind) for p in parts] == [
        ("data:video/mp4;base64,AA==", PARAM, "video_url"),
        ("data:video/webm;base64,AA==", "messages[0].content[2].video_url", "video_url")]
    parts[1].replace_url("data:video/mp4;base64,BB==")
    assert body["messages"][0]["content"][2]["video_url"] == "data:video/mp4;base64,BB=="


def test_a_video_is_probed_planned_and_keyed_under_the_requests_sampling():
    data = make_video(frames=16, width=64, height=48, fps=8)
    body = body_of(data_url(data), mm_processor_kwargs={"fps": 4})
    (video,) = ref_videos(video_parts(body), PUBLISHED, body["mm_processor_kwargs"], FP)
    sampling = dataclasses.replace(SAMPLING, fps=4.0)
    probe = VideoProbe(width=64, height=48, frames=16, fps=8.0, codec=video.probe.codec)
    assert (video.probe, video.sampling, video.param) == (probe, sampling, PARAM)
    assert video.key == video_key(data, sampling.to_json(), FP)
    assert video.num_tokens == plan(probe, sampling).num_tokens and video.weight == video.num_tokens * TOKEN_CHARS
    assert video.ref() == {"type": "video_ref", "video_ref": {"key": video.key, "probe": probe.to_json(),
                                                              "sampling": sampling.to_json()}}
    # other modes: checked and planned the same, no key (no vision fingerprint)
    (unkeyed,) = ref_videos(video_parts(body), PUBLISHED, body["mm_processor_kwargs"], None)
    assert unkeyed.key is None and unkeyed.num_tokens == video.num_tokens
    # the same file under other settings is another key
    (two,) = ref_videos(video_parts(body), PUBLISHED, {"fps": 2}, FP)
    assert two.key != video.key


@pytest.mark.parametrize("url, status, code, message", [
    (data_url(b"not a video at all" * 10), 400, Code.INVALID_VIDEO,
     "The data is not a video in a supported container"),
    (data_url(make_video(frames=1)), 400, Code.INVALID_VIDEO,
     "The video cannot be sampled: the video has 1 frames; 0 would be sampled, fewer than the 2 frames one "
     "temporal patch of this model takes."),
    (data_url(make_video(frames=8, width=64, height=48), mime="text/plain"), 400, Code.INVALID_VIDEO_URL,
     "A video data URL's type must be one of"),
    ("data:video/mp4;base64," + "A" * (2 << 20), 413, Code.VIDEO_TOO_LARGE,
     f"this router accepts at most {1 << 20} bytes per video (--max-video-mb)."),
])
def test_a_bad_video_is_refused_naming_its_part(url, status, code, message):
    body = body_of(data_url(make_video()), url)
    error = refused(lambda: ref_videos(video_parts(body), PUBLISHED, None, FP))
    assert (error.status, error.code, error.param) == (status, code, "messages[0].content[1].video_url")
    assert message in error.message


def test_a_video_over_the_published_pixels_is_too_large():
    small = dataclasses.replace(PUBLISHED, max_pixels=32 * 32)
    error = refused(lambda: ref_videos(video_parts(body_of(data_url(make_video()))), small, None, FP))
    assert (error.status, error.code, error.param, error.message) == (
        413, Code.VIDEO_TOO_LARGE, PARAM, "The video is 64x48 = 3072 pixels a frame; this router accepts at most "
                                          "1024 pixels per frame (--max-video-pixels).")


# --- references: the prefill's and decode's body, the encoder's ------------------------------------
def test_with_refs_puts_video_refs_in_place_and_drops_mm_processor_kwargs():
    data = make_video()
    body = body_of(data_url(data), mm_processor_kwargs={"fps": 4}, max_tokens=3)
    videos = ref_videos(video_parts(body), PUBLISHED, body["mm_processor_kwargs"], FP)
    sent = with_refs(body, (), videos)
    assert sent == {"model": "m", "max_tokens": 3, "messages": [
        {"role": "user", "content": [videos[0].ref(), {"type": "text", "text": "hi"}]}]}
    assert "mm_processor_kwargs" in body and body["messages"][0]["content"][0]["type"] == "video_url"
    assert with_refs(body, (), ()) is body  # no reference: the body as it is, mm_processor_kwargs kept
    encoded = msgspec.json.decode(encode_body(7, [*videos, *videos]))
    assert encoded == {"room": 7, "images": [{"key": videos[0].key, "url": data_url(data),
                                              "video": dataclasses.replace(SAMPLING, fps=4.0).to_json()}]}


def test_prefix_routing_weighs_a_video_by_its_tokens():
    data = make_video()
    body = body_of(data_url(data))
    (video,) = ref_videos(video_parts(body), PUBLISHED, None, FP)
    units = chat_units(with_refs(body, (), (video,)), {video.key: video.weight})
    assert units[1] == ("\x1d" + video.key, video.weight)  # after the role's unit
    assert chat_units(with_refs(body, (), (video,)))[1][1] == IMAGE_CHARS  # unplanned: an image's weight
    # a Call weighs its videos by their reference (epd) or their URL (other modes)
    epd = Call(with_refs(body, (), (video,)), False, "m", 0.0, videos=(video,))
    (unkeyed,) = ref_videos(video_parts(body), PUBLISHED, None, None)
    other = Call(body, False, "m", 0.0, videos=(unkeyed,))
    assert epd.prefix.total == other.prefix.total == units[0][1] + video.weight + len("hi")
