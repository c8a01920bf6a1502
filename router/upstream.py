"""The router's HTTP client to its stages: one aiohttp session, a keep-alive pool without a
connection cap (the router's admission gate bounds the requests), and a deadline on every call.

TCP_NODELAY: aiohttp sets it on every connection it opens (``BaseProtocol.connection_made``), so a
small request body or chunk is never held back by Nagle's algorithm; ``tests/test_router_http.py``
checks it on a live connection.

Every failure to reach a stage, or a connection lost or a deadline passed while reading its
answer, becomes a ``StageError`` carrying a ``Failure`` that names the stage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp

from router.config import RouterConfig
from router.verdict import Failure, timed_out, unreachable
from router.workers import Worker

CHAT_PATH = "/v1/chat/completions"
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

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
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
        try:
            return await self.session.post(worker.url + path, data=_sliced(body) if len(body) > SLICE_BYTES else body,
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
        StageError on a lost connection or deadline."""
        iterator = response.content.iter_any()
        while True:
            try:
                data = await anext(iterator)
            except StopAsyncIteration:
                return
            except (aiohttp.ClientError, TimeoutError) as exc:
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


async def _sliced(body: bytes) -> AsyncIterator[memoryview]:
    """``body`` in ``SLICE_BYTES`` views, none of them a copy."""
    view = memoryview(body)
    for start in range(0, len(view), SLICE_BYTES):
        yield view[start:start + SLICE_BYTES]
