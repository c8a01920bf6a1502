"""The one way to get a ``Tracing``: ``start_tracing(config)``, called once by a server at its start
(the router's app, a stage's server), which keeps the object, hands it to whoever makes spans and
calls its ``shutdown`` when it stops.

Off (no endpoint) it returns ``telemetry.api.OFF`` and imports nothing of ``opentelemetry``; on, it
imports the SDK here, lazily, and returns a ``telemetry.otel.OtelTracing`` with its own provider.
"""

from __future__ import annotations

from telemetry.api import OFF, Tracing
from telemetry.config import TracingConfig


def start_tracing(config: TracingConfig) -> Tracing:
    """``OFF`` when ``config`` has no endpoint, else tracing that exports there (nothing is sent until a
    span ends; an unreachable collector costs the SDK's batch thread its retries, never a caller)."""
    if not config.enabled:
        return OFF
    from telemetry.otel import OtelTracing

    return OtelTracing(config)
