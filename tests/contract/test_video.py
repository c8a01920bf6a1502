"""contract.video, the one sampling rule the router and every stage compute: transformers' Qwen video
processors' frame choice, resize and timing, worked by hand here; the settings a request may change and
the bounds it may not pass; a resolved sampling held to a server's. Pure."""

from __future__ import annotations

import dataclasses

import pytest

from contract.video import (VideoPlanError, VideoProbe, VideoSampling, VideoSettingError, check_resolved, plan,
                            within)

pytestmark = pytest.mark.unit
QWEN2 = VideoSampling.from_processor_config("qwen2_vl", {"min_pixels": 3136, "max_pixels": 12845056, "fps": 2.0})
QWEN3 = VideoSampling.from_processor_config("qwen3_vl", {})
CLIP = VideoProbe(640, 360, 300, 30.0, "h264")  # 10 s


def test_qwen2_samples_fps_frames_a_whole_temporal_patch_each_and_resizes_each_frame():
    p = plan(CLIP, QWEN2)
    assert p.indices == tuple(range(0, 300, 15))  # 10 s x 2 fps = 20 frames, floor(i * 300 / 20)
    assert (p.height, p.width) == (364, 644)  # round(360 / 28) * 28, round(640 / 28) * 28: within the per-frame bound
    assert p.grid == (10, 26, 46) and p.num_tokens == 10 * 26 * 46 // 4 and p.frame_tokens == 26 * 46 // 4
    assert p.seconds_per_grid == 1.0  # 2 frames a patch at 2 sampled frames a second
    assert p.timestamps[:2] == (0.25, 1.25)  # each patch's mean time: (0 + 0.5) / 2, (1 + 1.5) / 2


def test_qwen3_spreads_frames_by_linspace_and_bounds_pixels_over_all_frames():
    p = plan(CLIP, QWEN3)
    assert p.indices[:5] == (0, 16, 31, 47, 63) and p.indices[-1] == 299  # linspace(0, 299, 20).round()
    # 20 x 352 x 640 is over 768 x 32 x 32 pixels for the whole video: scaled by sqrt(20 x 360 x 640 / 786432)
    assert (p.height, p.width) == (128, 256) and p.grid == (10, 8, 16) and p.num_tokens == 320
    assert p.timestamps[0] == pytest.approx((0 + 16 / 30) / 2)


def test_an_odd_frame_count_pads_the_last_patch_with_the_last_frame():
    p = plan(VideoProbe(64, 64, 10, 10.0, "vp9"), QWEN3.with_overrides({"num_frames": 5}))
    assert p.indices == (0, 2, 4, 7, 9)  # linspace(0, 9, 5) = 0, 2.25, 4.5, 6.75, 9, rounded half to even
    assert p.grid[0] == 3
    assert p.timestamps == pytest.approx(((0 + 0.2) / 2, (0.4 + 0.7) / 2, 0.9))


def test_videos_that_cannot_be_sampled_say_why():
    assert plan(VideoProbe(64, 48, 3, 10.0, "h264"), QWEN2).indices == (0, 1)  # clamped to the frames, even
    with pytest.raises(VideoPlanError, match="fewer than the 2 frames one temporal patch"):
        plan(VideoProbe(64, 48, 1, 10.0, "h264"), QWEN2)
    with pytest.raises(VideoPlanError, match="aspect ratio"):
        plan(VideoProbe(4000, 10, 100, 10.0, "h264"), QWEN2)
    with pytest.raises(VideoPlanError, match="asked for; the video has 10"):
        plan(VideoProbe(64, 48, 10, 10.0, "h264"), QWEN3.with_overrides({"num_frames": 12}))


def test_a_request_changes_only_its_settings_and_never_past_the_servers_bounds():
    assert within(QWEN2, {"num_frames": 8}).fps is None and within(QWEN2, {"fps": 1}).num_frames is None
    for overrides, key in (({"colour": 1}, "colour"), ({"fps": "fast"}, "fps"), ({"max_frames": 10**6}, "max_frames"),
                           ({"max_pixels": QWEN2.max_pixels + 1}, "max_pixels"), ({"fps": 61}, "fps"),
                           ({"num_frames": True}, "num_frames")):
        with pytest.raises(VideoSettingError) as refused:
            within(QWEN2, overrides)
        assert refused.value.key == key
    with pytest.raises(VideoSettingError) as together:
        within(QWEN2, {"min_frames": 100, "max_frames": 10})
    assert together.value.key is None  # the two together, not one of them


def test_a_resolved_sampling_is_held_to_the_servers():
    check_resolved(QWEN2, within(QWEN2, {"num_frames": 8, "max_pixels": 50176}))
    with pytest.raises(VideoSettingError, match="this encoder's model has 14") as fixed:
        check_resolved(QWEN2, dataclasses.replace(QWEN2, patch_size=16), "encoder")
    assert fixed.value.key == "patch_size"
    with pytest.raises(VideoSettingError) as bound:
        check_resolved(dataclasses.replace(QWEN2, max_frames=64), QWEN2)  # 768 frames where 64 are the most
    assert bound.value.key == "max_frames"


def test_config_and_wire_forms():
    hub = VideoSampling.from_processor_config("qwen2_vl", {"size": {"shortest_edge": 100, "longest_edge": 200}})
    assert (hub.min_pixels, hub.max_pixels, hub.fps) == (100, 200, 2.0)  # no fps in the config: 2 a second
    assert VideoSampling.from_json(QWEN3.to_json()) == QWEN3
    assert VideoProbe.from_json(CLIP.to_json()) == CLIP
    for bad in ({**CLIP.to_json(), "frames": 0}, {**CLIP.to_json(), "extra": 1}):
        with pytest.raises(ValueError):
            VideoProbe.from_json(bad)
