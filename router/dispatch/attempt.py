"""One attempt at a request, up to the point where the answer can be committed to the client.

``open_answer`` sends the answering stage its body and returns a ``Head`` once the answer is under
way: the whole body (non-stream), or the stream's first event that is not an error or a comment
(``router.dispatch.sse.Event.commits``; ``[DONE]`` itself is never held: the dispatcher sends it once the
request is settled, ``router.dispatch.relay``). A stage sends its opening role chunk with its first token,
never before (``stages.api.routes``): in PD the decode's first event means the KV has arrived. Until
then nothing has reached the client, so any failure, including an in-band error event that a stream
opens with (``peer_failed`` when the prefill died), is a ``StageError`` the dispatcher may retry;
and the first byte leaves the moment the stage's does.

``side_call`` sends a side stage (the prefill, an encoder) its body and reads its whole answer.
Both return futures the dispatcher waits on together (``Wakeup``); a JSON answer and a side call on a
kept-alive connection run without a task of their own (``Upstream.fetch``), and wake the dispatcher
from the connection's callback that read their last byte.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from router.plan.modes import Target
from router.dispatch.sse import Kind, SSESplitter, classify
from router.dispatch.tally import Tally
from router.upstream.client import AnswerHeaders, Response, StageError, Upstream
from router.dispatch.verdict import from_answer, from_event, unreachable


class Wakeup:
    """Wakes the one task that waits on an attempt's calls (the dispatcher's) when any of them ends:
    each call pokes it as it resolves (``Upstream.fetch``'s ``ended``; a task's done callback), so the
    task runs in the next turn of the event loop, not two or three turns later as a future's done
    callbacks chained through ``asyncio.wait`` would have it."""

    __slots__ = ("loop", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiter: asyncio.Future | None = None

    def poke(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def any_done(self, futures: list[asyncio.Future]) -> None:
        """Until one of ``futures`` is done (at once if one is); each must poke this one as it ends."""
        for future in futures:
            if future.done():
                return
        waiter = self.waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self.waiter = None


@dataclass
class Head:
    target: Target
    sent_at: float
    held: bytes  # non-stream: the whole body; stream: the complete events read so far
    response: Response | None = None  # stream: still open, the caller relays and closes it
    splitter: SSESplitter | None = None
    tally: Tally | None = None


def open_answer(upstream: Upstream, target: Target, stream: bool, tally: Tally,
                wakeup: Wakeup) -> asyncio.Future[Head]:
    """The answering stage's ``Head``, as a future that pokes ``wakeup`` as it ends (cancelling it aborts
    the call): a JSON answer read whole by the connection's callbacks (``Upstream.fetch``), a stream
    by a task."""
    sent_at = time.perf_counter()
    if stream:
        return wakeup.loop.create_task(_open(upstream, target, sent_at, tally, wakeup))

    def head(status: int, headers: AnswerHeaders, raw: bytes) -> Head:
        _check(target, status, headers, raw)
        return Head(target, sent_at, raw)

    return upstream.fetch(target, head, wakeup.poke)


async def _open(upstream: Upstream, target: Target, sent_at: float, tally: Tally, wakeup: Wakeup) -> Head:
    """The stream's task. It pokes ``wakeup`` as it ends, in its last step: the task is done (its result or
    exception set) before the woken dispatcher runs, one turn of the loop sooner than a done callback."""
    try:
        response = await upstream.post(target)
        try:
            if response.status != 200:
                raw = await upstream.read(target.stage, target.worker, response)
                _check(target, response.status, response.headers, raw)
            return await _open_stream(upstream, target, response, sent_at, tally)
        except BaseException:
            response.close()  # closing the connection aborts the request at the stage
            raise
    finally:
        wakeup.poke()


async def _open_stream(upstream: Upstream, target: Target, response: Response, sent_at: float,
                       tally: Tally) -> Head:
    splitter = SSESplitter()
    held: list[bytes] = []
    async for data in upstream.chunks(target.stage, target.worker, response):
        committed = False
        now = time.perf_counter()
        for raw in splitter.feed(data):
            event = classify(raw)
            if event.kind is Kind.ERROR and not committed:
                assert event.body is not None
                raise StageError(from_event(target.stage, target.worker.url, event.body))
            tally.see(event, now)
            if event.kind not in (Kind.DONE, Kind.COMMENT):  # a keep-alive held back would say nothing
                held.append(raw)
            committed = committed or event.commits
        if committed:
            return Head(target, sent_at, b"".join(held), response, splitter, tally)
    raise StageError(unreachable(target.stage, target.worker.url, "the stream ended before any text"))


def side_call(upstream: Upstream, target: Target, wakeup: Wakeup) -> asyncio.Future[float]:
    """Send ``target`` its body and read its answer: a future of the seconds it took (StageError if it
    failed; cancelling it aborts the call) that pokes ``wakeup`` as it ends."""
    sent_at = time.perf_counter()

    def seconds(status: int, headers: AnswerHeaders, raw: bytes) -> float:
        _check(target, status, headers, raw)
        return time.perf_counter() - sent_at

    return upstream.fetch(target, seconds, wakeup.poke)


def _check(target: Target, status: int, headers: AnswerHeaders, raw: bytes) -> None:
    """StageError unless the stage answered 200."""
    if status != 200:
        raise StageError(from_answer(target.stage, target.worker.url, status, raw, headers.get("Retry-After")))
