"""One kept-alive connection from the router to a stage (``StageConnection``: an asyncio ``Protocol``
with httptools' C parser, llhttp, reading the answers), the answer it reads (``Response``, with its
``AnswerHeaders``), and the sockets ``router.upstream.client`` opens (``probing_sockets``). ``router.upstream.client``
drives them: it sends requests, waits on answers and owns the deadlines and the pool.

TCP_NODELAY is set on every connection (asyncio sets it too), so a small request body or chunk is
never held back by Nagle's algorithm. Reads are bounded: a connection stops reading its socket while
more than ``READ_HIGH_BYTES`` of an answer wait unread (an answer read whole, or handed to a sink as it
arrives, never waits).
"""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import Callable

import httptools  # hot path: llhttp, the C HTTP/1.1 parser (uvicorn's fast path too)

from router.http.write_flow import WriteFlow

# a body over this is written in slices of it, each once the socket took the last (no copy of a 64 MiB body)
SLICE_BYTES = 1 << 20
READ_HIGH_BYTES = 1 << 18  # unread answer bytes above which a connection pauses reading its socket
DISCONNECTED = "ServerDisconnectedError: Server disconnected"
CUT = "the connection closed before the answer was complete"
TIMER = object()  # a waiter's result when its deadline fired


def fire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(TIMER)


class AnswerHeaders:
    """A stage's answer headers, kept as the (name, value) bytes httptools gave; ``get`` (any case)
    decodes them on first use: a request's hot path never reads one."""

    __slots__ = ("raw", "_by_name")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        self._by_name: dict[str, str] | None = None

    def get(self, name: str, default: str | None = None) -> str | None:
        if self._by_name is None:
            self._by_name = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in self.raw}
        return self._by_name.get(name.lower(), default)

    def framed(self) -> bool:
        """Whether the body's end is framed (``Content-Length`` or chunked), not the connection's close."""
        for name, value in self.raw:
            lower = name.lower()
            if lower == b"content-length" or lower == b"transfer-encoding" and b"chunked" in value.lower():
                return True
        return False


