"""The HTTP contract of a real `stage serve colocated` subprocess on a tiny generated model: the official
openai client for good requests, raw httpx / sockets for bad input and disconnects."""

from __future__ import annotations

import base64
import io
import json
import random
import socket
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from PIL import Image

from tests.support.prom_samples import metrics

MODEL = "tiny-vl"
MAX_MODEL_LEN = 2048
LIMITS = {"images": 3, "pixels": 200_000, "bytes": 300_000}
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server(
        "colocated", "--model", str(tiny_model("qwen2_vl")), "--served-model-name", MODEL,
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-mib", "32", "--threads", "1",
        "--max-images-per-request", str(LIMITS["images"]), "--max-image-pixels", str(LIMITS["pixels"]),
        "--max-image-bytes", str(LIMITS["bytes"]))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as session:
        yield session


# --- helpers -----------------------------------------------------------------------------------
def png_url(width: int = 64, height: int = 48, color=(200, 30, 30), noise: bool = False) -> str:
    image = (Image.frombytes("RGB", (width, height), random.Random(0).randbytes(width * height * 3)) if noise
             else Image.new("RGB", (width, height), color))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def header_only_png_url(width: int, height: int) -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    data = b"\x89PNG\r\n\x1a\n" + ihdr + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}]


IMAGE_CHAT = user(image(png_url()), "What is in this picture?")


def wait_for(condition, what: str, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def assert_healthy(http) -> None:
    assert http.get("/health").json() == {"status": "ok"}


# --- good requests -------------------------------------------------------------------------------
def test_health_and_models(http, client):
    assert_healthy(http)
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "epd-stage")]


