"""One HTTP request as the router's handlers see it.

The connection (``router.http.connection``) makes a ``Request`` when httptools has parsed the request
line and headers, feeds it the body as it arrives (``feed``; chunked bodies come decoded) and marks
it ``complete`` at the message's end; the handler reads the body (``read``) while it arrives. The
connection keeps at most ``max_body`` bytes of a body (the server's cap, ``--max-body-mb``); the rest
is counted and dropped, and ``read`` refuses it with the 413 of ``router.errors``. Once the handler's
answer is out, the connection drops whatever of the body is still to come (``discard``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import parse_qsl

from router.errors import RouterError, body_too_large

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Wire(Protocol):
    """What a request and its responses use of their connection (``router.http.connection.Connection``;
    the responses' types are ``router.http.response``'s)."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport | None

    def write(self, data: bytes) -> None: ...

    async def respond(self, request: Request, response: Any) -> None: ...

    async def start_stream(self, request: Request, response: Any, first: bytes = b"") -> None: ...

    async def send_chunk(self, request: Request, data: bytes) -> None: ...

    def push_chunk(self, data: bytes) -> bool: ...

    async def drain(self) -> None: ...

    async def end_stream(self, request: Request, last: bytes = b"") -> None: ...


class Headers:
    """Request headers, kept as the (name, value) bytes httptools gave until one is read: ``get`` (any
    case) decodes them all on first use, by lower-case name (repeated ones joined with ", "). A
    request's hot path reads none (``Request`` takes its two from the bytes)."""

    __slots__ = ("raw", "_by_name")

    def __init__(self, raw: list[tuple[bytes, bytes]] | None = None) -> None:
        self.raw = raw or []
        self._by_name: dict[str, str] | None = None

    def get(self, name: str, default: str | None = None) -> str | None:
        by_name = self._by_name
        if by_name is None:
            by_name = self._by_name = {}
            for raw_name, raw_value in self.raw:
                key, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
                by_name[key] = f"{by_name[key]}, {value}" if key in by_name else value
        return by_name.get(name.lower(), default)

    def first(self, name: bytes) -> str | None:
        """The first value of header ``name`` (lower-case bytes), found without decoding the others:
        for a header read on every request (a traced router's ``traceparent``)."""
        for raw_name, raw_value in self.raw:
            if len(raw_name) == len(name) and raw_name.lower() == name:
                return raw_value.decode("latin-1")
        return None


class Request:
    """Made by the connection, read by one handler; the handler never closes anything (the connection
    does, once the answer is out or the client left)."""

    __slots__ = ("connection", "method", "path", "raw_query", "headers", "version", "keep_alive", "content_length",
                 "match_info", "max_body", "complete", "expect_continue", "_query", "_pieces", "received",
                 "_waiter", "_discard")

    def __init__(self, connection: Wire, method: str, path: str, raw_query: str, headers: Headers,
                 version: str, keep_alive: bool, max_body: int) -> None:
        self.connection = connection
        self.method = method
        self.path = path  # percent-decoded
        self.raw_query = raw_query
        self.headers = headers
        self.version = version  # "1.1" or "1.0"
        self.keep_alive = keep_alive  # what the client asked for (HTTP/1.1 default, Connection: close, 1.0)
        length, expect = None, b""
        for name, value in headers.raw:  # the two headers read here, without decoding the rest
            if len(name) == 14 and name.lower() == b"content-length":
                length = value  # llhttp checked its digits, and refuses a second Content-Length
            elif len(name) == 6 and name.lower() == b"expect":
                expect = value
        self.content_length = int(length) if length is not None else None
        self.match_info: dict[str, str] = {}  # the route's path params, set before the handler runs
        self.max_body = max_body
        self.complete = False  # the whole body is in
        self.expect_continue = expect.lower() == b"100-continue"  # answered on first read
        self._query: dict[str, str] | None = None
        self._pieces: list[bytes] = []
        self.received = 0
        self._waiter: asyncio.Future | None = None
        self._discard = False

    @property
    def query(self) -> dict[str, str]:
        """The query string's parameters, the first value of each (parsed on first use)."""
        if self._query is None:
            self._query = {}
            for name, value in parse_qsl(self.raw_query, keep_blank_values=True):
                self._query.setdefault(name, value)
        return self._query

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.connection.transport

    async def read(self, max_bytes: int | None = None,
                   refuse: Callable[[int | str, int], RouterError] = body_too_large) -> bytes:
        """The whole body, or ``refuse``'s 413 as soon as more than ``max_bytes`` (default and at most:
        ``max_body``) have arrived. The first read answers ``Expect: 100-continue``."""
        cap = self.max_body if max_bytes is None else min(max_bytes, self.max_body)
        if self.expect_continue:
            self.expect_continue = False
            self.connection.write(CONTINUE)
        while True:
            if self.received > cap:
                raise refuse(f"more than {cap}", cap)
            if self.complete:
                break
            self._waiter = self.connection.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pieces = self._pieces
        self._pieces = []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    @property
    def continued(self) -> bool:
        """Whether the client may be sending its body (it sent no ``Expect``, or was told to go on)."""
        return not self.expect_continue

    # --- the connection's side -------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        self.received += len(data)
        if self.received <= self.max_body and not self._discard:
            self._pieces.append(data)
        self._wake()

    def end(self) -> None:
        self.complete = True
        self._wake()

    def discard(self) -> None:
        """Drop the body read so far and any still to come (its answer is out)."""
        self._discard = True
        self._pieces = []

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
