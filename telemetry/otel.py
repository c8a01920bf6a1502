"""Tracing on: ``telemetry.api``'s classes over the official OpenTelemetry SDK. Imported only by
``telemetry.tracing.start_tracing`` when an endpoint is configured, so nothing of ``opentelemetry``
loads while tracing is off.

One ``TracerProvider`` per ``OtelTracing`` (never the global one: several servers may share a test
process), sampling ``ParentBased(TraceIdRatioBased(ratio))``, a ``BatchSpanProcessor`` exporting to the
endpoint with ``OTLPSpanExporter`` (HTTP/protobuf) on the SDK's own thread. Propagation is W3C
``traceparent`` (read with ``TraceContextTextMapPropagator``, written as its version-00 form). Methods
may be called from any thread.

A request the sampler leaves out costs next to nothing (what ``--otlp-traces-sample-ratio`` below 1 is
for): a new trace's id is drawn here first (``_DrawnIds``) and ``TraceIdRatioBased``'s own rule applied
to it; one left out never reaches the SDK, and gets a plain ``Span`` whose ``traceparent`` carries the
id unsampled, so every process downstream leaves it out too; one kept is made by the SDK with that very
id (the SDK's sampler then keeps it by the same rule). A span under an unsampled incoming
``traceparent`` is that ``traceparent`` passed on, likewise without the SDK.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from telemetry.api import Attributes, Span, SpanKind, SpanSpec, Tracing
from telemetry.config import TracingConfig
from telemetry.timeline_spans import spans_of
from telemetry.traceparent import HEADER, parse_traceparent

SCOPE = "epd-stage"
ERROR_TYPE = "error.type"
_KINDS = {SpanKind.INTERNAL: trace.SpanKind.INTERNAL, SpanKind.SERVER: trace.SpanKind.SERVER,
          SpanKind.CLIENT: trace.SpanKind.CLIENT}
_PROPAGATOR = TraceContextTextMapPropagator()


def ns(seconds: float) -> int:
    """Wall-clock seconds -> the SDK's nanoseconds."""
    return round(seconds * 1e9)


def attribute_value(value: object) -> AttributeValue:
    """A value OpenTelemetry accepts: str, bool, int, float, or a homogeneous sequence of one of them
    (a mixed sequence as strings); anything else as its ``str``."""
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        items = list(value)
        for kind in (str, bool, int, float):
            if all(type(item) is kind for item in items):
                return items
        return [str(item) for item in items]
    return str(value)


def _attributes(attributes: Attributes | None) -> dict[str, AttributeValue]:
    return {} if not attributes else {k: attribute_value(v) for k, v in attributes.items() if v is not None}


def _header_of(span: trace.Span) -> str | None:
    """The version-00 ``traceparent`` naming ``span`` (what the propagator would write, without its
    context and carrier)."""
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return "00-%032x-%016x-%02x" % (context.trace_id, context.span_id, context.trace_flags)


