"""Tracing on, exporting over real OTLP/HTTP to ``tests.support.otlp_receiver``: one trace across the
router's live spans and a stage's recorded timeline, a client's trace continued, the sampled flag and
the ratio followed, a bounded shutdown; and with tracing off, nothing of ``opentelemetry`` imported."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from telemetry import SpanKind, SpanSpec, Tracing, TracingConfig, parse_traceparent, start_tracing
from tests.support.otlp_receiver import OTLPReceiver

REPO = Path(__file__).resolve().parents[2]
TID, SID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
NS = 1e9


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as r:
        yield r


def tracing_to(receiver: OTLPReceiver, role: str = "router", ratio: float = 1.0) -> Tracing:
    tracing = start_tracing(TracingConfig(endpoint=receiver.endpoint, sample_ratio=ratio, role=role,
                                          instance_id=f"{role}-1", model="tiny"))
    assert tracing.enabled
    return tracing


def prefill_events(t0: float, failed: bool = False) -> list[dict]:
    events = [{"event": "queued", "t": t0 + 0.001}, {"event": "paired", "t": t0 + 0.0123456},
              {"event": "embeddings_ready", "t": t0 + 0.02}, {"event": "prefilled", "t": t0 + 0.0456789,
                                                               "cached_tokens": 16, "prompt_tokens": 80}]
    if failed:
        return [*events, {"event": "failed", "t": t0 + 0.05, "reason": "decode went away", "code": "peer_gone"}]
    return [*events, {"event": "kv_written", "t": t0 + 0.06, "bytes": 1 << 20, "seconds": 0.01},
            {"event": "ready_sent", "t": t0 + 0.061}]


def test_one_trace_from_the_router_through_a_prefills_timeline(receiver):
    router, prefill = tracing_to(receiver), tracing_to(receiver, "prefill")
    t0 = time.time()
    request = router.start_span("chat.completions", None, t0, {"epd.room": 7})
    call = request.child("router.prefill", t0 + 0.0005, {"epd.worker": "p1"}, SpanKind.CLIENT)
    events = prefill_events(t0)
    assert prefill.record_timeline(call.traceparent, "prefill", events, room=7) == 5
    call.end(t0 + 0.062)
    request.end(t0 + 0.07, attributes={"http.response.status_code": 200})
    assert router.shutdown(5) and prefill.shutdown(5)

    spans = receiver.wait_for(7)
    assert len({s.trace_id for s in spans}) == 1 and not receiver.orphans() and not receiver.bad_requests
    [root] = receiver.trees()[spans[0].trace_id]
    assert root.render() == "\n".join(["chat.completions", "  router.prefill", "    prefill", "      prefill.handshake",
                                       "      prefill.embeddings_wait", "      prefill.compute",
                                       "      prefill.kv_write"])
    top, client, stage = receiver.span("chat.completions"), receiver.span("router.prefill"), receiver.span("prefill")
    assert top.parent_span_id is None and top.kind == "SERVER" and client.kind == "CLIENT"
    assert client.parent_span_id == top.span_id and stage.parent_span_id == client.span_id
    assert stage.kind == "SERVER" and receiver.span("prefill.handshake").kind == "INTERNAL"
    assert top.resource["service.name"] == "epd-router" and stage.resource["service.name"] == "epd-prefill"
    assert stage.resource["service.instance.id"] == "prefill-1" and stage.resource["epd.model"] == "tiny"
    assert stage.resource["epd.role"] == "prefill"
    assert top.attributes == {"epd.room": 7, "http.response.status_code": 200}
    assert stage.attributes == {"epd.room": 7, "epd.cached_tokens": 16}
    assert receiver.span("prefill.kv_write").attributes == {"epd.bytes": 1 << 20}
    by_event = {e["event"]: e["t"] for e in events}
    for name, start, end in (("prefill", "queued", "ready_sent"), ("prefill.handshake", "queued", "paired"),
                             ("prefill.embeddings_wait", "queued", "embeddings_ready"),
                             ("prefill.compute", "embeddings_ready", "prefilled")):
        span = receiver.span(name)
        assert abs(span.start_ns - by_event[start] * NS) < 1000 and abs(span.end_ns - by_event[end] * NS) < 1000
        assert span.seconds == pytest.approx(by_event[end] - by_event[start], abs=1e-6)
    assert receiver.span("prefill.kv_write").seconds == pytest.approx(0.01, abs=1e-6)
    assert all(s.status_code == 0 for s in spans)


def test_a_failed_room_and_a_failed_request_are_errors(receiver):
    router = tracing_to(receiver)
    t0 = time.time()
    request = router.start_span("chat.completions", None, t0)
    router.record_timeline(request.traceparent, "prefill", prefill_events(t0, failed=True))
    request.end(t0 + 0.1, error="prefill failed", attributes={"error.type": "bad_gateway_x"})
    router.flush(5)
    receiver.wait_for(5)
    stage, top = receiver.span("prefill"), receiver.span("chat.completions")
    assert stage.is_error and stage.status_message == "decode went away"
    assert stage.attributes["error.type"] == "peer_gone" and stage.attributes["epd.error_code"] == "peer_gone"
    assert top.is_error and top.status_message == "prefill failed" and top.attributes["error.type"] == "bad_gateway_x"
    assert not receiver.span("prefill.handshake").is_error
    router.shutdown(5)


def test_a_clients_traceparent_is_continued(receiver):
    router = tracing_to(receiver)
    span = router.start_span("chat.completions", f"00-{TID}-{SID}-01", time.time())
    sent = parse_traceparent(span.traceparent)
    assert sent is not None and sent.sampled and f"{sent.trace_id:032x}" == TID
    span.end(time.time())
    router.shutdown(5)
    [record] = receiver.wait_for(1)
    assert record.trace_id == TID and record.parent_span_id == SID and f"{sent.span_id:016x}" == record.span_id
    assert receiver.orphans() == [record] and not receiver.orphans({SID})


def test_an_unsampled_parent_exports_nothing(receiver):
    router = tracing_to(receiver)
    unsampled = f"00-{TID}-{SID}-00"
    span = router.start_span("chat.completions", unsampled, time.time())
    sent = parse_traceparent(span.traceparent)
    assert sent is not None and not sent.sampled and f"{sent.trace_id:032x}" == TID  # the stages follow it
    span.child("router.prefill", time.time()).end(time.time())
    span.end(time.time())
    assert router.record(unsampled, [SpanSpec("prefill", 1.0, 2.0)]) == 0
    assert router.record_timeline(span.traceparent, "prefill", prefill_events(time.time())) == 0
    router.start_span("control", None, time.time()).end(time.time())  # sampled: what comes proves the flush
    assert router.shutdown(5)
    receiver.wait_for(1)
    assert [s.name for s in receiver.spans()] == ["control"]


def test_the_ratio_keeps_what_trace_id_ratio_based_keeps(receiver):
    ratio, n = 0.01, 3000
    router = tracing_to(receiver, ratio=ratio)
    bound = round(ratio * (1 << 64))  # TraceIdRatioBased: the trace id's low 64 bits below ratio * 2**64
    started = [router.start_span("request", None, time.time()) for _ in range(n)]
    kept = set()
    for span in started:
        sent = parse_traceparent(span.traceparent)
        assert sent is not None and sent.sampled == ((sent.trace_id & ((1 << 64) - 1)) < bound)
        if sent.sampled:
            kept.add(f"{sent.trace_id:032x}")
        span.end(time.time())
    assert 5 <= len(kept) <= 70  # binomial(3000, 0.01): mean 30
    assert all(span.sampled == (f"{parse_traceparent(span.traceparent).trace_id:032x}" in kept) for span in started)
    left_out = next(span for span in started if not span.sampled)  # made without the SDK: its child is itself
    assert left_out.child("router.attempt", time.time()).traceparent == left_out.traceparent
    assert router.start_span("stage", left_out.traceparent, time.time()).traceparent == left_out.traceparent
    assert router.shutdown(10)
    receiver.wait_for(len(kept))
    assert {s.trace_id for s in receiver.spans()} == kept


def test_shutdown_flushes_within_its_timeout_and_gzip_is_read(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    router = tracing_to(receiver)
    t0 = time.time()
    for i in range(50):
        router.start_span(f"request-{i}", None, t0).end(t0 + 0.001)
    started = time.monotonic()
    assert router.shutdown(5)
    assert time.monotonic() - started < 5 and len(receiver.spans()) == 50 and not receiver.bad_requests
    assert receiver.gzipped == receiver.requests >= 1
    router.start_span("after", None, t0).end(t0)  # dropped: the provider is stopped
    assert router.shutdown(1)


def test_shutdown_against_an_unreachable_collector_is_bounded():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    tracing = start_tracing(TracingConfig(endpoint=f"http://127.0.0.1:{port}/v1/traces", export_timeout_s=30))
    tracing.start_span("request", None, time.time()).end(time.time())
    started = time.monotonic()
    assert tracing.shutdown(1.0) is False
    assert time.monotonic() - started < 2.0


def test_tracing_off_imports_nothing_of_opentelemetry():
    code = "\n".join([
        "import sys, time, telemetry, telemetry.timeline_spans",
        "from telemetry import start_tracing, TracingConfig, OFF",
        "t = start_tracing(TracingConfig())",
        "assert t is OFF",
        "s = t.start_span('r', '00-%s-%s-01', time.time())" % (TID, SID),
        "s.child('c', time.time()).end(time.time())",
        "s.end(time.time(), error='x')",
        "t.record_timeline(s.traceparent, 'prefill', [{'event': 'queued', 't': 1.0}])",
        "telemetry.timeline_spans.spans_of('prefill', [{'event': 'queued', 't': 1.0}])",
        "t.shutdown()",
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('opentelemetry', 'google')))",
    ])
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
