"""The router's HTTP client to its stages.

The hot path (``fetch``, ``post``, ``read``, ``chunks``, ``follow``: every request's calls to its
stages) runs over ``router.upstream.connection``'s connections (an asyncio ``Protocol`` over a plain socket,
httptools' C parser, llhttp, reading the answers), kept alive in a pool per worker without a cap (the
router's admission gate bounds the requests). The router frames its own requests (one ``POST`` with
``Content-Length``: writing bytes, no parsing); every byte it reads is parsed by httptools.
docs/router.md "The upstream client" says why not aiohttp's client there. The cold paths
(discovery, health checks, the admin API, room aborts) keep an aiohttp session (``session``).

TCP_NODELAY is set on every connection, so a small request body or chunk is never held back by
Nagle's algorithm; ``tests/e2e/test_colocated_router.py`` checks it on a live connection.

Every failure to reach a stage, or a connection lost or a deadline passed while reading its
answer, becomes a ``StageError`` carrying a ``Failure`` that names the stage.

Deadlines (docs/router.md "Deadlines"): ``--connect-timeout-s`` to open a connection;
``--upstream-timeout-s`` for a whole call; ``--stream-idle-timeout-s`` between two reads of an open
stream (the stages send ``: keep-alive`` comments while they have nothing to say, so only a stalled
or vanished stage trips it); ``--upstream-host-timeout-s``: TCP keepalive probes and
``TCP_USER_TIMEOUT`` on every connection, so a host that vanished (no RST: its link is down) fails
any call on it, JSON or stream, after about that long.

Reads are bounded (``router.upstream.connection.READ_HIGH_BYTES``), a cancelled or abandoned call closes its
connection (which aborts the request at the stage), and only a connection whose answer was read whole
goes back to the pool.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import aiohttp

from router.config import RouterConfig
from router.upstream.connection import CUT, SLICE_BYTES, TIMER, AnswerHeaders, Response, StageConnection, fire, probing_sockets
from router.dispatch.verdict import Failure, idle, timed_out, unreachable
from router.fleet.workers import Worker

if TYPE_CHECKING:
    from router.plan.modes import Target

JSON_HEADERS = {"Content-Type": "application/json"}
# idle connections are dropped before the stages' own keep-alive ends (uvicorn: 5 s), so a request is
# never sent on a connection the stage is closing at that moment
KEEPALIVE_S = 4.0
T = TypeVar("T")


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
        self._sockets = probing_sockets(config.upstream_host_timeout_s)
        # (worker URL, path) -> (host, port) and the request line with its fixed headers, made once (a
        # worker's URL never changes; a removed one's entry is a few bytes)
        self._targets: dict[tuple[str, str, bytes], tuple[tuple[str, int], bytes]] = {}
        self._idle: dict[tuple[str, int], list[StageConnection]] = {}  # per worker: kept-alive connections, newest last
        # the event loop, known from ``start`` (asyncio.get_running_loop() costs a getpid() syscall on 3.11)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S, socket_factory=self._sockets)
        timeout = aiohttp.ClientTimeout(total=self.config.upstream_timeout_s, connect=self.config.connect_timeout_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)

    async def close(self) -> None:
        for pool in self._idle.values():
            for connection in pool:
                connection.close()
        self._idle.clear()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The aiohttp session of the cold paths (discovery, health, admin, aborts)."""
        if self._session is None:
            raise RuntimeError("Upstream.start() was not called")
        return self._session

    async def post(self, target: Target) -> Response:
        """Send ``target`` its body (and its extra ``headers``); the response with its status and headers
        read (the caller reads the body and closes or releases it). Raises StageError if the stage
        cannot be reached in time."""
        return await self.request(target.stage, target.worker, b"POST", target.path, target.body, target.headers)

    def fetch(self, target: Target, then: Callable[[int, AnswerHeaders, bytes], T],
              ended: Callable[[], None] | None = None) -> asyncio.Future[T]:
        """``post`` and ``read`` as one future, resolved with ``then(status, headers, body)`` (or what it
        raises): on a kept-alive connection it is driven by the connection's callbacks alone, with no
        task (the hot path of every JSON answer and side call); otherwise (no idle connection, or a
        body sent in slices) by a task that connects first. StageError as ``post`` and ``read`` raise
        it, within ``--upstream-timeout-s`` of now. Cancelling the future closes the connection, which
        aborts the request at the stage. ``ended`` is called once the future is resolved (not when it is
        cancelled): on a kept-alive connection at once, in the callback that resolved it, so whoever waits
        on it can be woken without the turn of the event loop a done callback takes."""
        loop = self._loop or asyncio.get_running_loop()
        body = target.body
        key, head_bytes = self._target(target.worker.url, target.path, b"POST")
        connection = self._reused(key, loop.time()) if len(body) <= SLICE_BYTES else None
        if connection is None:
            task = loop.create_task(self._fetch_connecting(target, then))
            if ended is not None:
                task.add_done_callback(lambda done: done.cancelled() or ended())
            return task
        call = _WholeCall(self, target.stage, target.worker, connection, then, ended)
        call.send(head_bytes + b"%d\r\n%s\r\n" % (len(body), target.headers), body, self._idle[key])
        return call.future

    async def _fetch_connecting(self, target: Target, then: Callable[[int, AnswerHeaders, bytes], T]) -> T:
        response = await self.post(target)
        raw = await self.read(target.stage, target.worker, response)
        return then(response.status, response.headers, raw)

    def _target(self, url: str, path: str, method: bytes) -> tuple[tuple[str, int], bytes]:
        target = self._targets.get((url, path, method))
        if target is None:
            target = self._targets[(url, path, method)] = _target(url, path, method)
        return target

    async def request(self, stage: str, worker: Worker, method: bytes, path: str, body: bytes = b"",
                      headers: bytes = b"") -> Response:
        """``headers``: extra header lines, each ending in CRLF."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.upstream_timeout_s
        key, head_bytes = self._target(worker.url, path, method)
        connection = self._reused(key, loop.time())
        if connection is None:
            connection = await self._connect(stage, worker, key, deadline)
        head = connection.send(head_bytes + b"%d\r\n%s\r\n" % (len(body), headers), body)
        handle = loop.call_at(deadline, fire, head)
        try:
            if len(body) > SLICE_BYTES:
                await connection.write_sliced(body)
            answer = await head
        except BaseException:
            connection.close()  # cancelled or failed: closing the connection aborts the request at the stage
            raise
        finally:
            handle.cancel()
        if answer is TIMER:
            connection.close()
            raise StageError(timed_out(stage, worker.url, self.config.upstream_timeout_s, "--upstream-timeout-s"))
        if isinstance(answer, str):
            connection.close()
            raise StageError(unreachable(stage, worker.url, answer))
        answer.deadline = deadline
        answer.pool = self._idle.setdefault(key, [])
        return answer

    def _reused(self, key: tuple[str, int], now: float) -> StageConnection | None:
        pool = self._idle.get(key)
        while pool:
            connection = pool.pop()
            if not connection.lost and now - connection.idle_since < KEEPALIVE_S:
                return connection
            connection.close()
        return None

    async def _connect(self, stage: str, worker: Worker, key: tuple[str, int], deadline: float) -> StageConnection:
        loop = asyncio.get_running_loop()
        connect_s = self.config.connect_timeout_s
        left = deadline - loop.time()
        sock = None
        try:
            async with asyncio.timeout(min(connect_s, left)):
                last: OSError | None = None
                for info in await loop.getaddrinfo(key[0], key[1], type=socket.SOCK_STREAM):
                    sock = self._sockets(info)
                    sock.setblocking(False)
                    try:
                        await loop.sock_connect(sock, info[4])
                        break
                    except OSError as exc:
                        sock.close()
                        sock, last = None, exc
                if sock is None:
                    raise last or OSError(f"no address for {key[0]}")
                _, connection = await loop.create_connection(StageConnection, sock=sock)
                return connection
        except TimeoutError:
            if sock is not None:
                sock.close()
            if connect_s <= left:
                raise StageError(timed_out(stage, worker.url, connect_s, "--connect-timeout-s")) from None
            raise StageError(timed_out(stage, worker.url, self.config.upstream_timeout_s, "--upstream-timeout-s")) from None
        except OSError as exc:
            if sock is not None:
                sock.close()
            raise StageError(unreachable(stage, worker.url, f"{type(exc).__name__}: {exc}")) from None
        except BaseException:
            if sock is not None:
                sock.close()
            raise

    async def read(self, stage: str, worker: Worker, response: Response) -> bytes:
        """The whole body of ``response``, then released to the pool. Raises StageError on a lost
        connection or deadline; on any error or cancellation the connection is closed (which aborts
        the request at the stage)."""
        try:
            response.whole()
            while not response.done:
                if response.cut is not None:
                    raise StageError(unreachable(stage, worker.url, response.cut))
                left = response.deadline - response.loop.time()
                if left <= 0 or not await response.wait(left):
                    raise StageError(timed_out(stage, worker.url, self.config.upstream_timeout_s, "--upstream-timeout-s"))
        except BaseException:
            response.close()
            raise
        data = response.take()
        response.release()
        return data

    async def chunks(self, stage: str, worker: Worker, response: Response) -> AsyncIterator[bytes]:
        """The body of ``response`` as it arrives, all the bytes the socket gave since the last piece.
        Raises StageError on a lost connection or deadline, and ``upstream_idle_timeout`` when no byte
        came for ``--stream-idle-timeout-s`` (the caller closes the response). At its end the connection
        goes back to the pool."""
        idle_s = self.config.stream_idle_timeout_s
        while True:
            if response.pieces:
                yield response.take()
                continue
            if response.done:
                response.release()
                return
            if response.cut is not None:
                raise StageError(unreachable(stage, worker.url, response.cut))
            left = response.deadline - response.loop.time()
            if left <= 0 or not await response.wait(min(idle_s, left)):
                if idle_s < left:
                    raise StageError(idle(stage, worker.url, idle_s))
                raise StageError(timed_out(stage, worker.url, self.config.upstream_timeout_s, "--upstream-timeout-s"))

    async def follow(self, stage: str, worker: Worker, response: Response, sink: Callable[[bytes], None]) -> None:
        """Hand ``sink`` the body of ``response`` as it arrives: what is buffered now, then each piece
        the socket gives, called from the connection's ``data_received`` (no task wakes per piece; the
        streams' hot path). Returns at the body's end, or early once ``sink`` called
        ``response.detach()`` (the caller then calls ``follow`` again or closes the response). Raises
        StageError as ``chunks`` does (the idle deadline is checked lazily: one timer per
        ``--stream-idle-timeout-s``, not per piece). ``sink`` must not raise."""
        idle_s = self.config.stream_idle_timeout_s
        loop = response.loop
        response.last = loop.time()
        response.sink = sink
        try:
            if response.pieces:
                sink(response.take())
            while response.sink is sink and not response.done:
                if response.cut is not None:
                    raise StageError(unreachable(stage, worker.url, response.cut))
                now = loop.time()
                left, quiet = response.deadline - now, response.last + idle_s - now
                if quiet <= 0 and quiet < left:
                    raise StageError(idle(stage, worker.url, idle_s))
                if left <= 0:
                    raise StageError(timed_out(stage, worker.url, self.config.upstream_timeout_s,
                                               "--upstream-timeout-s"))
                await response.wait(min(quiet, left))
        finally:
            response.sink = None
        if response.done:
            response.release()

    def error(self, stage: str, worker: Worker, exc: BaseException) -> StageError:
        """An aiohttp failure on a cold path as a StageError."""
        if isinstance(exc, TimeoutError):  # aiohttp's timeouts are TimeoutErrors too
            if isinstance(exc, aiohttp.ConnectionTimeoutError):
                return StageError(timed_out(stage, worker.url, self.config.connect_timeout_s, "--connect-timeout-s"))
            return StageError(timed_out(stage, worker.url, self.config.upstream_timeout_s, "--upstream-timeout-s"))
        if isinstance(exc, aiohttp.ClientPayloadError):
            return StageError(unreachable(stage, worker.url, CUT))
        return StageError(unreachable(stage, worker.url, f"{type(exc).__name__}: {exc}".rstrip(": ")))


def _target(url: str, path: str, method: bytes) -> tuple[tuple[str, int], bytes]:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"the stages are reached over plain http: {url}")
    port = parts.port or 80
    host = parts.netloc.rsplit("@", 1)[-1]
    prefix = (parts.path.rstrip("/") + path) or "/"
    head = (b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: "
            % (method, prefix.encode("ascii"), host.encode("idna")))
    return (parts.hostname, port), head


class _WholeCall:
    """One call on a kept-alive connection, read whole: ``Upstream.fetch``'s future, resolved from the
    connection's callbacks (the head, then the body's end or a lost connection: each calls this call
    at once, ``StageConnection.send_to`` and ``Response.notify``) or the deadline's timer; whoever
    ends first wins, and the future's own end cancels the timer and, unless the answer was read
    whole, closes the connection."""

    __slots__ = ("upstream", "stage", "worker", "connection", "then", "deadline", "future", "timer", "response",
                 "pool", "ended")

    def __init__(self, upstream: Upstream, stage: str, worker: Worker, connection: StageConnection,
                 then: Callable[[int, AnswerHeaders, bytes], Any], ended: Callable[[], None] | None = None) -> None:
        """The call's deadline: ``--upstream-timeout-s`` from now."""
        self.upstream, self.stage, self.worker, self.connection, self.then = upstream, stage, worker, connection, then
        self.ended = ended
        loop = connection.loop
        self.deadline = loop.time() + upstream.config.upstream_timeout_s
        self.future: asyncio.Future = loop.create_future()
        self.timer = loop.call_at(self.deadline, self._expire)
        self.response: Response | None = None
        self.pool: list[StageConnection] | None = None

    def send(self, head: bytes, body: bytes, pool: list[StageConnection]) -> None:
        self.pool = pool
        self.future.add_done_callback(self._ended)
        self.connection.send_to(head, body, self._headed)

    def _headed(self, answer: Response | str) -> bool:
        if self.future.done():
            return False  # expired or cancelled: the connection closes
        if isinstance(answer, str):
            self._fail(unreachable(self.stage, self.worker.url, answer))
            return True
        answer.deadline, answer.pool = self.deadline, self.pool
        answer.whole()
        self.response = answer
        if answer.done or answer.cut is not None:
            self._finish()
        else:
            answer.notify = self._woken
        return True

    def _woken(self) -> None:
        response = self.response
        assert response is not None
        if self.future.done() or not (response.done or response.cut is not None):
            return
        response.notify = None
        self._finish()

    def _finish(self) -> None:
        response = self.response
        assert response is not None
        if not response.done:
            assert response.cut is not None
            self._fail(unreachable(self.stage, self.worker.url, response.cut))
            return
        data = response.take()
        response.release()
        try:
            result = self.then(response.status, response.headers, data)
        except Exception as exc:  # noqa: BLE001 - the caller's verdict on the answer (a StageError)
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)
        if self.ended is not None:
            self.ended()

    def _expire(self) -> None:
        if not self.future.done():
            config = self.upstream.config
            self._fail(timed_out(self.stage, self.worker.url, config.upstream_timeout_s, "--upstream-timeout-s"))

    def _fail(self, failure: Failure) -> None:
        self.future.set_exception(StageError(failure))
        if self.ended is not None:
            self.ended()

    def _ended(self, future: asyncio.Future) -> None:
        self.timer.cancel()
        if future.cancelled() or future.exception() is not None:
            if self.response is not None:
                self.response.close()  # a no-op once read whole and released
            else:
                self.connection.close()