class _DrawnIds(IdGenerator):
    """The SDK's ids, but a new trace's id is the one ``draw`` took for it (on this thread, for the
    next root span the SDK starts here), so the SDK's sampler judges the id ``OtelTracing`` judged."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self._next = threading.local()

    def draw(self) -> int:
        trace_id = random.getrandbits(128) or 1
        self._next.trace_id = trace_id
        return trace_id

    def generate_span_id(self) -> int:
        return self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        trace_id = getattr(self._next, "trace_id", None)
        self._next.trace_id = None
        return trace_id if trace_id is not None else self._random.generate_trace_id()


def _finish(span: trace.Span, end: float, error: str | None, attributes: Attributes | None) -> None:
    if attributes:
        span.set_attributes(_attributes(attributes))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
        if not (attributes and ERROR_TYPE in attributes):
            span.set_attribute(ERROR_TYPE, error)
    span.end(end_time=ns(end))


class OtelSpan(Span):
    __slots__ = ("_span", "_tracer")

    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        super().__init__(_header_of(span))
        self._tracer, self._span = tracer, span

    def child(self, name: str, start: float, attributes: Attributes | None = None,
              kind: SpanKind = SpanKind.INTERNAL) -> Span:
        span = self._tracer.start_span(name, context=trace.set_span_in_context(self._span), kind=_KINDS[kind],
                                       attributes=_attributes(attributes), start_time=ns(start))
        return OtelSpan(self._tracer, span)

    def end(self, end: float, error: str | None = None, attributes: Attributes | None = None) -> None:
        _finish(self._span, end, error, attributes)


class OtelTracing(Tracing):
    enabled = True

    def __init__(self, config: TracingConfig) -> None:
        assert config.endpoint is not None
        self.config = config
        named = {"service.name": f"epd-{config.role}", "service.instance.id": config.instance_id,
                 "epd.role": config.role, "epd.model": config.model}
        resource = Resource.create({k: v for k, v in named.items() if v})  # an unnamed instance or model: absent
        self._ids = _DrawnIds()
        self._bound = TraceIdRatioBased.get_bound_for_rate(config.sample_ratio)
        self.provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
                                       resource=resource, shutdown_on_exit=False, id_generator=self._ids)
        exporter = OTLPSpanExporter(endpoint=config.endpoint, timeout=config.export_timeout_s)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer(SCOPE)
        self._stopped = False

    def start_span(self, name: str, parent_traceparent: str | None, start: float,
                   attributes: Attributes | None = None, kind: SpanKind = SpanKind.SERVER) -> Span:
        parent = parse_traceparent(parent_traceparent)
        if parent is not None and not parent.sampled:
            return Span(parent.header)  # left out upstream: passed on as it is, nothing made
        if parent is None:  # a new trace: judged here first, by TraceIdRatioBased's rule
            trace_id = self._ids.draw()
            if trace_id & TraceIdRatioBased.TRACE_ID_LIMIT >= self._bound:
                self._ids.generate_trace_id()  # not taken by the SDK: dropped
                return Span("00-%032x-%016x-00" % (trace_id, self._ids.generate_span_id()))
        span = self.tracer.start_span(name, context=_parent_context(parent_traceparent), kind=_KINDS[kind],
                                      attributes=_attributes(attributes), start_time=ns(start))
        return OtelSpan(self.tracer, span)

    def record(self, parent_traceparent: str | None, specs: Sequence[SpanSpec]) -> int:
        parent = parse_traceparent(parent_traceparent)
        if parent is not None and not parent.sampled:
            return 0
        root = _parent_context(parent_traceparent)
        made: list[trace.Span] = []
        for i, spec in enumerate(specs):
            above = spec.parent if spec.parent is not None and 0 <= spec.parent < i else None  # else: a root
            context = root if above is None else trace.set_span_in_context(made[above])
            span = self.tracer.start_span(spec.name, context=context,
                                          kind=trace.SpanKind.SERVER if above is None else trace.SpanKind.INTERNAL,
                                          start_time=ns(spec.start))
            _finish(span, spec.end, spec.error, spec.attributes)  # a spec's own error.type stands
            made.append(span)
        return sum(span.get_span_context().trace_flags.sampled for span in made)

    def record_timeline(self, parent_traceparent: str | None, role: str, events: Sequence[Mapping],
                        room: int | None = None) -> int:
        return self.record(parent_traceparent, spans_of(role, events, room))

    def flush(self, timeout_s: float = 5.0) -> bool:
        return _bounded(lambda: self.provider.force_flush(round(timeout_s * 1000)), timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        if self._stopped:
            return True
        self._stopped = True

        def stop() -> bool:
            flushed = self.provider.force_flush(round(timeout_s * 1000))
            self.provider.shutdown()
            return flushed

        return _bounded(stop, timeout_s)


def _parent_context(traceparent: str | None) -> Context:
    """The context whose span is ``traceparent``'s (an empty one, a new trace's, when None or invalid)."""
    if parse_traceparent(traceparent) is None:
        return Context()
    assert traceparent is not None
    return _PROPAGATOR.extract({HEADER: traceparent.strip()})


def _bounded(work: Callable[[], bool], timeout_s: float) -> bool:
    """``work()`` on a daemon thread, waited for at most ``timeout_s``: the SDK's flush and shutdown do
    not honour their timeouts (an unreachable collector would hold them through its retries)."""
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(bool(work())), name="otel-flush", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(result and result[0])
