"""The HTTP layer in-process, no model: image parsing, message conversion, parameter mapping, error
bodies and the response / stream shapes, against a scripted fake engine."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import struct
import zlib

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from stages.api import lifetime
from stages.api.chat import ImageMode, Preparer, hf_messages, image_sources, load_images, sampling_params
from stages.api.errors import APIError, param_name
from stages.api.images import ImageLimits, decode_data_url, load_image, open_image
from stages.api.routes import create_app
from stages.api.schemas import ChatCompletionRequest
from stages.engine.async_engine import EngineStats
from stages.engine.engine import RequestOutput
from stages.engine.multimodal import Prompt
from stages.engine.request import FinishReason
from stages.metrics import Metrics

MODEL = "tiny-test"


# --- helpers -----------------------------------------------------------------------------------
def png(width: int = 8, height: int = 6, color: tuple = (200, 10, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and IHDR claiming width x height, with no pixel data at all."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + ihdr + chunk(b"IEND", b"")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def request(**fields) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatCompletionRequest.model_validate(fields)


def raises_api_error(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    return info.value


# --- images ------------------------------------------------------------------------------------
LIMITS = ImageLimits(max_images=3, max_pixels=10_000, max_bytes=4_000)


def test_data_url_roundtrip_png_and_jpeg():
    image = load_image(data_url(png(20, 10)), LIMITS)
    assert image.size == (20, 10) and image.getpixel((0, 0)) == (200, 10, 10)
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (0, 0, 255)).save(buffer, format="JPEG")
    assert load_image(data_url(buffer.getvalue(), "image/jpeg"), LIMITS).size == (16, 16)


def test_remote_urls_are_refused_with_a_pointer_to_the_router():
    for url in ("http://example.com/cat.png", "https://example.com/cat.png"):
        error = raises_api_error(decode_data_url, url, LIMITS, "p")
        assert (error.status, error.code, error.param) == (400, "remote_image_url", "p")
        assert "not fetched by stage servers" in error.message and "router" in error.message


@pytest.mark.parametrize("url, code", [
    ("ftp://example.com/cat.png", "invalid_image_url"),
    ("cat.png", "invalid_image_url"),
    ("data:image/png,rawbytes", "invalid_image_url"),
    ("data:image/png;base64,@@not*base64@@", "invalid_base64"),
    ("data:image/png;base64,abc", "invalid_base64"),  # bad padding
])
def test_malformed_image_urls_are_400(url, code):
    error = raises_api_error(decode_data_url, url, LIMITS)
    assert (error.status, error.code) == (400, code)


def test_bytes_that_are_not_an_image_are_400():
    error = raises_api_error(load_image, data_url(b"this is not an image at all"), LIMITS)
    assert (error.status, error.code) == (400, "invalid_image")
    truncated = png(40, 40)[:60]
    assert raises_api_error(load_image, data_url(truncated), LIMITS).status == 400


def test_too_many_bytes_is_413_before_and_after_decoding():
    noise = Image.frombytes("RGB", (60, 60), random.Random(0).randbytes(60 * 60 * 3))
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG")
    assert len(buffer.getvalue()) > LIMITS.max_bytes
    error = raises_api_error(load_image, data_url(buffer.getvalue()), LIMITS)
    assert (error.status, error.code) == (413, "image_too_large") and str(LIMITS.max_bytes) in error.message
    exact = ImageLimits(max_bytes=len(png()) - 1)  # passes the cheap length bound, fails the exact check
    assert raises_api_error(decode_data_url, data_url(png()), exact).status == 413


def test_pixel_limit_is_checked_from_the_header_before_decoding():
    # No pixel data follows the header: a 413 (not a 400 "could not decode") proves nothing was decoded.
    error = raises_api_error(open_image, png_header_only(200, 100), LIMITS)
    assert (error.status, error.code) == (413, "image_too_large") and "200x100" in error.message
    assert open_image(png(100, 100), LIMITS).size == (100, 100)  # exactly at the limit is fine


def test_decompression_bomb_header_is_413():
    error = raises_api_error(open_image, png_header_only(100_000, 100_000), ImageLimits(max_pixels=10**12))
    assert (error.status, error.code) == (413, "image_too_large")


def test_limits_validate_and_name_the_flag():
    with pytest.raises(ValueError, match="--max-image-pixels"):
        ImageLimits(max_pixels=0)


# --- messages and parameters -------------------------------------------------------------------
def test_messages_convert_in_order_with_images_as_placeholders():
    a, b, c = data_url(png(color=(1, 1, 1))), data_url(png(color=(2, 2, 2))), data_url(png(color=(3, 3, 3)))
    req = request(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [image_part(a), {"type": "text", "text": "and"}, image_part(b)]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "now"}, {"type": "image_url", "image_url": c}]},
    ])
    assert hf_messages(req) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "now"}, {"type": "image"}]},
    ]
    assert [param for _, param in image_sources(req)] == [
        "messages[1].content[0].image_url", "messages[1].content[2].image_url", "messages[3].content[1].image_url"]
    assert [im.getpixel((0, 0)) for im, _ in load_images(req, LIMITS)] == [(1, 1, 1), (2, 2, 2), (3, 3, 3)]


def test_developer_is_the_system_role():
    """OpenAI's current name for the system role reaches the chat template as system."""
    req = request(messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "q"}])
    assert hf_messages(req) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]


