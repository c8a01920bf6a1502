"""Video through 1E1P1D behind a real router: an encoder decodes only the sampled frames and writes one
cache entry per video (key: bytes, sampling, fingerprint), the prefill reads it by reference and the decode
never sees a pixel; the answer equals Hugging Face generate() on the same frames for the three Qwen
families (Mooncake; Qwen3-VL over NIXL too), with a video alone, a video and an image, and two videos, whole
and streamed. The same video again is a cache hit sent to no encoder; a bad one is refused by the router
before any fan-out; KV blocks are back to zero after each test."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.support.epd_helpers import start_epd
from tests.support.redis_fixtures import flush, redis_server  # noqa: F401
from tests.support.video_reference import KWARGS, chat, reference
from tests.support.videos import data_url, make_video

pytestmark = pytest.mark.timeout(300)
STEPS = 8
STACKS = [("qwen2_vl", "mooncake"), ("qwen2_5_vl", "mooncake"), ("qwen3_vl", "mooncake"), ("qwen3_vl", "nixl")]
KINDS = [("video",), ("video", "image"), ("video", "video2")]
TOKEN = "admin-token-for-video-tests-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module", params=STACKS, ids=[f"{v}-{t}" for v, t in STACKS])
def stack(request, redis_server, start_server, tmp_path_factory):  # noqa: F811
    variant, transfer = request.param
    flush(redis_server.url)
    epd = start_epd(variant, transfer, redis_server.url, tmp_path_factory.mktemp(f"video-{variant}-{transfer}"))
    try:
        router = start_server("router", "--encoder", epd.encoders[0].url, "--prefill", epd.prefill.url,
                              "--decode", epd.decode.url, "--redis-url", redis_server.url, "--admin-token", TOKEN)
        yield variant, epd, router
    finally:
        epd.stop()


@pytest.fixture(autouse=True)
def blocks_back_to_zero(stack):
    yield
    deadline = time.monotonic() + 10
    while (used := stack[1].blocks_used()) != (0, 0):
        assert time.monotonic() < deadline, f"KV blocks still in use on (P, D): {used}"
        time.sleep(0.1)


def videos_encoded(epd) -> float:
    text = httpx.get(f"{epd.encoders[0].url}/metrics", timeout=10).text
    return float(re.search(r"^epd_encoder_videos_encoded_total (\S+)$", text, re.M).group(1))


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("kinds", KINDS, ids=["+".join(k) for k in KINDS])
def test_answers_equal_generate_whole_and_streamed(stack, kinds):
    variant, epd, router = stack
    tokens, text = reference(variant, kinds, STEPS)
    openai_client = client(router)
    model = openai_client.models.list().data[0].id
    whole = openai_client.chat.completions.with_raw_response.create(
        model=model, messages=chat(kinds), max_tokens=STEPS, temperature=0, extra_body={"mm_processor_kwargs": KWARGS})
    answer = whole.parse()
    assert answer.choices[0].message.content == text
    assert answer.usage.completion_tokens == len(tokens)
    stream = openai_client.chat.completions.create(model=model, messages=chat(kinds), max_tokens=STEPS, temperature=0,
                                                   stream=True, extra_body={"mm_processor_kwargs": KWARGS})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text
    assert epd.info(epd.decode)["images"] == "refs"  # the decode takes references only: no pixel reached it


def test_the_same_video_again_is_a_cache_hit_sent_to_no_encoder(stack):
    variant, epd, router = stack
    clip = make_video(frames=20, width=64, height=48, fps=8, container="mp4", seed=77)
    body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(clip)}},
                                                      {"type": "text", "text": "again?"}]}],
            "max_tokens": 4, "temperature": 0}
    before = videos_encoded(epd)
    first = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert first.status_code == 200, first.text
    assert videos_encoded(epd) == before + 1
    second = httpx.post(f"{router.url}/v1/chat/completions", json={**body, "messages": [
        {**body["messages"][0], "content": [*body["messages"][0]["content"][:1], {"type": "text", "text": "and?"}]}]},
        timeout=60)
    assert second.status_code == 200, second.text
    assert videos_encoded(epd) == before + 1  # read from the cache: no encoder was sent it


def test_a_bad_video_is_refused_before_any_fan_out(stack):
    _, epd, router = stack
    before = videos_encoded(epd)
    clip = make_video(frames=20, width=64, height=48, fps=8, container="mp4", seed=78)
    body = {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": data_url(clip[: len(clip) // 4])}}]}], "max_tokens": 2}
    answer = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_video"
    assert answer.json()["error"]["param"] == "messages[0].content[0].video_url"
    assert videos_encoded(epd) == before
    ok = httpx.post(f"{router.url}/v1/chat/completions", timeout=60,
                    json={"messages": chat(("video",)), "max_tokens": 2, "mm_processor_kwargs": KWARGS})
    assert ok.status_code == 200, ok.text


def test_the_room_timeline_shows_the_video_decoded_and_encoded_and_the_ratio_counts_its_frames(stack):
    _, epd, router = stack
    started = time.time()
    clip = make_video(frames=32, width=64, height=48, fps=8, container="mp4", seed=79)
    body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(clip)}},
                                                      {"type": "text", "text": "timeline?"}]}],
            "max_tokens": 3, "mm_processor_kwargs": {"num_frames": 12}}
    assert httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    rooms = [r for r in httpx.get(f"{router.url}/admin/rooms?slowest=100", headers=AUTH, timeout=30).json()["rooms"]
             if r["events"][0]["t"] >= started]
    assert len(rooms) == 1
    view = httpx.get(f"{router.url}/admin/rooms/{rooms[0]['room']}", headers=AUTH, timeout=30).json()
    events = {e["event"]: e for e in view["stages"]["encoder"]["events"]}
    assert events["video_decoded"]["frames"] == 12 and events["video_decoded"]["seconds"] >= 0
    assert events["encoded"]["frames"] == 12 and events["encoded"]["num_tokens"] > 0
    assert events["video_decoded"]["t"] <= events["encoded"]["t"]
    report = httpx.get(f"{router.url}/admin/ratio", headers=AUTH, timeout=30).json()
    assert report["roles"]["encoder"]["units"] >= 12  # the frames count as the encoder's work
