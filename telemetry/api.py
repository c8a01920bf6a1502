"""What the router and the stages call to trace, and its disabled form (pure, nothing of
``opentelemetry``): ``Tracing`` and ``Span`` here do nothing, and ``OFF`` is the one disabled object.
``telemetry.tracing.start_tracing`` returns ``OFF`` or, with an endpoint, the SDK-backed subclasses
(``telemetry.otel``), so a caller holds one ``Tracing`` and never asks whether tracing is on.

Times are wall-clock seconds (``time.time()``), the numbers the room timelines hold, so a span carries
exactly the times a timeline shows. Every method may be called from any thread, returns quickly
(export happens on the SDK's batch thread) and never raises on its arguments' content: an invalid
``traceparent`` starts a new trace.

Disabled, ``start_span`` passes a valid incoming ``traceparent`` through unchanged (the handle's
``.traceparent`` is the client's, so stages traced elsewhere still join the client's trace) and gives
the shared ``NO_SPAN`` (``.traceparent`` None) without one.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from telemetry.traceparent import SAMPLED, parse_traceparent

Attributes = Mapping[str, object]  # values: str, bool, int, float or a sequence of them (others as str)


class SpanKind(enum.Enum):
    INTERNAL = "internal"
    SERVER = "server"  # the request this process serves (the router's root, a stage's root)
    CLIENT = "client"  # a call this process makes (the router to a stage)


@dataclass(frozen=True)
class SpanSpec:
    """A finished span to ``Tracing.record``: wall-clock ``start`` and ``end``; ``parent``: the index of
    its parent among the specs recorded with it (an earlier one), or None for the stage's root (the
    child of the incoming ``traceparent``). ``error``: the status ERROR with this description."""

    name: str
    start: float
    end: float
    attributes: Attributes = field(default_factory=dict)
    error: str | None = None
    parent: int | None = None


class Span:
    """A live span's handle. ``traceparent``: the header to send downstream so the callee's spans are
    this span's children (None: send none). ``end`` once; ``error`` sets the status ERROR with that
    description and the attribute ``error.type`` (unless ``attributes`` gives one)."""

    __slots__ = ("traceparent",)

    def __init__(self, traceparent: str | None = None) -> None:
        self.traceparent = traceparent

    @property
    def sampled(self) -> bool:
        """Whether the trace is kept: its ``traceparent``'s sampled flag (False without one). The
        header's flags are its characters 53-54 in every version (``traceparent``)."""
        header = self.traceparent
        return header is not None and bool(int(header[53:55], 16) & SAMPLED)

    def child(self, name: str, start: float, attributes: Attributes | None = None,
              kind: SpanKind = SpanKind.INTERNAL) -> Span:
        return self

    def end(self, end: float, error: str | None = None, attributes: Attributes | None = None) -> None:
        return None


NO_SPAN = Span()


class Tracing:
    """Disabled tracing: every method does nothing. ``enabled`` tells the two apart for logs only."""

    enabled = False

    def start_span(self, name: str, parent_traceparent: str | None, start: float,
                   attributes: Attributes | None = None, kind: SpanKind = SpanKind.SERVER) -> Span:
        """A span begun at wall-clock ``start``, the child of ``parent_traceparent`` (a new trace's root
        when None or invalid)."""
        if parent_traceparent is None or parse_traceparent(parent_traceparent) is None:
            return NO_SPAN
        return Span(parent_traceparent)

    def record(self, parent_traceparent: str | None, specs: Sequence[SpanSpec]) -> int:
        """Emits finished spans built after the fact (``telemetry.timeline_spans``): a spec whose
        ``parent`` is None is a child of ``parent_traceparent`` (a new trace's root without one), the
        others their parent spec's children. Nothing when the parent is not sampled. Returns how many
        spans were recorded."""
        return 0

    def record_timeline(self, parent_traceparent: str | None, role: str, events: Sequence[Mapping],
                        room: int | None = None) -> int:
        """``record`` of a room timeline's spans (``timeline_spans.spans_of``): what a stage calls when
        a room ends."""
        return 0

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Exports what is queued, waiting at most ``timeout_s``; True when all went."""
        return True

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Flushes and stops, waiting at most ``timeout_s`` (never hangs); later spans are dropped.
        True when everything queued was exported in time."""
        return True


OFF = Tracing()
