"""One client's connection: an asyncio ``Protocol`` that feeds every byte to httptools'
``HttpRequestParser`` and answers its requests in order, one handler task at a time.

Who does what: the server's listening socket makes one ``Connection`` per accepted socket; the
connection makes each ``Request``, resolves its route, runs its handler in a task, sends the answer
the handler returns (or the one it sent itself: ``router.http.response``), and closes the socket:
when the client asked (``Connection: close``, HTTP/1.0), after an answer to a body the client was
told not to send (``Expect: 100-continue`` unanswered), after a request it cannot read (400, 431),
after a request asking for another protocol (``Upgrade``: answered over HTTP/1.1 first), after
``KEEPALIVE_S`` idle, on ``shut`` (shutdown) once the current answer is out, or at once when
the client leaves, which cancels the running handler (how an abandoned request is aborted in the
stages). A handler never closes the connection.

Keep-alive: HTTP/1.1's default. Pipelining: requests that arrive while one is answered wait their
turn (reading pauses while ``PIPELINE_MAX`` wait or a waiting one's body passes ``PIPELINE_HIGH_BYTES``).
A body the answer did not need (a 413, a 404 with a body) is read and dropped for up to
``LINGER_S``, so the connection stays usable. Limits: the request line and headers ``MAX_HEAD_BYTES``
(about: counted as received; 431); a body ``max_body`` (kept no further; 413 on read, and
at once for ``Expect: 100-continue`` with a larger Content-Length). Errors: a handler's
``RouterError`` is its own answer; any other exception a logged 500 ``internal_error`` (or the
connection closed, if the answer had started). TCP_NODELAY is set on every connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from urllib.parse import unquote

import httptools  # llhttp, the C HTTP/1.1 parser (uvicorn's fast path too)

from contract.errors import Code
from router.errors import RouterError, bad_request, body_too_large
from router.http.request import Headers, Request
from router.http.response import Response, StreamResponse, error_response, head
from router.http.routes import Handler, Routes
from router.http.write_flow import WriteFlow

log = logging.getLogger(__name__)
KEEPALIVE_S = 75.0  # an idle kept-alive connection is closed after this (aiohttp's default)
LINGER_S = 10.0  # after an answer, the rest of its request's body is read and dropped for at most this long
MAX_HEAD_BYTES = 64 << 10
PIPELINE_MAX = 8
PIPELINE_HIGH_BYTES = 1 << 20
_LAST_CHUNK = b"0\r\n\r\n"


class Connection(WriteFlow, asyncio.Protocol):
    """Made by the listening server for each accepted socket: ``routes`` answer its requests, bodies
    are kept up to ``max_body`` bytes, and it is in ``connections`` (the server's) while open."""

    def __init__(self, routes: Routes, max_body: int, connections: set[Connection]) -> None:
        super().__init__()
        self.routes = routes
        self.max_body = max_body
        self.connections = connections
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.names: list[tuple[bytes, bytes]] = []
        self.in_head = False  # between a message's first byte and the end of its headers
        self.head_bytes = 0
        self.parsing: Request | None = None  # the request httptools is reading the body of
        self.newest: Request | None = None  # the last request whose headers were read
        self.waiting: deque[Request | Response] = deque()  # a Response: a refusal to send, then close
        self.current: Request | None = None  # the request being answered (or its body dropped)
        self.task: asyncio.Task | None = None  # its handler
        self.head_sent = False  # of the current request's answer
        self.answered = False  # the current request's answer is all written
        self.keep = True  # the connection outlives the current answer
        self.chunked = True  # the current stream's framing (HTTP/1.0: none, closed at its end)
        self.lost = False
        self.closing = False  # no request after the current one
        self.broken = False  # unreadable input: nothing more is parsed
        self.read_paused = False
        self.deadline: float | None = None  # the idle or linger deadline (loop time)
        self.timer: asyncio.TimerHandle | None = None  # fires at timer_at, at or before the deadline
        self.timer_at = 0.0

    # --- asyncio's callbacks ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections.add(self)
        self._arm(KEEPALIVE_S)

    def data_received(self, data: bytes) -> None:
        if self.broken:
            return
        if self.in_head or self.parsing is None:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._last()
        except httptools.HttpParserError as exc:
            self._refuse(bad_request(f"Invalid HTTP request: {exc}", None, "invalid_request"))
        else:
            if self.in_head and self.head_bytes > MAX_HEAD_BYTES:
                self._refuse(RouterError(431, f"The request line and headers exceed {MAX_HEAD_BYTES} bytes.",
                                         code="request_header_fields_too_large"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.connections.discard(self)
        self._stop_timer()
        if self.task is not None:
            self.task.cancel()  # the client left: its handler is cancelled, which aborts the request upstream
        self.release_writer()

    # --- httptools' callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.in_head = True

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.names.append((name, value))

    def on_headers_complete(self) -> None:
        headers = Headers(self.names)
        path, query = _target(self.url)
        parser = self.parser
        request = Request(self, parser.get_method().decode("ascii"), path, query, headers, parser.get_http_version(),
                          parser.should_keep_alive(), self.max_body)
        self.url, self.names, self.in_head, self.head_bytes = b"", [], False, 0
        self.parsing = self.newest = request
        if request.expect_continue and (request.content_length or 0) > request.max_body:
            request.discard()  # never told to go on: refused at once, and the connection closed
            self._queue(error_response(body_too_large(request.content_length or 0, request.max_body)))
        else:
            self._queue(request)

    def on_body(self, body: bytes) -> None:
        request = self.parsing
        if request is not None:
            request.feed(body)
            if request is not self.current and request.received > PIPELINE_HIGH_BYTES:
                self._pause_reading()

    def on_message_complete(self) -> None:
        request, self.parsing = self.parsing, None
        if request is not None:
            request.end()
            if request is self.current:
                self._advance()

    # --- answering, in order ---------------------------------------------------------------------
    def _queue(self, item: Request | Response) -> None:
        self.waiting.append(item)
        if self.current is None:
            self._next()
        elif len(self.waiting) >= PIPELINE_MAX:
            self._pause_reading()

    def _next(self) -> None:
        """Start the next waiting request, if the connection is free; else wait idle."""
        while self.current is None and self.waiting and not self.closing and not self.lost:
            item = self.waiting.popleft()
            if isinstance(item, Response):
                self.closing = True
                self._write(item.encode(keep_alive=False, with_body=True))
                self.close()
                return
            self._start(item)
        if self.current is None and self.closing:
            self.close()
            return
        if self.read_paused and not self.broken and len(self.waiting) < PIPELINE_MAX:
            self.read_paused = False  # a waiting body over PIPELINE_HIGH_BYTES pauses it again (on_body)
            if self.transport is not None:
                self.transport.resume_reading()
        if self.current is None:
            self._arm(KEEPALIVE_S)

    def _start(self, request: Request) -> None:
        self._disarm()
        self.current, self.head_sent, self.answered, self.keep = request, False, False, True
        try:
            handler, request.match_info = self.routes.resolve(request.method, request.path)
        except RouterError as exc:
            self._send(request, error_response(exc))
            self._advance()
            return
        self.task = self.loop.create_task(self._run(handler, request))

    async def _run(self, handler: Handler, request: Request) -> None:
        try:
            response = await handler(request)
        except RouterError as exc:
            response = error_response(exc)
        except (asyncio.CancelledError, ConnectionResetError):
            self.task = None
            self.close()  # the client left, or shutdown's grace ran out
            return
        except Exception as exc:
            log.exception("unhandled error on %s %s", request.method, request.path)
            response = error_response(RouterError(500, f"Internal router error: {type(exc).__name__}",
                                                  code=Code.INTERNAL_ERROR))
        self.task = None
        if self.lost:
            return
        if not response.sent and self.head_sent:  # an error after the answer started: only closing tells
            self.close()
            return
        if isinstance(response, Response):
            if not response.sent:
                self._send(request, response)
        else:
            if not response.sent:
                self._stream_head(request, response)
            if not response.ended:
                response.ended = True
                self._stream_end()
        self._advance()

    def _advance(self) -> None:
        """Once the handler has ended and its answer is out: close, drop the rest of the body (up to
        ``LINGER_S``), or go on to the next request."""
        request = self.current
        if self.task is not None or not self.answered or request is None:
            return
        if not self.keep:
            self.close()
        elif not request.complete:
            request.discard()
            if self.deadline is None:
                self._arm(LINGER_S)
        else:
            self.current = None
            self._next()

    # --- writing (called by the responses) -------------------------------------------------------
    async def respond(self, request: Request, response: Response) -> None:
        self._send(request, response)
        await self._drain()

    async def start_stream(self, request: Request, response: StreamResponse, first: bytes = b"") -> None:
        self._stream_head(request, response, first)
        await self._drain()

    async def send_chunk(self, request: Request, data: bytes) -> None:
        self.push_chunk(data)
        await self._drain()

    def push_chunk(self, data: bytes) -> bool:
        """One chunk of the stream now; False while the client's socket is full (``drain`` first)."""
        if self.lost:
            raise ConnectionResetError("the client closed the connection")
        self._write(self._chunk(data))
        return not self.write_paused

    async def drain(self) -> None:
        await self._drain()

    async def end_stream(self, request: Request, last: bytes = b"") -> None:
        self._stream_end(last)
        await self._drain()

    def write(self, data: bytes) -> None:
        """Raw bytes to the client (``100 Continue``)."""
        self._write(data)

    def _send(self, request: Request, response: Response) -> None:
        self.keep = self._keeps(request)
        self.head_sent = response.sent = True
        self._write(response.encode(self.keep, request.method != "HEAD"))
        self.answered = True

    def _stream_head(self, request: Request, response: StreamResponse, first: bytes = b"") -> None:
        """The head, and ``first`` as the first chunk in the same write."""
        self.chunked = request.version != "1.0"
        self.keep = self._keeps(request) and self.chunked
        self.head_sent = True
        response.request = request
        self._write(head(response.status, response.headers, self.keep,
                         "Transfer-Encoding: chunked\r\n" if self.chunked else "") + self._chunk(first))

    def _stream_end(self, last: bytes = b"") -> None:
        """``last`` as the last chunk and the terminating one, in one write."""
        end = self._chunk(last) + (_LAST_CHUNK if self.chunked else b"")
        if end:
            self._write(end)
        self.answered = True

    def _chunk(self, data: bytes) -> bytes:
        """``data`` framed as one chunk (unframed for an HTTP/1.0 client; nothing for no data)."""
        return b"%x\r\n%b\r\n" % (len(data), data) if self.chunked and data else data

    def _keeps(self, request: Request) -> bool:
        return request.keep_alive and not self.closing and (request.complete or request.continued)

    def _write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not self.lost and not transport.is_closing():
            transport.write(data)

    async def _drain(self) -> None:
        if not self.lost:
            await self.writable()
        if self.lost:
            raise ConnectionResetError("the client closed the connection")

    # --- closing ---------------------------------------------------------------------------------
    def shut(self) -> None:
        """Shutdown: no request after the current one; an idle connection is closed now."""
        self.closing = True
        if self.task is None and (self.current is None or self.answered):
            self.close()

    def _last(self) -> None:
        """The newest request asked for another protocol (``Upgrade``, e.g. h2c): it is answered over
        HTTP/1.1, and the connection closed after it; what follows it is not read."""
        self.broken = True
        self._pause_reading()
        if self.newest is not None:
            self.newest.keep_alive = False
        if self.current is None and not self.waiting:
            self.close()

    def _refuse(self, error: RouterError) -> None:
        """Unreadable input: answer ``error`` after the requests before it, then close."""
        self.broken = True
        self._pause_reading()
        request, self.parsing = self.parsing, None
        if request is not None and request is self.current:
            self.close()  # its body is broken under its handler: the handler is cancelled
            return
        if request is not None and request in self.waiting:
            self.waiting.remove(request)  # waiting for its turn with a body that will never end
        self._queue(error_response(error))

    def close(self) -> None:
        """Close the socket now (what was written is sent first); a running handler is cancelled."""
        self._stop_timer()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()  # what was written is sent first

    def _pause_reading(self) -> None:
        if not self.read_paused and not self.lost and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    def _arm(self, delay: float) -> None:
        """Close the connection ``delay`` s from now unless disarmed first. One timer serves many arms
        (a request each): it is moved only to an earlier deadline, and re-set when it fires early."""
        deadline = self.deadline = self.loop.time() + delay
        if self.timer is None or self.timer_at > deadline:
            if self.timer is not None:
                self.timer.cancel()
            self.timer, self.timer_at = self.loop.call_at(deadline, self._expire), deadline

    def _disarm(self) -> None:
        self.deadline = None  # the timer, if set, fires for nothing

    def _stop_timer(self) -> None:
        self.deadline = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self) -> None:
        self.timer = None
        if self.deadline is None:
            return
        if self.loop.time() < self.deadline:
            self.timer, self.timer_at = self.loop.call_at(self.deadline, self._expire), self.deadline
            return
        self.close()


def _target(url: bytes) -> tuple[str, str]:
    """The request target's path (percent-decoded) and query string; an absolute URL's through
    httptools' URL parser."""
    if url[:1] != b"/":
        parts = httptools.parse_url(url)
        url = (parts.path or b"/") + (b"?" + parts.query if parts.query else b"")
    raw_path, _, query = url.partition(b"?")
    path = raw_path.decode("latin-1")
    return (unquote(path) if "%" in path else path), query.decode("latin-1")