def test_assistant_message_without_content_becomes_empty_text():
    req = request(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": None}])
    assert hf_messages(req)[1] == {"role": "assistant", "content": ""}


def test_images_are_counted_before_any_is_decoded():
    bad = "data:image/png;base64,@@@"  # would be a 400 invalid_base64 if it were decoded
    req = request(messages=[{"role": "user", "content": [image_part(bad)] * 2},
                            {"role": "user", "content": [image_part(bad)] * 2}])
    error = raises_api_error(load_images, req, LIMITS)
    assert (error.status, error.code, error.param) == (400, "too_many_images", "messages")
    assert "4 images" in error.message and "at most 3" in error.message


def test_sampling_params_mapping():
    p = sampling_params(request(), prompt_len=10, max_model_len=100, vocab_size=1000)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos) == (
        90, 1.0, 1.0, 0, None, (), False)
    p = sampling_params(request(max_tokens=5, max_completion_tokens=7, temperature=0, top_p=0.5, top_k=-1, seed=3,
                                stop="END", ignore_eos=True), prompt_len=10, max_model_len=100, vocab_size=1000)
    assert (p.max_tokens, p.greedy, p.top_p, p.top_k, p.seed, p.stop, p.ignore_eos) == (
        7, True, 0.5, 0, 3, ("END",), True)
    assert sampling_params(request(max_tokens=5, stop=["a", "b"], top_k=4), 10, 100, 1000).stop == ("a", "b")
    assert sampling_params(request(), 100, 100, 1000).max_tokens == 1  # engine refuses it later


def test_param_names_drop_union_tags():
    loc = ("body", "messages", 0, "content", "list[ContentPart]", 1, "image_url", "ImageURL", "url")
    assert param_name(loc) == "messages[0].content[1].image_url.url"
    assert param_name(("body", "stop", "str")) == "stop"
    assert param_name(("body",)) is None


