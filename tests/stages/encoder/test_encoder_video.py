"""Videos through ``stage serve encoder`` (real server processes, a real Redis): a video part (``video``: its
resolved sampling) is encoded under ``cache.keys.video_key`` into one entry whose rows are its plan's
tokens, then cached; one 64-frame video sent to two encoders at once is encoded once in all; bad video
input is refused before anything is claimed and the server keeps serving; a model without video says so.
Plus the worker's chunked encode: chunks of temporal patches concatenated are the whole encode, bit for
bit, for the three Qwen families (in process, CPU float32)."""

from __future__ import annotations

import asyncio
import base64
import re
from dataclasses import replace

import httpx
import pytest
import redis
import torch

from cache import scripts, video_bytes
from cache.keys import video_key
from cache.store import EmbeddingCache
from cache.video_bytes import VideoBounds
from contract.video import VideoSampling, plan, within
from stages.api.videos import server_sampling
from stages.config import VideoLimits
from stages.encoder.worker import encode_chunked
from stages.engine.models import load_adapter
from stages.resources import video_info
from stages.video_preprocess import VideoConfig, preprocess_video
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir
from tests.support.redis_fixtures import cache, make_config, redis_server, redis_url  # noqa: F401
from tests.support.videos import data_url, make_video

pytestmark = pytest.mark.timeout(180)
BOUNDS = VideoBounds(64 << 20, 3840 * 2160, 600.0, 30.0)
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


