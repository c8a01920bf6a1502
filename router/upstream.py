"""The router's HTTP client to its stages: one aiohttp session, a keep-alive pool without a
connection cap (the router's admission gate bounds the requests), and a deadline on every call.

TCP_NODELAY: aiohttp sets it on every connection it opens (``BaseProtocol.connection_made``), so a
small request body or chunk is never held back by Nagle's algorithm; ``tests/test_router_http.py``
checks it on a live connection.

Every failure to reach a stage, or a connection lost or a deadline passed while reading its
answer, becomes a ``StageError`` carrying a ``Failure`` that names the stage.

Deadlines (docs/router.md "Deadlines"): ``--connect-timeout-s`` to open a connection;
``--upstream-timeout-s`` for a whole call; ``--stream-idle-timeout-s`` between two reads of an open
stream (the stages send ``: keep-alive`` comments while they have nothing to say, so only a stalled
or vanished stage trips it); ``--upstream-host-timeout-s``: TCP keepalive probes and
``TCP_USER_TIMEOUT`` on every connection, so a host that vanished (no RST: its link is down) fails
any call on it, JSON or stream, after about that long.
"""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import AsyncIterator, Callable

import aiohttp
from yarl import URL

from router.config import RouterConfig
from router.verdict import Failure, idle, timed_out, unreachable
from router.workers import Worker

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"  # OpenAI's legacy completions: text prompts, routed as chat is
JSON_HEADERS = {"Content-Type": "application/json"}
# a body over this is written in slices of it: for one piece, aiohttp copies the headers and the whole
# body into one bytes object (Python < 3.12.9 avoids writelines), a copy per stage of a 64 MiB body
SLICE_BYTES = 1 << 20
# idle connections are dropped before the stages' own keep-alive ends (uvicorn: 5 s), so a request is
# never sent on a connection the stage is closing at that moment
KEEPALIVE_S = 4.0


class StageError(Exception):
    """One stage failed; ``failure`` says which and how."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class Upstream:
    """Create in the router's event loop (``start``), ``close`` on shutdown."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        # (worker URL, path) -> its URL, parsed once (a worker's URL never changes; a removed one's entry is a few bytes)
        self._urls: dict[tuple[str, str], URL] = {}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S,
                                         socket_factory=probing_sockets(self.config.upstream_host_timeout_s))
        timeout = aiohttp.ClientTimeout(total=self.config.upstream_timeout_s, connect=self.config.connect_timeout_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not called")
        return self._session

    async def post(self, stage: str, worker: Worker, body: bytes, path: str = CHAT_PATH) -> aiohttp.ClientResponse:
        """Send ``body``; the response with its status and headers read (the caller reads the body and
        closes or releases it). Raises StageError if the stage cannot be reached in time."""
        url = self._urls.get((worker.url, path))
        if url is None:
            url = self._urls[(worker.url, path)] = URL(worker.url + path)
        try:
            if len(body) <= SLICE_BYTES:  # aiohttp sets Content-Length from the bytes
                return await self.session.post(url, data=body, headers=JSON_HEADERS)
            return await self.session.post(url, data=_sliced(body),
                                           headers={**JSON_HEADERS, "Content-Length": str(len(body))})
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self.error(stage, worker, exc) from None

    async def read(self, stage: str, worker: Worker, response: aiohttp.ClientResponse) -> bytes:
        """The whole body of ``response``, then released to the pool. Raises StageError on a lost
        connection or deadline; on any error or cancellation the connection is closed (which aborts
        the request at the stage)."""
        try:
            data = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            response.close()
            raise self.error(stage, worker, exc) from None
        except BaseException:
            response.close()
            raise
        response.release()
        return data

    async def chunks(self, stage: str, worker: Worker, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The body of ``response`` as it arrives, each piece as soon as the socket gives it. Raises
        StageError on a lost connection or deadline, and ``upstream_idle_timeout`` when no byte came
        for ``--stream-idle-timeout-s`` (the caller closes the response)."""
        iterator = response.content.iter_any()
        idle_s = self.config.stream_idle_timeout_s
        while True:
            try:
                async with asyncio.timeout(idle_s) as deadline:
                    data = await anext(iterator)
            except StopAsyncIteration:
                return
            except (aiohttp.ClientError, TimeoutError) as exc:
                if deadline.expired():
                    raise StageError(idle(stage, worker.url, idle_s)) from None
                raise self.error(stage, worker, exc) from None
            yield data

    def error(self, stage: str, worker: Worker, exc: BaseException) -> StageError:
        if isinstance(exc, TimeoutError):  # aiohttp's timeouts are TimeoutErrors too
            if isinstance(exc, aiohttp.ConnectionTimeoutError):
                return StageError(timed_out(stage, worker.url, self.config.connect_timeout_s, "--connect-timeout-s"))
            return StageError(timed_out(stage, worker.url, self.config.upstream_timeout_s, "--upstream-timeout-s"))
        if isinstance(exc, aiohttp.ClientPayloadError):
            return StageError(unreachable(stage, worker.url, "the connection closed before the answer was complete"))
        return StageError(unreachable(stage, worker.url, f"{type(exc).__name__}: {exc}".rstrip(": ")))


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


async def _sliced(body: bytes) -> AsyncIterator[memoryview]:
    """``body`` in ``SLICE_BYTES`` views, none of them a copy."""
    view = memoryview(body)
    for start in range(0, len(view), SLICE_BYTES):
        yield view[start:start + SLICE_BYTES]
