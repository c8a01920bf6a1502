"""Video through real servers: a colocated server (the official openai client, whole and streamed) and a
1P1D pair (every family, both transfer backends) answer a chat with a video alone, a video and an image,
and two videos exactly as Hugging Face generate() does on the same frames; bad videos are 400s naming the part, and the server
keeps serving. EPD through the router: tests/e2e/test_video_epd.py."""

from __future__ import annotations

import asyncio
import base64
import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from process.ports import free_port
from tests.conftest import launch
from tests.support.generated_models import model_dir
from tests.support.stage_api import data_url as png_data_url
from tests.support.stage_api import png
from tests.support.video_reference import CLIPS, KWARGS, chat, reference
from tests.support.videos import data_url, make_video

pytestmark = pytest.mark.timeout(300)
STEPS = 8
CLIP = CLIPS["video"][0]


def messages(with_image: bool) -> list[dict]:
    return chat(("video", "image") if with_image else ("video",))


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_colocated_answers_as_generate_whole_and_streamed(start_server, variant):
    server = start_server("colocated", "--model", str(model_dir(variant)), "--kv-cache-mib", "32")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    for kinds in (("video",), ("video", "image"), ("video", "video2")):
        tokens, text = reference(variant, kinds, STEPS)
        whole = client.chat.completions.create(model=client.models.list().data[0].id, messages=chat(kinds),
                                               max_tokens=STEPS, temperature=0, extra_body={"mm_processor_kwargs": KWARGS})
        assert whole.choices[0].message.content == text
        assert whole.usage.completion_tokens == len(tokens)
        stream = client.chat.completions.create(model=client.models.list().data[0].id, messages=chat(kinds),
                                                max_tokens=STEPS, temperature=0, stream=True,
                                                extra_body={"mm_processor_kwargs": KWARGS})
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    # 3 chats x 2 requests, each video's 8 planned frames (KWARGS) decoded here and nothing else
    assert "epd_video_frames_decoded_total 64.0" in metrics, [l for l in metrics.splitlines() if "video" in l]


def test_bad_videos_are_400s_and_the_server_keeps_serving(start_server):
    server = start_server("colocated", "--model", str(model_dir("qwen2_vl")), "--kv-cache-mib", "16",
                          "--max-videos-per-request", "1", "--max-model-len", "64")
    good = messages(False)
    url = good[0]["content"][0]["video_url"]["url"]
    header = url.split(",", 1)[0]
    cases = {
        "truncated": (f"{header},{base64.b64encode(CLIP[: len(CLIP) // 3]).decode()}", 400, "invalid_video"),
        "not a video": (f"{header},{base64.b64encode(png(8, 8)).decode()}", 400, "invalid_video"),
        "bad base64": (f"{header},@@@", 400, "invalid_base64"),
        "image mime": (png_data_url(png(8, 8)), 400, "invalid_video_url"),
        "remote url": ("https://example.com/a.mp4", 400, "remote_image_url"),
    }
    for name, (bad, status, code) in cases.items():
        body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": bad}}]}],
                "max_tokens": 2}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), (name, answer.text)
        assert answer.json()["error"]["param"] == "messages[0].content[0].video_url", name
    two = {"messages": [{"role": "user", "content": good[0]["content"][:1] * 2}], "max_tokens": 2}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=two, timeout=60)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "too_many_videos")
    for key, value in (("max_frames", 10**6), ("colour", 1), ("fps", "fast")):
        body = {"messages": good, "max_tokens": 2, "mm_processor_kwargs": {key: value}}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, f"mm_processor_kwargs.{key}"), answer.text
    assert httpx.post(f"{server.url}/v1/chat/completions", json={"messages": good, "max_tokens": 2},
                      timeout=60).status_code == 200
    # videos whose placeholders alone fill the context are refused before a frame is decoded
    decoded = httpx.get(f"{server.url}/metrics", timeout=10).text.count("epd_video_frames_decoded_total 8.0")
    long = {"messages": good, "max_tokens": 2, "mm_processor_kwargs": {"num_frames": 24}}  # 72 tokens of 64
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=long, timeout=60)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "context_length_exceeded"), answer.text
    assert "videos alone fill" in answer.json()["error"]["message"]
    assert httpx.get(f"{server.url}/metrics", timeout=10).text.count("epd_video_frames_decoded_total 8.0") == decoded