class Response:
    """One answer: its status and headers, and its body as the connection receives it."""

    __slots__ = ("connection", "loop", "status", "headers", "pieces", "buffered", "done", "cut", "waiter",
                 "deadline", "pool", "all", "finished", "to_eof", "sink", "last", "notify")

    def __init__(self, connection: StageConnection, status: int, headers: AnswerHeaders) -> None:
        self.connection = connection
        self.loop = connection.loop
        self.status = status
        self.headers = headers
        self.pieces: list[bytes] = []
        self.buffered = 0
        self.done = False  # the whole body is in
        self.cut: str | None = None  # the connection went away before that: why
        self.waiter: asyncio.Future | None = None
        self.deadline = math.inf
        self.pool: list[StageConnection] | None = None
        self.all = False  # read whole (never pause the socket)
        self.finished = False  # released or closed
        self.to_eof = False  # the body runs to the connection's end
        self.sink: Callable[[bytes], None] | None = None  # ``Upstream.follow``: takes each piece as it arrives
        self.last = 0.0  # loop time of the last piece handed to ``sink``
        # called (instead of waking ``waiter``) from the connection's callback at the end or a cut: a call
        # read whole by callbacks (``router.upstream.client``'s ``_WholeCall``), which then needs no turn of the loop
        self.notify: Callable[[], None] | None = None

    def feed(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None:
            self.last = self.loop.time()
            sink(data)
            return
        self.pieces.append(data)
        self.buffered += len(data)
        if not self.all:
            if self.buffered > READ_HIGH_BYTES:
                self.connection.pause()
            self.wake()

    def end(self) -> None:
        self.done = True
        self.wake()

    def lose(self, detail: str) -> None:
        if not self.done:
            self.cut = detail
            self.wake()

    def wake(self) -> None:
        if self.notify is not None:
            self.notify()
            return
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def detach(self) -> None:
        """Called by a ``follow`` sink: take no more pieces (they are buffered again), and let ``follow``
        return."""
        self.sink = None
        self.wake()

    def whole(self) -> None:
        self.all = True
        self.connection.resume()

    async def wait(self, delay: float) -> bool:
        """Until more bytes, the end or a cut; False if ``delay`` passed first."""
        waiter = self.waiter = self.loop.create_future()
        handle = self.loop.call_later(delay, fire, waiter)
        try:
            return await waiter is not TIMER
        finally:
            handle.cancel()
            self.waiter = None

    def take(self) -> bytes:
        pieces = self.pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        self.pieces = []
        self.buffered = 0
        self.connection.resume()
        return data

    def release(self) -> None:
        """Back to the pool if the answer was read whole and the stage keeps the connection; else closed."""
        if self.finished:
            return
        self.finished = True
        connection = self.connection
        if self.done and not self.pieces and connection.keep and not connection.lost and self.pool is not None:
            connection.idle_since = self.loop.time()
            connection.response = None
            pool = self.pool
            if pool and pool[0].lost:  # the oldest were closed by their stage while idle: drop them
                pool[:] = [kept for kept in pool if not kept.lost]
            pool.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        """Close the connection (the stage aborts the request); a no-op once released."""
        if not self.finished:
            self.finished = True
            self.connection.close()


class StageConnection(WriteFlow, asyncio.Protocol):
    """One kept-alive connection to a stage, one request at a time; httptools parses what it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        # who takes the sent request's answer head (``send_to``): called with the Response, or with why the
        # connection went away (str); False: it no longer wants it (the connection is closed)
        self.on_head: Callable[[Response | str], bool] | None = None
        self.response: Response | None = None
        self.names: list[tuple[bytes, bytes]] = []
        self.lost = False
        self.keep = False
        self.paused = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, head: bytes, body: bytes) -> asyncio.Future:
        """Send a request (``head``, then ``body`` unless it is over ``SLICE_BYTES``: ``write_sliced``); a
        future of its answer's Response, or of why the connection went away (str). Whoever sets it
        first wins (a deadline's timer: ``fire``); an answer coming after that closes the connection."""
        future = self.loop.create_future()

        def deliver(answer: Response | str) -> bool:
            if future.done():
                return False
            future.set_result(answer)
            return True

        self.send_to(head, body, deliver)
        return future

    def send_to(self, head: bytes, body: bytes, on_head: Callable[[Response | str], bool]) -> None:
        """``send``, with the answer's head handed to ``on_head`` from the connection's own callback (no
        future, no turn of the event loop in between)."""
        self.on_head = on_head
        self.response = None
        self.keep = False
        assert self.transport is not None
        if len(body) <= SLICE_BYTES:
            self.transport.write(head + body)
        else:
            self.transport.write(head)

    async def write_sliced(self, body: bytes) -> None:
        view = memoryview(body)
        for start in range(0, len(view), SLICE_BYTES):
            if self.lost:
                return
            await self.writable()
            assert self.transport is not None
            self.transport.write(view[start:start + SLICE_BYTES])

    def pause(self) -> None:
        if not self.paused and not self.lost and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.lost and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.gone(f"{type(exc).__name__}: {exc}")
            self.close()

    def eof_received(self) -> bool:
        response = self.response
        if response is not None and response.to_eof and not response.done:  # framed by the close itself
            self.keep = False
            response.end()
        self.gone(DISCONNECTED)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone(DISCONNECTED if exc is None else f"{type(exc).__name__}: {exc}")

    def gone(self, detail: str) -> None:
        self.lost = True
        on_head, self.on_head = self.on_head, None
        if on_head is not None:
            on_head(detail)
        if self.response is not None:
            self.response.lose(CUT)
        self.release_writer()

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.names.append((name, value))

    def on_headers_complete(self) -> None:
        headers = AnswerHeaders(self.names)
        self.names = []
        status = self.parser.get_status_code()
        response = self.response = Response(self, status, headers)
        # neither Content-Length nor chunked: the body ends when the stage closes (llhttp sees no end)
        response.to_eof = status >= 200 and status not in (204, 304) and not headers.framed()
        on_head, self.on_head = self.on_head, None
        if on_head is None or not on_head(response):  # an answer nobody asked for, or after the deadline
            self.close()

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response.feed(body)

    def on_message_complete(self) -> None:
        self.keep = self.parser.should_keep_alive()
        if self.response is not None:
            self.response.end()


def probing_sockets(host_timeout_s: float) -> Callable[[tuple], socket.socket]:
    """aiohttp's ``socket_factory``: TCP sockets that give up on a peer silent at the TCP level for about
    ``host_timeout_s``: keepalive probes from 1 s of idleness, one a second, and the connection dropped
    (ETIMEDOUT) after ``host_timeout_s - 1`` unanswered ones; ``TCP_USER_TIMEOUT`` does the same for
    data sent and never acknowledged. A live peer answers probes from its kernel, so a busy or slow
    stage is never cut by this (a stalled process is: ``--stream-idle-timeout-s``)."""
    probes = max(1, math.ceil(host_timeout_s) - 1)

    def make(addr_info: tuple) -> socket.socket:
        family, kind, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=kind, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere only the OS's own keepalive timing applies
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(host_timeout_s * 1000))
        return sock

    return make