# --- the chunked encode (in process) ---------------------------------------------------------------
# A Qwen vision tower attends within a temporal patch only, so a video's chunks of temporal patches give
# exactly the whole encode's numbers: in float64 bit for bit. In float32 a chunk's matrix products run
# in other shapes than the whole's, and the CPU's kernels round some shapes differently (measured: a
# chunk of one temporal patch, ~3e-7 here; chunks of 2 or more: the same bits): the encoder's guarantee
# across batch shapes (test_encoder_server.ACROSS_SHAPES) holds, far tighter.
FLOAT32_ACROSS_CHUNKS = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("variant", QWEN)
def test_a_video_encoded_in_chunks_is_the_whole_encode(variant, dtype):
    path = model_dir(variant)
    adapter = load_adapter(path, dtype, "sdpa", parts=("vision",))
    config = VideoConfig.load(path, adapter.video_rule)
    sampling = replace(config.sampling, fps=None, num_frames=16)
    data = make_video(frames=16, width=64, height=48, fps=8)
    video_plan = plan(video_bytes.probe(data, BOUNDS), sampling)
    video = preprocess_video(video_bytes.decode_frames(data, video_plan.indices, BOUNDS), video_plan, config)
    assert video.grid_thw is not None and video.grid_thw[0] == 8
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels for both (the encoder's bits are per thread count, as for images)
    try:
        whole = adapter.encode([video])[0]
        for chunk in (1, 2, 3, 7, 8):  # 8 x 1, 4 x 2, 3 + 3 + 2, 7 + 1, and one chunk of everything
            chunked = encode_chunked(adapter, video, chunk)
            assert chunked.grid_thw == whole.grid_thw and chunked.num_tokens == video_plan.num_tokens
            pairs = [("embeds", chunked.embeds, whole.embeds)]
            if variant == "qwen3_vl":
                assert chunked.deepstack is not None and whole.deepstack is not None
                pairs.append(("deepstack", chunked.deepstack, whole.deepstack))
            else:
                assert chunked.deepstack is None
            for name, got, want in pairs:
                assert got.shape == want.shape and got.dtype == want.dtype
                if dtype == torch.float64 or chunk == 8:
                    assert torch.equal(got, want), (name, chunk, (got - want).abs().max())
                else:
                    torch.testing.assert_close(got, want, **FLOAT32_ACROSS_CHUNKS)
    finally:
        torch.set_num_threads(threads)


def test_chunks_of_a_wrong_layout_would_not_pass():
    """Negative control: the chunks must be in temporal-patch order; swapping two halves is caught."""
    path = model_dir("qwen2_vl")
    adapter = load_adapter(path, torch.float64, "sdpa", parts=("vision",))
    config = VideoConfig.load(path, adapter.video_rule)
    data = make_video(frames=16, width=64, height=48, fps=8)
    video_plan = plan(video_bytes.probe(data, BOUNDS), replace(config.sampling, fps=None, num_frames=16))
    video = preprocess_video(video_bytes.decode_frames(data, video_plan.indices, BOUNDS), video_plan, config)
    whole = adapter.encode([video])[0].embeds
    half = whole.shape[0] // 2
    assert not torch.allclose(torch.cat([whole[half:], whole[:half]]), whole, **FLOAT32_ACROSS_CHUNKS)


# --- servers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def encoders(start_server, redis_server):
    """Two encoders of one qwen2_vl checkpoint on one Redis; a video is encoded 4 frames (2 temporal
    patches) per vision-tower call."""
    path = str(model_dir("qwen2_vl"))
    return [start_server("encoder", "--model", path, "--redis-url", redis_server.url, "--threads", "1",
                         "--video-encode-frames", "4", "--claim-lease-s", "3") for _ in range(2)]


@pytest.fixture(scope="module")
def llava_encoder(start_server, redis_server):
    return start_server("encoder", "--model", str(model_dir("llava")), "--redis-url", redis_server.url)


def colocated_encode(data: bytes, sampling: VideoSampling, chunk: int):
    """The colocated model's own encode of a video (in process, on one CPU thread as the servers run)."""
    path = model_dir("qwen2_vl")
    adapter = load_adapter(path, torch.float32, "sdpa", parts=("vision",), device=DEVICE)
    config = VideoConfig.load(path, "qwen2_vl")
    video_plan = plan(video_bytes.probe(data, BOUNDS), sampling)
    video = preprocess_video(video_bytes.decode_frames(data, video_plan.indices, BOUNDS), video_plan, config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return encode_chunked(adapter, video, chunk)
    finally:
        torch.set_num_threads(threads)


def info(server) -> dict:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def claims(url: str) -> list[bytes]:
    with redis.Redis.from_url(url, socket_timeout=2) as r:
        return list(r.scan_iter(scripts.CLAIM_PREFIX + "*"))


def sampling_of(server, **overrides) -> dict:
    """The sampling a router resolves for a request with ``mm_processor_kwargs`` ``overrides``."""
    return within(VideoSampling.from_json(info(server)["video"]["sampling"]), overrides).to_json()


async def post(client: httpx.AsyncClient, server, body) -> httpx.Response:
    return await client.post(f"{server.url}/v1/encode", json=body, timeout=60)


def assert_error(response: httpx.Response, status: int, code: str, param: str | None, message: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert message in error["message"], error["message"]


def test_the_encoder_publishes_its_video_sampling_and_limits(encoders, llava_encoder):
    path = model_dir("qwen2_vl")
    adapter_rule = "qwen2_vl"
    want = video_info(server_sampling(VideoConfig.load(path, adapter_rule).sampling, VideoLimits()), VideoLimits())
    assert info(encoders[0])["video"] == want
    assert info(encoders[0])["video_encode_frames"] == 4
    assert info(llava_encoder)["video"] is None


@pytest.mark.parametrize("container, mime, part", [("mp4", "video/mp4", "url"), ("webm", "video/webm", "data")])
async def test_a_video_is_encoded_into_one_entry_then_cached(container, mime, part, encoders, redis_url):
    server = encoders[0]
    data = make_video(frames=24, width=64, height=48, fps=8, container=container, seed=3)
    sampling = sampling_of(server, num_frames=12)
    video_plan = plan(video_bytes.probe(data, BOUNDS), VideoSampling.from_json(sampling))
    key = video_key(data, sampling, info(server)["vision_fingerprint"])
    item = {"url": data_url(data, mime)} if part == "url" else {"data": base64.b64encode(data).decode()}
    names = ("epd_encoder_video_frames_decoded_total", "epd_encoder_video_frames_encoded_total",
             "epd_encoder_video_bytes_total", "epd_encoder_videos_encoded_total", "epd_encoder_images_encoded_total")
    before = {name: metric(server, name) for name in names}
    room = 40 if container == "mp4" else 41
    async with httpx.AsyncClient() as client:
        first = await post(client, server, {"room": room, "images": [{**item, "key": key, "video": sampling}]})
        assert first.status_code == 200, first.text
        assert [(im["key"], im["status"], im["num_tokens"]) for im in first.json()["images"]] == [
            (key, "encoded", video_plan.num_tokens)]
        again = await post(client, encoders[1], {"room": room + 10, "images": [{**item, "video": sampling}]})
        assert [(im["key"], im["status"]) for im in again.json()["images"]] == [(key, "cached")]
        events = (await client.get(f"{server.url}/rooms/{room}", timeout=10)).json()["events"]
    async with EmbeddingCache(make_config(redis_url)) as store:
        hit = await store.get(key)
    assert hit is not None
    assert hit.entry.num_tokens == video_plan.num_tokens and hit.entry.image_grid == list(video_plan.grid)
    assert list(hit.tensors) == ["embeds"] and hit.tensors["embeds"].shape[0] == video_plan.num_tokens
    want = colocated_encode(data, VideoSampling.from_json(sampling), chunk=2)  # --video-encode-frames 4
    assert torch.equal(hit.tensors["embeds"], want.embeds.cpu()), (hit.tensors["embeds"] - want.embeds).abs().max()
    frames = len(video_plan.indices)
    assert {name: metric(server, name) - before[name] for name in names} == {
        names[0]: frames, names[1]: frames, names[2]: len(data), names[3]: 1, names[4]: 0}
    decoded = [e for e in events if e["event"] == "video_decoded"]
    encoded = [e for e in events if e["event"] == "encoded"]
    assert [(e["key"], e["frames"]) for e in decoded] == [(key, frames)] and decoded[0]["seconds"] > 0
    assert [(e["key"], e["num_tokens"], e["frames"]) for e in encoded] == [(key, video_plan.num_tokens, frames)]
    assert [e["event"] for e in events] == ["queued", "video_decoded", "batch", "encoded"]  # batch: its vision-tower call
    assert claims(redis_url) == []


async def test_a_64_frame_video_sent_to_two_encoders_at_once_is_encoded_once(encoders, redis_url):
    data = make_video(frames=64, width=64, height=48, fps=8, seed=7)
    sampling = sampling_of(encoders[0], num_frames=64)
    video_plan = plan(video_bytes.probe(data, BOUNDS), VideoSampling.from_json(sampling))
    assert len(video_plan.indices) == 64 and video_plan.grid[0] == 32
    key = video_key(data, sampling, info(encoders[0])["vision_fingerprint"])
    count = lambda name: sum(metric(s, name) for s in encoders)  # noqa: E731
    before = (count("epd_encoder_videos_encoded_total"), count("epd_encoder_video_frames_encoded_total"),
              count("epd_encoder_seconds_count"))
    item = {"url": data_url(data), "video": sampling}
    async with httpx.AsyncClient() as client:
        responses = await asyncio.gather(*[post(client, encoders[i % 2], {"room": 200 + i, "images": [item]})
                                           for i in range(8)])
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
    statuses = [r.json()["images"][0]["status"] for r in responses]
    assert set(statuses) <= {"encoded", "cached", "pending_elsewhere"} and "encoded" in statuses
    encoded_by = {i % 2 for i, status in enumerate(statuses) if status == "encoded"}
    assert len(encoded_by) == 1  # the requests that saw "encoded" joined one flight, on one encoder
    after = (count("epd_encoder_videos_encoded_total"), count("epd_encoder_video_frames_encoded_total"),
             count("epd_encoder_seconds_count"))
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (1, 64, 1)
    async with EmbeddingCache(make_config(redis_url)) as store:
        hit = await store.wait_ready(key, 30.0)
    assert hit.entry.num_tokens == video_plan.num_tokens == 32 * video_plan.frame_tokens
    assert claims(redis_url) == []


async def test_bad_video_input_is_refused_before_any_claim_and_the_encoder_keeps_serving(encoders, redis_url):
    server = encoders[1]
    good = make_video(frames=16, width=64, height=48, fps=8, seed=11)
    sampling = sampling_of(server)
    fingerprint = info(server)["vision_fingerprint"]
    before = metric(server, "epd_encoder_videos_encoded_total")
    corrupt = good[:200] + bytes(len(good) - 400) + good[-200:]
    base = VideoSampling.from_json(sampling)
    async with httpx.AsyncClient() as client:
        cases = [
            ({"url": data_url(corrupt), "video": sampling}, 400, "invalid_video", "images[0]", "not a video"),
            ({"data": base64.b64encode(b"just text").decode(), "video": sampling}, 400, "invalid_video",
             "images[0]", "not a video"),
            ({"url": data_url(good), "video": {**sampling, "fps": "fast"}}, 400, "invalid_value", "images[0].video",
             "Invalid video sampling"),
            ({"url": data_url(good), "video": {"rule": "qwen2_vl"}}, 400, "invalid_value", "images[0].video",
             "Invalid video sampling"),
            ({"url": data_url(good), "video": {**sampling, "fps": None, "num_frames": base.max_frames + 2}}, 400,
             "invalid_value", "images[0].video.num_frames", f"samples at most {base.max_frames}"),
            ({"url": data_url(good), "video": {**sampling, "max_pixels": base.max_pixels * 2}}, 400,
             "invalid_value", "images[0].video.max_pixels", "samples at most"),
            ({"url": data_url(good), "video": {**sampling, "patch_size": base.patch_size * 2}}, 400,
             "invalid_value", "images[0].video.patch_size", "this encoder's model has"),
            ({"url": data_url(good), "video": {**sampling, "fps": None, "num_frames": 32}}, 400, "invalid_video",
             "images[0]", "cannot be sampled"),
            ({"url": data_url(good), "video": sampling, "key": video_key(good, {**sampling, "fps": 1.0}, fingerprint)},
             400, "key_mismatch", "images[0].key", "video bytes and sampling"),
            ({"url": "data:image/png;base64,AAAA", "video": sampling}, 400, "invalid_video_url", "images[0]",
             "type must be one of"),
        ]
        for item, status, code, param, message in cases:
            assert_error(await post(client, server, {"room": 5, "images": [item]}), status, code, param, message)
        too_many = {"room": 5, "images": [{"url": data_url(good), "video": sampling}] * 3}
        assert_error(await post(client, server, too_many), 400, "too_many_videos", "images", "at most 2 per request")
        assert claims(redis_url) == [] and metric(server, "epd_encoder_videos_encoded_total") == before
        assert (await client.get(f"{server.url}/health")).json() == {"status": "ok"}
        ok = await post(client, server, {"room": 6, "images": [{"url": data_url(good), "video": sampling}]})
        assert ok.status_code == 200 and ok.json()["images"][0]["status"] == "encoded", ok.text


async def test_a_model_without_video_refuses_a_video_part(llava_encoder, redis_url):
    sampling = VideoSampling.from_processor_config("qwen2_vl", {}).to_json()
    async with httpx.AsyncClient() as client:
        response = await post(client, llava_encoder, {"room": 1, "images": [
            {"url": data_url(make_video()), "video": sampling}]})
    assert_error(response, 400, "video_not_supported", "images[0].video", "takes no video")
    assert claims(redis_url) == []
