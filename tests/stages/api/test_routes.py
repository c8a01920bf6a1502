"""The stage's app (stages/api/routes.py) in-process against a scripted engine: the completion and
stream shapes, images reaching the prompt builder, every refusal as an OpenAI error body, the
engine failing or gone, /health, /v1/models and /metrics. No model, no server."""

from __future__ import annotations

import json

import pytest

from stages.engine.outputs import RequestOutput
from stages.engine.request import FinishReason
from stages.metrics import Metrics
from tests.support.stage_api import (MODEL, FakeAsyncEngine, chat, client_for, data_url, error_of, image_part, png,
                                     png_header_only, scripted, sse_events)

pytestmark = pytest.mark.unit


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
