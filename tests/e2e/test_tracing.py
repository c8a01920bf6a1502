"""One trace per request across the router and every stage (OpenTelemetry, docs/observability.md): a
real EPD stack (an encoder, a prefill and a decode over Mooncake, a private Redis) and its router, each
exporting to a real OTLP/HTTP receiver in this process (``tests.support.otlp_receiver``).

- an EPD request continuing a client's ``traceparent``: one trace id, every span's parent in the
  trace (the client's span aside), the stages' spans under the router's call spans, the call spans
  lasting what ``x-epd-stage-times`` says and the stages' spans what their room timelines say;
- a PD stream (text only: no encoder): ``router.stream`` and the decode's first token in the trace;
- a client leaving mid-stream: the request's and the attempt's spans end ``aborted``, no orphan;
- an encoder failing its image: the attempt's span is an error blamed on the encoder, and so is the
  encoder's own span; the client's 500 (``encode_failed``) is the request span's error.
"""

from __future__ import annotations

import asyncio
import secrets

import httpx
import pytest

from cache.config import MIB
from cache.embedded import EmbeddedRedis
from tests.support.epd_helpers import EPD, start_epd
from tests.support.otlp_receiver import OTLPReceiver, SpanRecord
from tests.support.router_helpers import arm, data_url, messages, png

pytestmark = pytest.mark.timeout(300)
EXPORT_EVERY_MS = "100"  # OTEL_BSP_SCHEDULE_DELAY of every server: spans reach the receiver within a moment
TOKEN = "trace-test-admin-token"
ROUTER_FLAGS = ("--upstream-timeout-s", "30", "--health-interval-s", "0.5", "--admin-token", TOKEN)


@pytest.fixture(scope="module")
def receiver():
    with OTLPReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def redis_url():
    server = EmbeddedRedis(64 * MIB).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def epd(receiver, redis_url, tmp_path_factory):
    tracing = ("--otlp-traces-endpoint", receiver.endpoint)
    with pytest.MonkeyPatch.context() as patch:  # the servers inherit this process's environment
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", EXPORT_EVERY_MS)
        stack = start_epd("qwen2_vl", "mooncake", redis_url, tmp_path_factory.mktemp("trace-logs"),
                          encoder_flags=("--debug-faults", *tracing), prefill_flags=tracing, decode_flags=tracing)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def router(start_server, epd: EPD, receiver, redis_url):
    return start_server("router", "--encoder", epd.encoders[0].url, "--prefill", epd.prefill.url,
                        "--decode", epd.decode.url, "--redis-url", redis_url, *ROUTER_FLAGS,
                        "--otlp-traces-endpoint", receiver.endpoint, env={"OTEL_BSP_SCHEDULE_DELAY": EXPORT_EVERY_MS})


def client_traceparent() -> tuple[str, str, str]:
    """A client's sampled ``traceparent``: (header, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def chat(text: str, images: list[bytes], stream: bool = False, max_tokens: int = 4) -> dict:
    return {"messages": messages(text, [data_url(image) for image in images]), "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def by_name(spans: list[SpanRecord]) -> dict[str, SpanRecord]:
    """The trace's spans by name (each name once in these requests)."""
    named: dict[str, SpanRecord] = {}
    for span in spans:
        assert span.name not in named, f"{span.name} twice in the trace"
        named[span.name] = span
    return named


def wait_trace(receiver: OTLPReceiver, trace_id: str, names: set[str]) -> dict[str, SpanRecord]:
    """The trace's spans once every one of ``names`` has come."""
    receiver.wait_for(lambda spans: names <= {s.name for s in spans if s.trace_id == trace_id}, timeout=15)
    return by_name(receiver.traces()[trace_id])


def orphans(receiver: OTLPReceiver, trace_id: str, client_span: str) -> list[str]:
    """The names of the trace's spans whose parent is neither in the trace nor the client's span."""
    spans = receiver.traces()[trace_id]
    known = {s.span_id for s in spans} | {client_span}
    return [s.name for s in spans if s.parent_span_id is not None and s.parent_span_id not in known]


def parent_of(spans: dict[str, SpanRecord], name: str) -> str:
    """The name of ``name``'s parent span in the trace."""
    parent = spans[name].parent_span_id
    return next(n for n, s in spans.items() if s.span_id == parent)


def stage_times(response: httpx.Response) -> dict[str, float]:
    pairs = (item.split("=") for item in response.headers["x-epd-stage-times"].split(";"))
    return {stage: float(seconds) for stage, seconds in pairs}


