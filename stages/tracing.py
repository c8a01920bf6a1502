"""OpenTelemetry traces of a stage server (issue 36): what it did for each request, as spans under
the ``traceparent`` its caller (the router, or a client driving the stage directly) sent.

``install(app, config)`` is called once per server (``stages.server.serve``) and only when
``config.tracing`` has an endpoint: tracing off installs nothing and costs a request nothing but the
``current()`` look-up of a context variable that is never set. On, it starts the process's ``Tracing``
(``telemetry.start_tracing``), shuts it down (bounded by ``SHUTDOWN_S``) when the app's lifespan ends,
and adds ``TracingMiddleware``, a pure ASGI middleware (streams pass through untouched):

- for a ``POST`` to ``TRACED_PATHS`` (chat, completions, encode) it starts a SERVER span named
  ``"{role} {path}"`` (e.g. ``prefill /v1/chat/completions``), the child of the request's
  ``traceparent`` header (a new trace without a valid one), and ends it when the response has been
  sent whole (or the request failed): ``http.response.status_code``, ``epd.room`` when the handler
  named one, status ERROR on a 5xx or on an in-band SSE error event (a stream's ``data: {"error"...``);
- the handler sees that span as ``current()`` (a ``StageTrace``), and records its room's timeline
  (``stages.timeline``, mapped by ``telemetry.timeline_spans``) under it when the room ends:
  ``StageTrace.record(role, events, room)``, the timeline root a child of the middleware span.

Where (``stages.disagg.server``, ``stages.encoder.routes``): a prefill when its HTTP half's
``coordinator.prefill`` returns or raises; a decode when its output stream ends or fails; an encoder
(or a switchable worker serving encode calls) when an encode call ends. A prefill whose HTTP half
came without a ``traceparent`` records its room under the one the decode sent in its ``KVRequest``
(``transfer.messages.KVRequest.traceparent``), so a client that traces only the decode still gets the
prefill's spans in its trace. A colocated server keeps no room timeline: its span carries the
request's token counts and finish reason (``traced_outputs``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from contract.paths import CHAT_PATH, COMPLETIONS_PATH, ENCODE_PATH
from telemetry import Span, Tracing, TracingConfig, parse_traceparent, start_tracing

if TYPE_CHECKING:
    from fastapi import FastAPI

    from stages.engine.outputs import RequestOutput

log = logging.getLogger(__name__)
TRACED_PATHS = frozenset((CHAT_PATH, COMPLETIONS_PATH, ENCODE_PATH))
SHUTDOWN_S = 5.0  # the lifespan's end waits at most this for the last spans to be exported
_HEADER = b"traceparent"
_SSE_ERROR = b'data: {"error"'  # an in-band error event (stages.api.lifetime.sse_event of an error body)
_CURRENT: ContextVar[StageTrace | None] = ContextVar("epd_stage_trace", default=None)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[Message], Any]
ASGIApp = Callable[[Scope, Receive, Send], Any]


class StageTrace:
    """The request's middleware span, as its handler sees it. ``traceparent``: that span's (the parent
    of the room's timeline spans, and what a decode sends its prefill); ``incoming``: whether the
    request came with a valid ``traceparent`` of its own; ``attributes``: set on the span when it
    ends (``epd.room`` and the like)."""

    __slots__ = ("attributes", "incoming", "span", "tracing")

    def __init__(self, tracing: Tracing, span: Span, incoming: bool) -> None:
        self.tracing, self.span, self.incoming = tracing, span, incoming
        self.attributes: dict[str, object] = {}

    @property
    def traceparent(self) -> str | None:
        return self.span.traceparent

    def record(self, role: str, events: Sequence[Mapping] | None, room: int,
               parent: str | None = None) -> None:
        """Record ``room``'s timeline on this stage (``role``: prefill, decode or encoder) under
        ``parent`` (default: the middleware span); never raises (a tracing failure is logged)."""
        self.attributes["epd.room"] = room
        if not events:
            return
        try:
            self.tracing.record_timeline(parent or self.traceparent, role, events, room)
        except Exception:  # tracing must never fail a request
            log.exception("room %d: recording its %s spans failed", room, role)


def current() -> StageTrace | None:
    """The request's ``StageTrace``; None when tracing is off (or outside a traced request)."""
    return _CURRENT.get()


class TracingMiddleware:
    """Pure ASGI: a SERVER span per traced request, from its arrival until its response is sent
    whole (module docstring)."""

    def __init__(self, app: ASGIApp, tracing: Tracing, role: str) -> None:
        self.app, self.tracing, self.role = app, tracing, role

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((value.decode("latin-1") for name, value in scope.get("headers") or ()
                       if name == _HEADER), None)
        span = self.tracing.start_span(f"{self.role} {path}", header, time.time(),
                                       {"http.request.method": "POST", "url.path": path})
        trace = StageTrace(self.tracing, span, parse_traceparent(header) is not None)
        state: dict[str, Any] = {"status": None, "error": None, "ended": False}

        def end(error: str | None = None) -> None:
            if state["ended"]:
                return
            state["ended"] = True
            status = state["status"]
            attributes = dict(trace.attributes)
            if status is not None:
                attributes["http.response.status_code"] = status
            if error is None and status is not None and status >= 500:
                error = f"HTTP {status}"
            error = error or state["error"]
            try:
                span.end(time.time(), error=error, attributes=attributes)
            except Exception:  # tracing must never fail a request
                log.exception("ending the span of a %s request failed", path)

        async def traced_send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                state["status"] = message["status"]
            elif kind == "http.response.body":
                body = message.get("body") or b""
                if state["error"] is None and body.startswith(_SSE_ERROR):
                    state["error"] = "in-band stream error"
                    trace.attributes["epd.stream_error"] = body[6:].decode("utf-8", "replace").strip()[:512]
            await send(message)
            if kind == "http.response.body" and not message.get("more_body", False):
                end()

        token = _CURRENT.set(trace)
        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            end(f"{type(exc).__name__}: {exc}" if state["status"] is None else None)
            raise
        finally:
            _CURRENT.reset(token)
            end("the response was not sent whole" if state["status"] is None else None)


def install(app: FastAPI, config: TracingConfig) -> Tracing | None:
    """Trace ``app`` as ``config`` says: nothing at all when it is off (None), else the started
    ``Tracing``, shut down when the app's lifespan ends, and the middleware."""
    if not config.enabled:
        return None
    tracing = start_tracing(config)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncGenerator[Any, None]:
        try:
            async with inner(a) as state:
                yield state
        finally:
            if not tracing.shutdown(SHUTDOWN_S):
                log.warning("tracing: the last spans were not all exported within %g s", SHUTDOWN_S)

    app.router.lifespan_context = lifespan
    app.add_middleware(TracingMiddleware, tracing=tracing, role=config.role)
    log.info("tracing: %s spans to %s (sample ratio %g)", config.role, config.endpoint, config.sample_ratio)
    return tracing


def traced_outputs(generate: Callable[..., Any]) -> Callable[..., Any]:
    """A colocated server's ``generate`` (``stages.api.lifetime.Generate``) whose outputs also set the
    request span's ``epd.prompt_tokens``, ``epd.completion_tokens`` (all sequences) and
    ``epd.finish_reason`` (sequence 0's). Used only when tracing is on."""

    async def traced(request_id: str, prompt: Any, params: Any, body: Any) -> AsyncGenerator[RequestOutput, None]:
        outputs = await generate(request_id, prompt, params, body)
        trace = current()
        return outputs if trace is None else _observed(outputs, trace)

    return traced


async def _observed(outputs: AsyncGenerator[RequestOutput, None],
                    trace: StageTrace) -> AsyncGenerator[RequestOutput, None]:
    completion: dict[int, int] = {}
    try:
        async for output in outputs:
            completion[output.index] = output.completion_tokens
            trace.attributes["epd.prompt_tokens"] = output.prompt_tokens
            if output.index == 0 and output.finish_reason is not None:
                trace.attributes["epd.finish_reason"] = output.finish_reason.value
            yield output
    finally:
        trace.attributes["epd.completion_tokens"] = sum(completion.values())
        await outputs.aclose()
