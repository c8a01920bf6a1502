"""The answers a handler gives: a whole ``Response`` (status, headers, body, one write) or a
``StreamResponse`` (status and headers, then the body chunk by chunk with ``Transfer-Encoding:
chunked``). Only responses are formatted here; requests are parsed by httptools.

A handler returns either; the connection sends a ``Response`` it returns that was not sent yet, and
ends a ``StreamResponse`` it returns that was not ended. A handler may send a ``Response`` itself
(``prepare``: at once, to time what follows), and sends a ``StreamResponse``'s head with ``prepare``,
its chunks with ``write`` (each one chunk on the wire; it waits while the client's socket is full), or
from a callback with ``push`` (then ``drain`` when it says the socket is full), and its end with
``write_eof``. Writing to a client that left raises ``ConnectionResetError``.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING

import msgspec

from router.errors import RouterError

if TYPE_CHECKING:
    from router.http.request import Request

JSON_TYPE = "application/json; charset=utf-8"  # aiohttp's json_response type, kept
_REASONS = {status.value: status.phrase for status in HTTPStatus}
_encode = msgspec.json.Encoder()
_date = [0, ""]  # the second and its Date header line, made once a second


def _date_line() -> str:
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, f"Date: {formatdate(now, usegmt=True)}\r\n"
    return _date[1]  # type: ignore[return-value]


def head(status: int, headers: dict[str, str], keep_alive: bool, framing: str) -> bytes:
    """The status line and header block, up to and with the blank line; ``framing``: the
    Content-Length or Transfer-Encoding line (or nothing)."""
    lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    close = "" if keep_alive else "Connection: close\r\n"
    return (f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n{lines}{framing}{_date_line()}{close}\r\n"
            .encode("latin-1"))


class Response:
    """A whole answer; ``sent`` once on the wire."""

    __slots__ = ("status", "body", "headers", "sent")

    def __init__(self, body: bytes = b"", status: int = 200, content_type: str | None = "application/json",
                 headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = {"Content-Type": content_type, **(headers or {})} if content_type else dict(headers or {})
        self.sent = False

    def encode(self, keep_alive: bool, with_body: bool) -> bytes:
        """The whole answer as bytes (``with_body`` False: a HEAD's, with the body's Content-Length)."""
        data = head(self.status, self.headers, keep_alive, f"Content-Length: {len(self.body)}\r\n")
        return data + self.body if with_body else data

    async def prepare(self, request: Request) -> None:
        """Send it now (the handler then returns it)."""
        await request.connection.respond(request, self)


class StreamResponse:
    """A chunked answer: ``prepare``, ``write`` any number of times, ``write_eof``."""

    __slots__ = ("status", "headers", "request", "ended")

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers = dict(headers or {})
        self.request: Request | None = None  # set by prepare: the head is sent
        self.ended = False

    @property
    def sent(self) -> bool:
        return self.request is not None

    async def prepare(self, request: Request, first: bytes = b"") -> None:
        """Send the status line and headers (``Transfer-Encoding: chunked``; an HTTP/1.0 client gets the
        body unframed and the connection closed at its end), and ``first`` as the first chunk, in one
        write."""
        self.request = request
        await request.connection.start_stream(request, self, first)

    async def write(self, data: bytes) -> None:
        """Send ``data`` as one chunk; returns once the socket took it or has room for more."""
        if data:
            assert self.request is not None, "StreamResponse.write before prepare"
            await self.request.connection.send_chunk(self.request, data)

    def push(self, data: bytes) -> bool:
        """Send ``data`` as one chunk now, from a callback (``router.dispatch.relay``): False once the client's
        socket is full (then ``drain`` before more). Raises ConnectionResetError if the client left."""
        assert self.request is not None, "StreamResponse.push before prepare"
        return self.request.connection.push_chunk(data)

    async def drain(self) -> None:
        """Until the client's socket has room again. Raises ConnectionResetError if the client left."""
        assert self.request is not None, "StreamResponse.drain before prepare"
        await self.request.connection.drain()

    async def write_eof(self, last: bytes = b"") -> None:
        """End the body: ``last`` as the last chunk, and the terminating one, in one write; the connection
        then reads the next request."""
        if not self.ended:
            self.ended = True
            assert self.request is not None, "StreamResponse.write_eof before prepare"
            await self.request.connection.end_stream(self.request, last)


def json_response(data: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encode.encode(data), status, JSON_TYPE, headers)


def error_response(exc: RouterError) -> Response:
    """A ``RouterError`` as its OpenAI error body, status and headers."""
    return json_response(exc.body(), exc.status, exc.headers)
