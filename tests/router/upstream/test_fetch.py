"""``Upstream.fetch`` against a raw loopback server that answers each request as the test scripts it:
the first call connects (a task), later ones reuse the kept-alive connection and run on its callbacks
alone; on that path too a deadline, a connection cut mid-body, a cancel and a refusal end the call
as ``post`` + ``read`` would, and only a connection whose answer was read whole is reused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from router.fleet.breaker import CircuitBreaker
from router.config import RouterConfig
from router.upstream.client import StageError, Upstream
from router.fleet.workers import Worker
from router.plan.modes import Target

pytestmark = pytest.mark.timeout(60)
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\nRetry-After: 3\r\n\r\n{}"
HALF = b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nhello"  # then the connection is cut


class Scripted:
    """Answers the n-th request on any connection with ``answers[n]``: bytes (then ``CUT`` closes
    it), or None (no answer). Counts connections, and notes when one is closed by the client."""

    def __init__(self, answers: list[bytes | None], cut_after: set[int] = frozenset()) -> None:
        self.answers, self.cut_after = answers, cut_after
        self.requests = self.connections = 0
        self.closed = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                n, self.requests = self.requests, self.requests + 1
                if self.answers[n] is not None:
                    writer.write(self.answers[n])
                    await writer.drain()
                if n in self.cut_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()


async def fetching(script: Scripted, test: Callable, timeout_s: float = 10.0) -> None:
    server = await asyncio.start_server(script.serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    upstream = Upstream(RouterConfig(colocated=(url,), upstream_timeout_s=timeout_s))
    await upstream.start()
    try:
        await test(upstream, Worker(url, "colocated", CircuitBreaker(3, 10.0)))
    finally:
        await upstream.close()
        server.close()


def answer(status: int, headers, body: bytes) -> tuple[int, str | None, bytes]:
    if status != 200:
        raise ValueError(f"refused: {status}")  # the caller's verdict (attempt._check raises a StageError)
    return status, headers.get("content-length"), body


async def test_the_first_call_connects_and_the_next_reuse_its_connection():
    script = Scripted([OK, OK, OK])

    async def test(upstream: Upstream, worker: Worker) -> None:
        for _ in range(3):
            assert await upstream.fetch(Target("colocated", worker, b"{}"), answer) == (200, "5", b"hello")
        assert script.connections == 1

    await fetching(script, test)


async def test_a_refusal_is_the_callers_verdict_and_the_connection_is_kept():
    script = Scripted([OK, BUSY, OK])

    async def test(upstream: Upstream, worker: Worker) -> None:
        await upstream.fetch(Target("colocated", worker, b"{}"), answer)
        with pytest.raises(ValueError, match="refused: 503"):
            await upstream.fetch(Target("colocated", worker, b"{}"), answer)
        assert await upstream.fetch(Target("colocated", worker, b"{}"), answer) == (200, "5", b"hello")
        assert script.connections == 1

    await fetching(script, test)


async def test_a_reused_connection_that_never_answers_times_out_and_is_closed():
    script = Scripted([OK, None])

    async def test(upstream: Upstream, worker: Worker) -> None:
        await upstream.fetch(Target("colocated", worker, b"{}"), answer)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(StageError) as caught:
            await upstream.fetch(Target("colocated", worker, b"{}"), answer)
        assert 0.4 < loop.time() - started < 3.0
        assert caught.value.failure.code == "upstream_timeout" and "--upstream-timeout-s" in caught.value.failure.message
        await asyncio.wait_for(script.closed.wait(), 5)

    await fetching(script, test, timeout_s=0.5)


async def test_a_reused_connection_cut_mid_body_is_unreachable():
    script = Scripted([OK, HALF], cut_after={1})

    async def test(upstream: Upstream, worker: Worker) -> None:
        await upstream.fetch(Target("colocated", worker, b"{}"), answer)
        with pytest.raises(StageError) as caught:
            await upstream.fetch(Target("colocated", worker, b"{}"), answer)
        assert "the connection closed before the answer was complete" in caught.value.failure.message

    await fetching(script, test)


async def test_cancelling_a_call_on_a_reused_connection_closes_it():
    script = Scripted([OK, None])

    async def test(upstream: Upstream, worker: Worker) -> None:
        await upstream.fetch(Target("colocated", worker, b"{}"), answer)
        call = upstream.fetch(Target("colocated", worker, b"{}"), answer)
        await asyncio.sleep(0.2)
        call.cancel()
        await asyncio.wait_for(script.closed.wait(), 5)  # the stage sees the close: it aborts the request

    await fetching(script, test)
