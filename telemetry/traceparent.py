"""W3C Trace Context's ``traceparent`` header, read without ``opentelemetry`` (pure): the router reads
a client's, a stage the router's, and tracing off passes a valid one through unchanged.

``version-traceid-parentid-flags``: lowercase hex, 2-32-16-2 digits; version ``ff`` is invalid; an
all-zero trace id or parent id is invalid; a future version (not ``00``) may append ``-...`` fields,
which are ignored. Anything else is None: the caller starts a new trace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HEADER = "traceparent"
_FORMAT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
SAMPLED = 0x01


@dataclass(frozen=True, slots=True)
class TraceParent:
    trace_id: int
    span_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    @property
    def header(self) -> str:
        """The version-00 header of this parent."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{self.flags:02x}"


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The parent a ``traceparent`` header names, or None (absent or invalid: start a new trace)."""
    if not value:
        return None
    found = _FORMAT.fullmatch(value.strip())
    if found is None:
        return None
    version, trace, span, flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    trace_id, span_id = int(trace, 16), int(span, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16))
