"""An OTLP/HTTP traces endpoint that keeps nothing, for benchmarks of tracing's cost: ``POST
/v1/traces`` (protobuf, gzip or not) is decoded with the official ``ExportTraceServiceRequest`` only to
count its spans, and answered with an empty ``ExportTraceServiceResponse`` at once. Served on a daemon
thread of the benchmark's process (``ThreadingHTTPServer`` on a free ``127.0.0.1`` port).

    with OTLPSink() as sink:
        ... --otlp-traces-endpoint sink.endpoint ...
        sink.counts()   # {"exports": N, "spans": M, "bytes": B}
"""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)

ANSWER = ExportTraceServiceResponse().SerializeToString()


class OTLPSink:
    def __init__(self) -> None:
        self._counts = {"exports": 0, "spans": 0, "bytes": 0}
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                body = gzip.decompress(raw) if self.headers.get("Content-Encoding") == "gzip" else raw
                request = ExportTraceServiceRequest.FromString(body)
                spans = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                sink._count(len(raw), spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(ANSWER)))
                self.end_headers()
                self.wfile.write(ANSWER)

            def log_message(self, format: str, *args: object) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def _count(self, size: int, spans: int) -> None:
        with self._lock:
            self._counts["exports"] += 1
            self._counts["spans"] += spans
            self._counts["bytes"] += size

    def __enter__(self) -> OTLPSink:
        threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