def test_non_stream_with_images_across_messages(client):
    messages = [{"role": "system", "content": "You describe images."},
                *user(image(png_url(color=(255, 0, 0))), "first", image(png_url(32, 32, (0, 0, 255)))),
                {"role": "assistant", "content": "Two squares."},
                *user("and this one?", {"type": "image_url", "image_url": png_url(40, 60, (0, 255, 0))})]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion" and reply.model == MODEL
    assert abs(reply.created - time.time()) < 120
    choice = reply.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 3 * 4 and 1 <= usage.completion_tokens <= 8  # three images' placeholders at least
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_stream_is_well_formed_and_matches_non_stream(client):
    args = dict(model=MODEL, messages=IMAGE_CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in with_choices] == [None] * (len(with_choices) - 1) + ["length"]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (whole.usage.prompt_tokens, 12)
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_framing(http):
    body = {"messages": IMAGE_CHAT, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert "usage" not in json.loads(events[-2][6:])  # not asked for


def test_max_tokens_ends_with_length(client):
    reply = client.chat.completions.create(model=MODEL, messages=IMAGE_CHAT, max_tokens=5,
                                           extra_body={"ignore_eos": True})
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 5)
    reply = client.chat.completions.create(model=MODEL, messages=IMAGE_CHAT, max_tokens=9, max_completion_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3  # max_completion_tokens wins


def test_stop_string_cuts_the_text(client):
    args = dict(model=MODEL, messages=user("Tell me a long story about a cat."), temperature=0,
                extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args, max_tokens=24).choices[0].message.content
    clean = full[: full.find("\ufffd")] if "\ufffd" in full else full
    starts = [k for k in range(2, len(clean) - 3)
              if clean[k:k + 3].strip() == clean[k:k + 3] and clean[k:k + 3].isprintable()]
    assert starts, f"no usable stop string in {full!r}"
    stop = clean[starts[len(starts) // 2]: starts[len(starts) // 2] + 3]
    reply = client.chat.completions.create(**args, max_tokens=24, stop=[stop, "never-appears"])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == full[: full.index(stop)]
    assert stop not in reply.choices[0].message.content


def test_seeded_sampling_is_reproducible(client):
    def sample(seed: int) -> str:
        return client.chat.completions.create(model=MODEL, messages=IMAGE_CHAT, max_tokens=16, temperature=1.0,
                                              seed=seed, extra_body={"ignore_eos": True}).choices[0].message.content
    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_metrics_move_after_a_request(http, client):
    before = metrics(http)
    for name in ("epd_time_to_first_token_seconds_count", "epd_time_per_output_token_seconds_count",
                 "epd_e2e_request_latency_seconds_count", 'epd_requests_total{finish_reason="length"}',
                 "epd_prompt_tokens_total", "epd_generation_tokens_total", "epd_queue_depth", "epd_running_requests",
                 "epd_batch_size_count", "epd_kv_blocks_used", "epd_kv_blocks_total"):
        assert name in before, name
    reply = client.chat.completions.create(model=MODEL, messages=IMAGE_CHAT, max_tokens=4,
                                           extra_body={"ignore_eos": True})
    after = metrics(http)
    moved = {name: after[name] - before[name] for name in before if name in after}
    assert moved['epd_requests_total{finish_reason="length"}'] == 1
    assert moved["epd_prompt_tokens_total"] == reply.usage.prompt_tokens
    assert moved["epd_generation_tokens_total"] == 4
    for name in ("epd_time_to_first_token_seconds_count", "epd_e2e_request_latency_seconds_count",
                 "epd_time_per_output_token_seconds_count"):
        assert moved[name] == 1, name
    assert moved["epd_batch_size_count"] >= 4 and after["epd_kv_blocks_total"] > 0
    assert (after["epd_kv_blocks_used"], after["epd_running_requests"], after["epd_queue_depth"]) == (0, 0, 0)


def test_concurrent_requests_share_batches(http, client):
    before = metrics(http)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: client.chat.completions.create(
            model=MODEL, messages=user(f"request {i}"), max_tokens=32, temperature=0,
            extra_body={"ignore_eos": True}), range(4)))
    assert [r.usage.completion_tokens for r in replies] == [32] * 4
    after = metrics(http)
    steps = after["epd_batch_size_count"] - before["epd_batch_size_count"]
    single = after['epd_batch_size_bucket{le="1.0"}'] - before['epd_batch_size_bucket{le="1.0"}']
    assert steps < 4 * 32 and single < steps  # some steps ran several requests at once


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(server, http, stream):
    aborted = 'epd_requests_total{finish_reason="abort"}'
    before = metrics(http)[aborted]
    body = json.dumps({"messages": user("Count forever."), "max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True,
                       "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: metrics(http)["epd_running_requests"] == 1, "the request to start running")
    # ~2000 tokens would take many seconds; the abort must free everything long before that
    wait_for(lambda: (m := metrics(http))["epd_running_requests"] == 0 and m["epd_kv_blocks_used"] == 0,
             "the engine to drop the request", timeout_s=10)
    assert metrics(http)[aborted] == before + 1
    assert_healthy(http)


# --- bad input: exact status and error body, and the server stays healthy ---------------------------
def text_chat(**extra) -> dict:
    return {"messages": user("hello"), **extra}


def image_chat(*urls: str) -> dict:
    return {"messages": user(*(image(u) for u in urls), "what is this?"), "max_tokens": 2}


BAD_REQUESTS = {
    "malformed_json": (b'{"messages": [', 400, None, "invalid_json", "not valid JSON"),
    "missing_messages": ({"model": MODEL}, 400, "messages", "missing_required_parameter", "messages"),
    "messages_wrong_type": ({"messages": "hello"}, 400, "messages", "invalid_value", "messages"),
    "temperature_wrong_type": (text_chat(temperature="warm"), 400, "temperature", "invalid_value", "temperature"),
    "max_tokens_zero": (text_chat(max_tokens=0), 400, "max_tokens", "invalid_value", "greater than or equal to 1"),
    "n_nine": (text_chat(n=9), 400, "n", "invalid_value", "less than or equal to 8"),
    "five_stop_strings": (text_chat(stop=list("abcde")), 400, "stop", "invalid_value", "at most 4"),
    "bad_role": ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "invalid_value", "role"),
    "bad_base64": (image_chat("data:image/png;base64,%%%not-base64%%%"), 400,
                   "messages[0].content[0].image_url", "invalid_base64", "not valid base64"),
    "not_an_image": (image_chat("data:image/png;base64," + base64.b64encode(b"just some text").decode()), 400,
                     "messages[0].content[0].image_url", "invalid_image", "not an image"),
    "remote_url": (image_chat("https://example.com/cat.png"), 400, "messages[0].content[0].image_url",
                   "remote_image_url", "not fetched by stage servers"),
    "too_many_pixels": (image_chat(png_url(1000, 1000)), 413, "messages[0].content[0].image_url", "image_too_large",
                        "1000x1000"),
    "decompression_bomb": (image_chat(header_only_png_url(100_000, 100_000)), 413,
                           "messages[0].content[0].image_url", "image_too_large", "too large"),
    "too_many_bytes": (image_chat(png_url(440, 440, noise=True)), 413, "messages[0].content[0].image_url",
                       "image_too_large", f"at most {LIMITS['bytes']} bytes"),
    "too_many_images": (image_chat(*[png_url()] * 4), 400, "messages", "too_many_images", "at most 3"),
    "prompt_too_long": (text_chat(messages=user("word " * (MAX_MODEL_LEN + 100))), 400, "messages",
                        "context_length_exceeded", "maximum context length is 2048"),
    "completion_too_long": (text_chat(max_tokens=MAX_MODEL_LEN), 400, "messages", "context_length_exceeded",
                            "maximum context length"),
    "unknown_model": (text_chat(model="gpt-4o"), 404, "model", "model_not_found", "gpt-4o"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_gets_an_openai_error(http, case):
    body, status, param, code, fragment = BAD_REQUESTS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "stage"}
    assert (error["type"], error["param"], error["code"], error["stage"]) == ("invalid_request_error", param, code,
                                                                             "colocated")
    assert fragment in error["message"], error["message"]
    assert_healthy(http)


def test_framework_errors_are_openai_shaped(http):
    for response, status, code in ((http.get("/v1/nope"), 404, "not_found"),
                                   (http.get("/v1/chat/completions"), 405, "method_not_allowed")):
        assert response.status_code == status and response.json()["error"]["code"] == code


def test_still_serves_after_bad_input(http, client):
    assert_healthy(http)
    reply = client.chat.completions.create(model=MODEL, messages=IMAGE_CHAT, max_tokens=2)
    assert reply.usage.completion_tokens >= 1
    assert metrics(http)["epd_kv_blocks_used"] == 0
