"""OpenTelemetry tracing for the router and the stages (issue 36): off by default and then costing
nothing (no ``opentelemetry`` import), a leaf that imports nothing of ours.

- ``config``: ``TracingConfig`` and the ``--otlp-traces-endpoint`` / ``--otlp-traces-sample-ratio`` flags.
- ``traceparent``: the W3C header, parsed without the SDK (invalid -> None: a new trace).
- ``api``: ``Tracing`` and ``Span`` (disabled: no-ops; ``OFF``), ``SpanKind``, ``SpanSpec``.
- ``tracing``: ``start_tracing(config)`` -> ``OFF`` or the SDK-backed ``Tracing`` (``otel``).
- ``timeline_spans``: a stage's room timeline -> ``SpanSpec``s (pure), for ``Tracing.record``.

The router makes live spans (``start_span``, ``.child``, ``.end``) and sends ``span.traceparent``
downstream; a stage records its room's timeline when the room ends (``record_timeline``), under the
``traceparent`` the router sent.
"""

from telemetry.api import NO_SPAN, OFF, Span, SpanKind, SpanSpec, Tracing
from telemetry.config import TracingConfig, add_tracing_args
from telemetry.traceparent import TraceParent, parse_traceparent
from telemetry.tracing import start_tracing

__all__ = ["NO_SPAN", "OFF", "Span", "SpanKind", "SpanSpec", "TraceParent", "Tracing", "TracingConfig",
           "add_tracing_args", "parse_traceparent", "start_tracing"]
