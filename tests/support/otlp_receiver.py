"""A real OTLP/HTTP traces endpoint for tests: ``POST /v1/traces`` (``application/x-protobuf``, gzip or
not) on a free ``127.0.0.1`` port, decoded with the official ``ExportTraceServiceRequest`` and answered
with an empty ``ExportTraceServiceResponse``; every span kept as a flat ``SpanRecord``.

    with OTLPReceiver() as receiver:
        tracing = start_tracing(TracingConfig(endpoint=receiver.endpoint, ...))
        ...
        receiver.wait_for(3)                  # at least 3 spans, or AssertionError naming what came
        assert not receiver.orphans()

Served on a daemon thread (``ThreadingHTTPServer``); the helpers may be called from any thread.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as ProtoStatus

TRACES_PATH = "/v1/traces"
STATUS_ERROR = ProtoStatus.STATUS_CODE_ERROR
STATUS_UNSET = ProtoStatus.STATUS_CODE_UNSET


@dataclass(frozen=True)
class SpanRecord:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str | None
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL, ... (SPAN_KIND_ dropped)
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    status_code: int = STATUS_UNSET  # ProtoStatus's STATUS_CODE_UNSET / _OK / _ERROR
    status_message: str = ""
    resource: dict = field(default_factory=dict)  # service.name, service.instance.id, epd.role, ...
    scope: str = ""

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def is_error(self) -> bool:
        return self.status_code == STATUS_ERROR


@dataclass
class Node:
    span: SpanRecord
    children: list[Node] = field(default_factory=list)

    def render(self, depth: int = 0) -> str:
        lines = ["  " * depth + self.span.name]
        lines += [child.render(depth + 1) for child in sorted(self.children, key=lambda n: n.span.start_ns)]
        return "\n".join(lines)


def value_of(value: AnyValue) -> object:
    """An OTLP ``AnyValue`` as a plain Python value (arrays as lists, kvlists as dicts)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [value_of(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    return getattr(value, which)


def attributes_of(pairs: list[KeyValue]) -> dict:
    return {kv.key: value_of(kv.value) for kv in pairs}


def records_of(request: ExportTraceServiceRequest) -> list[SpanRecord]:
    out = []
    for resource_spans in request.resource_spans:
        resource = attributes_of(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(SpanRecord(
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex() or None,
                    name=s.name, kind=ProtoSpan.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano, attributes=attributes_of(s.attributes),
                    status_code=s.status.code, status_message=s.status.message, resource=resource,
                    scope=scope_spans.scope.name))
    return out


class OTLPReceiver:
    """Start with ``with`` (or ``start``/``stop``); ``endpoint`` is the URL to export to."""

    def __init__(self) -> None:
        self._spans: list[SpanRecord] = []
        self._lock = threading.Condition()
        self.requests = 0  # export requests decoded
        self.gzipped = 0  # of which gzip-compressed
        self.bad_requests: list[str] = []  # why each refused request was refused
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "the receiver is not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}{TRACES_PATH}"

    def start(self) -> OTLPReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    if self.path != TRACES_PATH:
                        raise ValueError(f"path {self.path}")
                    zipped = self.headers.get("Content-Encoding") == "gzip"
                    request = ExportTraceServiceRequest.FromString(gzip.decompress(body) if zipped else body)
                except Exception as exc:  # the test sees it in bad_requests
                    receiver._refused(f"{type(exc).__name__}: {exc}")
                    self.send_response(400)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                receiver._add(records_of(request), zipped)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="otlp-receiver",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> OTLPReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _add(self, records: list[SpanRecord], zipped: bool) -> None:
        with self._lock:
            self.requests += 1
            self.gzipped += zipped
            self._spans.extend(records)
            self._lock.notify_all()

    def _refused(self, why: str) -> None:
        with self._lock:
            self.bad_requests.append(why)
            self._lock.notify_all()

    # --- reading what came ------------------------------------------------------------------
    def spans(self, name: str | None = None) -> list[SpanRecord]:
        with self._lock:
            return [s for s in self._spans if name is None or s.name == name]

    def span(self, name: str) -> SpanRecord:
        """The one span named ``name`` (AssertionError if not exactly one)."""
        found = self.spans(name)
        assert len(found) == 1, f"{len(found)} spans named {name!r}; all: {[s.name for s in self.spans()]}"
        return found[0]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(self, until: int | Callable[[list[SpanRecord]], bool], timeout: float = 10.0) -> list[SpanRecord]:
        """Waits until at least ``until`` spans came (an int) or ``until(spans)`` holds, at most ``timeout``
        seconds; the spans, or AssertionError naming what came."""
        check = (lambda spans: len(spans) >= until) if isinstance(until, int) else until
        deadline = time.monotonic() + timeout
        with self._lock:
            while not check(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    want = f"{until} spans" if isinstance(until, int) else "the condition"
                    raise AssertionError(f"waited {timeout} s for {want}; came {len(self._spans)}: "
                                         f"{sorted(s.name for s in self._spans)}; refused: {self.bad_requests}")
                self._lock.wait(left)
            return list(self._spans)

    def traces(self) -> dict[str, list[SpanRecord]]:
        """trace id -> its spans, in the order they came."""
        out: dict[str, list[SpanRecord]] = {}
        for s in self.spans():
            out.setdefault(s.trace_id, []).append(s)
        return out

    def orphans(self, outside: frozenset[str] | set[str] = frozenset()) -> list[SpanRecord]:
        """Spans whose parent is not among their trace's spans (nor one of ``outside``'s span ids: a
        parent that lives elsewhere, e.g. a client's span)."""
        found = []
        for spans in self.traces().values():
            ids = {s.span_id for s in spans}
            found += [s for s in spans if s.parent_span_id is not None and s.parent_span_id not in ids
                      and s.parent_span_id not in outside]
        return found

    def trees(self) -> dict[str, list[Node]]:
        """trace id -> its root nodes (spans with no parent here), children nested under them."""
        out: dict[str, list[Node]] = {}
        for trace_id, spans in self.traces().items():
            nodes = {s.span_id: Node(s) for s in spans}
            roots = []
            for node in nodes.values():
                parent = nodes.get(node.span.parent_span_id or "")
                (parent.children if parent is not None else roots).append(node)
            out[trace_id] = roots
        return out