# --- the app, against a scripted engine ---------------------------------------------------------
class FakeEngine:
    """The prompt builder and engine limits ``chat.Preparer`` uses: a prompt of 4 tokens + 10 per image."""

    max_model_len = 64
    vocab_size = 1000
    guides = None  # compiles no grammar

    def __init__(self) -> None:
        self.built: list[tuple[list, list]] = []

    def build(self, messages: list[dict], images: list) -> Prompt:
        self.built.append((messages, images))
        return Prompt(token_ids=[1] * (4 + 10 * len(images)))

    def num_image_tokens(self, width: int, height: int) -> int:
        if max(width, height) > 200 * min(width, height):
            raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(width, height) / min(width, height)}")
        return 10

    def check_request(self, prompt: Prompt, params) -> None:
        total = len(prompt.token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens; asked {total}")


def scripted(*pieces: str, reason: FinishReason = FinishReason.STOP, error: str | None = None):
    def script(request_id: str, prompt: Prompt):
        n = len(prompt.token_ids)
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput(request_id, text, [i], reason if last else None, n, i + 1, error if last else None)
    return script


class FakeAsyncEngine:
    def __init__(self, script=scripted("Hel", "lo", " world")) -> None:
        self.engine = FakeEngine()
        self.alive = True
        self.script = script
        self.params: list = []
        self.aborted: list[str] = []
        self.hang = False

    def stats(self) -> EngineStats:
        return EngineStats(waiting=2, running=3, blocks_used=5, blocks_total=100)

    async def generate(self, request_id: str, prompt: Prompt, params):
        self.params.append(params)
        finished = False
        try:
            for output in self.script(request_id, prompt):
                finished = output.finished
                yield output
            if self.hang:
                await asyncio.Event().wait()
        finally:
            if not finished:
                self.aborted.append(request_id)


def client_for(engine: FakeAsyncEngine, metrics: Metrics | None = None) -> TestClient:
    prepare = Preparer(engine.engine, engine.engine, LIMITS, ImageMode.PIXELS)  # FakeEngine: builder and limits
    app = create_app(engine, model_name=MODEL, prepare=prepare, metrics=metrics)
    return TestClient(app, raise_server_exceptions=False)


def chat(client: TestClient, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return client.post("/v1/chat/completions", json=body)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def sse_events(response) -> list:
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line[len("data: "):] for line in lines]


def test_non_stream_completion_shape():
    engine = FakeAsyncEngine()
    body = chat(client_for(engine), model=MODEL, max_tokens=8).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello world"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.params[0].max_tokens == 8


def test_stream_chunks_with_usage():
    response = chat(client_for(FakeAsyncEngine()), stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello world"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, None, "stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 7
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stream_without_usage_has_no_usage_key():
    chunks = [json.loads(e) for e in sse_events(chat(client_for(FakeAsyncEngine()), stream=True))[:-1]]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_images_reach_the_prompt_builder_in_order():
    engine = FakeAsyncEngine()
    url_a, url_b = data_url(png(5, 5)), data_url(png(7, 7))
    response = chat(client_for(engine), messages=[
        {"role": "user", "content": [image_part(url_a), {"type": "text", "text": "x"},
                                     {"type": "image_url", "image_url": url_b}]}])
    assert response.status_code == 200
    messages, images = engine.engine.built[0]
    assert messages[0]["content"][0] == {"type": "image"} and [im.size for im in images] == [(5, 5), (7, 7)]
    assert response.json()["usage"]["prompt_tokens"] == 24


@pytest.mark.parametrize("body, param, code", [
    ({"messages": []}, "messages", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_completion_tokens": -3}, "max_completion_tokens", "invalid_value"),
    ({"n": 9}, "n", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_value"),
    ({"temperature": 3.0}, "temperature", "invalid_value"),
    ({"top_p": -0.1}, "top_p", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stop": ""}, "stop", "invalid_value"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", "invalid_value"),
    ({"messages": "hi"}, "messages", "invalid_value"),
])
def test_schema_violations_are_400_naming_the_field(body, param, code):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    error = error_of(client_for(FakeAsyncEngine()).post("/v1/chat/completions", json=body), 400)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert param in error["message"]


def test_missing_messages_is_400():
    error = error_of(client_for(FakeAsyncEngine()).post("/v1/chat/completions", json={"model": MODEL}), 400)
    assert (error["param"], error["code"]) == ("messages", "missing_required_parameter")
    assert error["message"] == "Missing required parameter: 'messages'."


def test_unknown_fields_are_ignored():
    assert chat(client_for(FakeAsyncEngine()), frequency_penalty=0.5, user="u", logit_bias={}).status_code == 200


@pytest.mark.parametrize("raw", [b'{"messages": [', b"", b"\xff\xfe"])
def test_malformed_json_is_400(raw):
    response = client_for(FakeAsyncEngine()).post("/v1/chat/completions", content=raw,
                                                  headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_json")
    assert "not valid JSON" in error["message"]


def test_json_is_parsed_whatever_the_content_type():
    response = client_for(FakeAsyncEngine()).post("/v1/chat/completions", content=json.dumps({"messages": [
        {"role": "user", "content": "hi"}]}), headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200  # curl -d sends that content type


def test_unknown_model_is_404():
    error = error_of(chat(client_for(FakeAsyncEngine()), model="gpt-4o"), 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model") and "gpt-4o" in error["message"]


def test_framework_errors_are_openai_shaped():
    client = client_for(FakeAsyncEngine())
    assert error_of(client.get("/v1/nothing-here"), 404)["code"] == "not_found"
    assert error_of(client.get("/v1/chat/completions"), 405)["code"] == "method_not_allowed"


def test_image_errors_through_the_app():
    client = client_for(FakeAsyncEngine())
    error = error_of(chat(client, messages=[{"role": "user", "content": [image_part("https://x.org/a.png")]}]), 400)
    assert error["code"] == "remote_image_url" and error["param"] == "messages[0].content[0].image_url"
    huge = image_part(data_url(png_header_only(500, 500)))
    assert error_of(chat(client, messages=[{"role": "user", "content": [huge]}]), 413)["code"] == "image_too_large"
    assert error_of(chat(client, messages=[{"role": "user", "content": [image_part("data:x")] * 4}]),
                    400)["code"] == "too_many_images"


def test_context_overflow_is_400_context_length_exceeded():
    error = error_of(chat(client_for(FakeAsyncEngine()), max_tokens=61), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "maximum context length" in error["message"]


def test_engine_error_is_500_or_an_error_event():
    engine = FakeAsyncEngine(scripted("a", "", reason=FinishReason.ABORT, error="RuntimeError: boom"))
    error = error_of(chat(client_for(engine)), 500)
    assert (error["type"], error["code"]) == ("server_error", "engine_error") and "boom" in error["message"]
    events = sse_events(chat(client_for(engine), stream=True))
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_error"


def test_dead_engine_is_503():
    engine = FakeAsyncEngine()
    engine.alive = False
    client = client_for(engine)
    health = error_of(client.get("/health"), 503)
    assert health["code"] == "unhealthy" and "engine thread: thread is not running" in health["message"]
    assert error_of(chat(client), 503)["type"] == "server_error"


def test_engine_ending_under_a_request_is_503_not_500():
    from stages.engine.async_engine import EngineTimeout, EngineUnavailable

    for failure in (EngineUnavailable("the engine thread has ended"), EngineTimeout("call passed its deadline")):
        def script(request_id, prompt, failure=failure):
            yield RequestOutput(request_id, "a", [1], None, 4, 1)
            raise failure

        engine = FakeAsyncEngine(script)
        assert error_of(chat(client_for(engine)), 503)["code"] == "engine_unavailable"
        events = sse_events(chat(client_for(engine), stream=True))
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_unavailable"


def test_engine_dying_mid_request_fails_it_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(lifetime, "LIVENESS_CHECK_S", 0.02)
    engine = FakeAsyncEngine(lambda rid, prompt: iter([RequestOutput(rid, "partial", [1], None, 4, 1)]))
    engine.hang = True  # after its first output the request waits forever, as if the engine thread had died

    async def run() -> None:
        outputs = lifetime.guarded(engine, engine.generate("r1", Prompt([1, 2]), None))
        assert (await anext(outputs)).text == "partial"
        engine.alive = False
        with pytest.raises(APIError) as info:
            await asyncio.wait_for(anext(outputs), timeout=5)
        assert info.value.status == 503

    asyncio.run(run())
    assert engine.aborted == ["r1"]


def test_health_models_and_metrics():
    engine, metrics = FakeAsyncEngine(), Metrics()
    client = client_for(engine, metrics)
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [
        (MODEL, "model", "epd-stage")]
    assert chat(client).status_code == 200
    text = client.get("/metrics").text
    for line in ("epd_queue_depth 2.0", "epd_running_requests 3.0", "epd_kv_blocks_used 5.0",
                 "epd_kv_blocks_total 100.0", 'epd_requests_total{finish_reason="stop"} 1.0',
                 "epd_prompt_tokens_total 4.0", "epd_generation_tokens_total 3.0",
                 "epd_time_to_first_token_seconds_count 1.0", "epd_e2e_request_latency_seconds_count 1.0",
                 "epd_time_per_output_token_seconds_count 1.0"):
        assert line in text, line


def test_metrics_registries_are_per_app_and_requests_count_once():
    first, second = Metrics(), Metrics()  # a process-global registry would refuse the second
    timer = first.timer()
    timer.tokens(1)
    timer.finish("length", 10, 4)
    timer.finish("abort", 10, 4)
    first.observe_step(3, 0.01)
    text = first.render().decode()
    assert 'epd_requests_total{finish_reason="length"} 1.0' in text
    assert 'epd_requests_total{finish_reason="abort"} 0.0' in text
    assert "epd_batch_size_sum 3.0" in text
    assert 'epd_requests_total{finish_reason="length"} 0.0' in second.render().decode()


# --- config and CLI --------------------------------------------------------------------------------
def test_server_config_names_the_model_after_its_directory():
    from stages.config import ServerConfig
    from stages.engine.config import EngineConfig

    assert ServerConfig("colocated", EngineConfig(model="/models/qwen2-vl-tiny/")).model_name == "qwen2-vl-tiny"
    assert ServerConfig("colocated", EngineConfig(model="/m"), served_model_name="vl").model_name == "vl"
    assert ServerConfig("colocated", EngineConfig(model="/m")).host == "127.0.0.1"
    with pytest.raises(ValueError, match="--port"):
        ServerConfig("colocated", EngineConfig(model="/m"), port=70000)


def test_server_config_refuses_debug_faults_off_loopback_and_a_role_without_its_section():
    from stages.config import DisaggConfig, ServerConfig
    from stages.engine.config import EngineConfig

    engine = EngineConfig(model="/m")
    assert ServerConfig("colocated", engine, debug_faults=True).debug_faults
    assert ServerConfig("colocated", engine, host="::1", debug_faults=True).debug_faults
    with pytest.raises(ValueError, match="--debug-faults is refused on a server bound to '0.0.0.0'"):
        ServerConfig("colocated", engine, host="0.0.0.0", debug_faults=True)
    with pytest.raises(ValueError, match="a decode server needs DisaggConfig"):
        ServerConfig("decode", engine)
    with pytest.raises(ValueError, match="a colocated server takes no DisaggConfig"):
        ServerConfig("colocated", engine, disagg=DisaggConfig())
    with pytest.raises(ValueError, match="--max-body-mb"):
        ServerConfig("colocated", engine, max_body_mb=0)


def test_help_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("flags, named", [
    (["--max-image-pixels", "0"], "--max-image-pixels"),
    (["--max-images-per-request", "-1"], "--max-images-per-request"),
    (["--block-size", "0"], "--block-size"),
    (["--port", "-5"], "--port"),
    (["--max-body-mb", "0"], "--max-body-mb"),
    (["--max-waiting", "-1"], "--max-waiting"),
    (["--host", "0.0.0.0", "--debug-faults"], "--debug-faults"),
])
def test_serve_refuses_bad_flags_before_loading_anything(flags, named, capsys):
    from cli import main

    assert main(["serve", "colocated", "--model", "/does/not/exist", *flags]) == 2
    assert named in capsys.readouterr().err
