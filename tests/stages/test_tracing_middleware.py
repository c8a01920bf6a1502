"""``stages.tracing``'s middleware and ``StageTrace`` over a recording ``Tracing`` (pure: no server, no
SDK): which requests get a span, the handler's view of it, the status and errors it ends with, and
that a room is recorded under the right parent."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest

from stages.tracing import StageTrace, TracingMiddleware, current
from telemetry import Span, Tracing

pytestmark = pytest.mark.unit
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
MINE = "00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01"


class RecordedSpan(Span):
    def __init__(self, name: str, parent: str | None) -> None:
        super().__init__(MINE)
        self.name, self.parent, self.ended = name, parent, []

    def end(self, end, error=None, attributes=None) -> None:
        self.ended.append((error, dict(attributes or {})))


class Recording(Tracing):
    enabled = True

    def __init__(self) -> None:
        self.spans: list[RecordedSpan] = []
        self.records: list[tuple] = []

    def start_span(self, name, parent_traceparent, start, attributes=None, kind=None) -> Span:
        self.spans.append(RecordedSpan(name, parent_traceparent))
        return self.spans[-1]

    def record_timeline(self, parent_traceparent: str | None, role: str, events: Sequence[Mapping],
                        room: int | None = None) -> int:
        self.records.append((parent_traceparent, role, list(events), room))
        return len(events)


def app_of(status: int, *bodies: bytes, seen: list | None = None):
    async def app(scope, receive, send) -> None:
        if seen is not None:
            seen.append(current())
        await send({"type": "http.response.start", "status": status, "headers": []})
        for i, body in enumerate(bodies):
            await send({"type": "http.response.body", "body": body, "more_body": i < len(bodies) - 1})

    return app


def call(middleware, path: str = "/v1/chat/completions", method: str = "POST", traceparent: str | None = PARENT):
    headers = [] if traceparent is None else [(b"traceparent", traceparent.encode())]
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    return sent


def test_a_chat_request_is_a_span_under_its_traceparent_seen_by_the_handler():
    tracing, seen = Recording(), []
    call(TracingMiddleware(app_of(200, b"{}", seen=seen), tracing, "decode"))
    [span] = tracing.spans
    assert (span.name, span.parent) == ("decode /v1/chat/completions", PARENT)
    assert isinstance(seen[0], StageTrace) and seen[0].traceparent == MINE and seen[0].incoming
    assert span.ended == [(None, {"http.response.status_code": 200})]
    assert current() is None


def test_other_routes_and_methods_get_no_span():
    tracing = Recording()
    for path, method in (("/health", "GET"), ("/v1/chat/completions", "GET"), ("/rooms/1", "GET"),
                         ("/v1/abort", "POST")):
        assert call(TracingMiddleware(app_of(200, b"ok"), tracing, "prefill"), path, method)
    assert tracing.spans == []


def test_a_5xx_and_an_in_band_stream_error_end_the_span_in_error():
    tracing = Recording()
    call(TracingMiddleware(app_of(504, b'{"error": {}}'), tracing, "prefill"))
    call(TracingMiddleware(app_of(200, b'data: {"id":1}\n\n', b'data: {"error":{"code":"x"}}\n\n', b"data: [DONE]\n\n"),
                           tracing, "decode"))
    (error_5xx, _), (error_sse, attributes) = tracing.spans[0].ended[0], tracing.spans[1].ended[0]
    assert error_5xx == "HTTP 504" and error_sse == "in-band stream error"
    assert attributes["epd.stream_error"] == '{"error":{"code":"x"}}'


def test_a_handler_that_raises_ends_the_span_in_error_and_an_untraced_request_is_not_incoming():
    tracing, seen = Recording(), []

    async def broken(scope, receive, send) -> None:
        seen.append(current())
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        call(TracingMiddleware(broken, tracing, "encoder"), "/v1/encode", traceparent=None)
    assert tracing.spans[0].parent is None and not seen[0].incoming
    assert tracing.spans[0].ended == [("RuntimeError: boom", {})]


def test_a_room_is_recorded_under_the_request_span_or_the_parent_given():
    tracing = Recording()
    trace = StageTrace(tracing, RecordedSpan("x", None), incoming=False)
    events = [{"event": "queued", "t": 1.0}]
    trace.record("prefill", events, 7)
    trace.record("prefill", events, 8, parent=PARENT)
    trace.record("prefill", None, 9)  # a room not kept: nothing
    assert [(r[0], r[3]) for r in tracing.records] == [(MINE, 7), (PARENT, 8)]
    assert trace.attributes == {"epd.room": 9}