def test_llava_refuses_video_naming_the_model(start_server):
    server = start_server("colocated", "--model", str(model_dir("llava")), "--kv-cache-mib", "16")
    answer = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages(False), "max_tokens": 2},
                        timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "video_not_supported"
    assert "llava" in answer.json()["error"]["message"]


# every family once and both backends: the backend moves KV bytes the same way whatever the model
PD_PAIRS = [("qwen2_vl", "mooncake"), ("qwen2_5_vl", "nixl"), ("qwen3_vl", "mooncake"), ("qwen3_vl", "nixl")]


@pytest.mark.parametrize(("variant", "transfer"), PD_PAIRS, ids=[f"{v}-{t}" for v, t in PD_PAIRS])
async def test_pd_answers_as_generate(tmp_path, variant, transfer):
    path = str(model_dir(variant))
    bootstrap = free_port()
    common = ["--model", path, "--transfer", transfer, "--kv-cache-mib", "16"]
    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(lambda job: launch(*job), [
            ("prefill", [*common, "--bootstrap-port", str(bootstrap)], tmp_path / "prefill.log", 180.0, None),
            ("decode", common, tmp_path / "decode.log", 180.0, None)])
    try:
        for kinds in (("video",), ("video", "image"), ("video", "video2")):
            tokens, text = reference(variant, kinds, STEPS)
            for stream in (False, True):
                body = {"messages": chat(kinds), "max_tokens": STEPS, "temperature": 0, "stream": stream,
                        "mm_processor_kwargs": KWARGS, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
                        "bootstrap_room": random.getrandbits(63)}
                async with httpx.AsyncClient(timeout=60) as client:
                    p, d = await asyncio.gather(client.post(f"{prefill.url}/v1/chat/completions", json=body),
                                                client.post(f"{decode.url}/v1/chat/completions", json=body))
                assert p.status_code == d.status_code == 200, (p.text, d.text)
                if stream:
                    chunks = [json.loads(line[6:]) for line in d.text.splitlines()
                              if line.startswith("data: {")]
                    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
                else:
                    assert d.json()["choices"][0]["message"]["content"] == text
    finally:
        prefill.stop()
        decode.stop()


def test_a_second_turn_about_one_video_hits_the_prefix_cache(start_server):
    """The video's key is in the prefix cache's block hashes: a follow-up question reuses its blocks; the same
    frames sampled otherwise (another num_frames) is another key and reuses only the text before it."""
    server = start_server("colocated", "--model", str(model_dir("qwen2_vl")), "--kv-cache-mib", "16")
    first = {"messages": messages(False), "max_tokens": 4, "temperature": 0, "mm_processor_kwargs": KWARGS}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=first, timeout=60).json()
    turn = messages(False) + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                              {"role": "user", "content": "and then?"}]
    second = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                        json={**first, "messages": turn}).json()["usage"]
    assert second["prompt_tokens_details"]["cached_tokens"] >= answer["usage"]["prompt_tokens"] // 16 * 16 - 16
    other = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={**first, "messages": turn, "mm_processor_kwargs": {"num_frames": 4}}).json()["usage"]
    assert other["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens_details"]["cached_tokens"]


def test_fuzzed_videos_are_answered_or_refused_and_the_server_stays_healthy(start_server):
    """Truncations and bit flips of a real mp4 and webm (bounded: 24 files): each a 200 or a 400/413 naming
    the part, never a 5xx, and a good request still gets its answer afterwards."""
    server = start_server("colocated", "--model", str(model_dir("qwen2_vl")), "--kv-cache-mib", "16")
    rng = random.Random(33)
    seen = set()
    with httpx.Client(timeout=60) as client:
        for container in ("mp4", "webm"):
            clip = make_video(frames=16, width=64, height=48, fps=8, container=container, seed=5)
            for i in range(12):
                data = bytearray(clip[: rng.randrange(16, len(clip))] if i % 2 else clip)
                for _ in range(0 if i % 2 else rng.randrange(1, 32)):
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                body = {"messages": [{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": data_url(bytes(data), f"video/{container}")}}]}],
                    "max_tokens": 2}
                answer = client.post(f"{server.url}/v1/chat/completions", json=body)
                assert answer.status_code in (200, 400, 413), answer.text
                if answer.status_code != 200:
                    assert answer.json()["error"]["param"] == "messages[0].content[0].video_url", answer.text
                seen.add(answer.status_code)
        assert client.get(f"{server.url}/health").status_code == 200
        good = client.post(f"{server.url}/v1/chat/completions", json={"messages": messages(False), "max_tokens": 2})
        assert good.status_code == 200
    assert 400 in seen