def room_events(router, room: int, stage: str) -> dict[str, float]:
    """``stage``'s events of ``room`` as the router's admin API merges them: name -> wall-clock time."""
    view = httpx.get(f"{router.url}/admin/rooms/{room}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    return {e["event"]: e["t"] for e in view["stages"][stage]["events"]}


EPD_SPANS = {"chat", "router.admission", "router.attempt", "router.plan", "router.encoder", "router.prefill",
             "router.decode", "encoder /v1/encode", "encode", "prefill /v1/chat/completions", "prefill",
             "prefill.kv_write", "decode /v1/chat/completions", "decode", "decode.first_token"}


def test_an_epd_request_is_one_trace_under_the_clients_span(router, receiver):
    header, trace_id, client_span = client_traceparent()
    response = httpx.post(f"{router.url}/v1/chat/completions", json=chat("trace me", [png(48, 48, 31)]),
                          headers={"traceparent": header}, timeout=60)
    assert response.status_code == 200, response.text
    spans = wait_trace(receiver, trace_id, EPD_SPANS)
    assert spans["chat"].parent_span_id == client_span and spans["chat"].kind == "SERVER"
    assert not orphans(receiver, trace_id, client_span)
    for stage, served in (("encoder", "encoder /v1/encode"), ("prefill", "prefill /v1/chat/completions"),
                          ("decode", "decode /v1/chat/completions")):
        assert parent_of(spans, served) == f"router.{stage}" and spans[f"router.{stage}"].kind == "CLIENT"
        assert spans[served].resource["service.name"] == f"epd-{stage}"
    assert parent_of(spans, "router.encoder") == "router.attempt" and parent_of(spans, "router.attempt") == "chat"
    assert parent_of(spans, "prefill") == "prefill /v1/chat/completions"
    assert parent_of(spans, "prefill.kv_write") == "prefill"
    room = int(response.headers["x-epd-room"])
    assert spans["router.attempt"].attributes["epd.room"] == room
    # the router's call spans last what x-epd-stage-times says
    for stage, seconds in stage_times(response).items():
        assert spans[f"router.{stage}"].seconds == pytest.approx(seconds, abs=1e-3), stage
    # the stages' spans are their room timelines' numbers
    for stage, root, first, last in (("prefill", "prefill", "queued", "ready_sent"),
                                     ("decode", "decode", "queued", "finished")):
        events = room_events(router, room, stage)
        assert spans[root].start_ns / 1e9 == pytest.approx(events[first], abs=2e-3)
        assert spans[root].end_ns / 1e9 == pytest.approx(events[last], abs=2e-3)
    assert not any(span.is_error for span in spans.values())


def test_a_pd_stream_traces_its_first_token_and_its_stream(router, receiver):
    header, trace_id, client_span = client_traceparent()
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=chat("pd stream", [], stream=True),
                      headers={"traceparent": header}, timeout=60) as response:
        assert response.status_code == 200
        body = b"".join(response.iter_bytes())
    assert body.rstrip().endswith(b"data: [DONE]")
    names = {"chat", "router.attempt", "router.prefill", "router.decode", "router.stream", "prefill",
             "decode", "decode.first_token", "decode.stream"}
    spans = wait_trace(receiver, trace_id, names)
    assert "router.encoder" not in spans  # text only: no encoder call
    assert parent_of(spans, "router.stream") == "router.attempt"
    assert spans["router.stream"].end_ns <= spans["chat"].end_ns
    assert spans["decode.stream"].attributes["epd.finish_reason"] == "length"
    assert not orphans(receiver, trace_id, client_span)


async def test_a_client_leaving_mid_stream_ends_its_spans_aborted(router, receiver):
    header, trace_id, client_span = client_traceparent()
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{router.url}/v1/chat/completions",
                                 json=chat("leave me", [], stream=True, max_tokens=200),
                                 headers={"traceparent": header}) as response:
            async for _ in response.aiter_bytes():
                break  # the first chunk came: leave
    spans = wait_trace(receiver, trace_id, {"chat", "router.attempt", "decode /v1/chat/completions"})
    assert spans["chat"].attributes["epd.outcome"] == "aborted"
    assert spans["router.attempt"].attributes["epd.outcome"] == "aborted"
    await asyncio.sleep(0.5)  # anything still to come of this trace has come
    assert not orphans(receiver, trace_id, client_span)


def test_an_encoder_failure_is_the_attempts_error_and_the_encoders(router, epd, receiver):
    arm(epd.encoders[0].server, "encoder.crash", times=1)  # the one encoder: the retry finds none left
    header, trace_id, client_span = client_traceparent()
    response = httpx.post(f"{router.url}/v1/chat/completions", json=chat("fail me", [png(40, 56, 32)]),
                          headers={"traceparent": header}, timeout=60)
    assert (response.status_code, response.json()["error"]["code"]) == (500, "encode_failed"), response.text
    receiver.wait_for(lambda spans: {"chat", "encode"} <= {s.name for s in spans if s.trace_id == trace_id}, timeout=15)
    spans = receiver.traces()[trace_id]
    attempts = [s for s in spans if s.name == "router.attempt"]
    assert attempts and all(s.is_error and s.attributes["epd.blamed_stage"] == "encoder" for s in attempts)
    assert all(s.is_error for s in spans if s.name == "encode")
    chat_span = next(s for s in spans if s.name == "chat")
    assert chat_span.is_error and chat_span.attributes["http.response.status_code"] == 500
    assert not orphans(receiver, trace_id, client_span)
