"""A request's lifetime on a stage's OpenAI routes (chat and legacy completions alike): admission,
the engine's liveness while it waits, keep-alives while a stream is quiet, and the abort of the
request in the engine whenever its response ends early (client gone, stream closed, engine failure).

Each route handler calls ``admitted`` with its work; a streamed answer is an ``event_stream`` (which
holds its admission place until the stream ends); the engine's outputs reach it through ``guarded``
(and ``ticking`` when streamed); a whole answer is awaited with ``unless_disconnected``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from stages.api.admission import Admission
from stages.api.completion_schema import AnyRequest
from stages.api.errors import engine_unavailable, overloaded
from stages.engine.async_engine import AsyncEngine, EngineUnavailable
from stages.engine.outputs import RequestOutput
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams

T = TypeVar("T")
# request id, prompt, sampling parameters, the request body -> (awaited) the request's outputs: how a
# server runs one request (``create_app``'s ``generate``: the engine whole, or a room coordinator's)
Generate = Callable[[str, Prompt, SamplingParams, AnyRequest], Awaitable[AsyncGenerator[RequestOutput, None]]]
LIVENESS_CHECK_S = 1.0  # how often a waiting request checks that the engine thread is still alive
# an SSE comment: SSE clients (the openai client included) skip it; it tells the router's idle deadline
# (--stream-idle-timeout-s) that a stream with nothing to say yet is alive (docs/protocol.md "Keep-alives")
KEEPALIVE = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"


def run_whole(engine: AsyncEngine) -> Generate:
    """The ``Generate`` of a server without rooms (``create_app``'s default): the engine runs each request whole."""

    async def generate(request_id: str, prompt: Prompt, params: SamplingParams,
                       body: AnyRequest) -> AsyncGenerator[RequestOutput, None]:
        return engine.generate(request_id, prompt, params)  # checks the request and the engine thread first

    return generate


def sse_event(body: dict) -> str:
    """One server-sent event carrying ``body`` as compact JSON."""
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def admitted(gate: Admission, work: Coroutine[None, None, Response]) -> Response:
    """``work``'s response if ``gate`` has room (503 with Retry-After otherwise, ``work`` never run).
    The place is held until the response ends: a streamed one's when its stream closes."""
    if not gate.enter():
        work.close()
        raise overloaded(gate.limit)
    try:
        response = await work
    except BaseException:
        gate.leave()
        raise
    if isinstance(response, ClosingStreamingResponse):
        response.on_close = gate.leave
    else:
        gate.leave()
    return response


def event_stream(events: AsyncIterator[str]) -> ClosingStreamingResponse:
    """A text/event-stream response of ``events``, unbuffered by proxies."""
    return ClosingStreamingResponse(events, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def ticking(outputs: AsyncGenerator[T, None], interval_s: float) -> AsyncGenerator[T | None, None]:
    """``outputs``, with a None each time ``interval_s`` passes without one (the step in flight is
    kept, not cancelled). Closing this closes ``outputs``."""
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(outputs))
            while not (await asyncio.wait({step}, timeout=interval_s))[0]:
                yield None
            if isinstance(step.exception(), StopAsyncIteration):
                return
            yield step.result()
    finally:
        if step is not None and not step.done():
            step.cancel()
            await asyncio.wait({step})
        await outputs.aclose()


async def guarded(engine: AsyncEngine, outputs: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """Yield the engine's outputs for one request, raising 503 if the engine thread dies while we wait
    (nothing would ever feed the request's queue again). Closing this closes ``outputs``, which
    aborts the request in the engine if it has not finished."""
    try:
        while True:
            step = asyncio.ensure_future(anext(outputs))
            try:
                while not (await asyncio.wait({step}, timeout=LIVENESS_CHECK_S))[0]:
                    if not engine.alive:
                        raise engine_unavailable()
            finally:
                if not step.done():
                    step.cancel()
                    await asyncio.wait({step})
            if step.cancelled() or isinstance(step.exception(), StopAsyncIteration):
                return
            if isinstance(step.exception(), EngineUnavailable):  # died or stalled past a deadline
                raise engine_unavailable() from step.exception()
            yield step.result()
    finally:
        await outputs.aclose()


async def unless_disconnected(request: Request, work: Coroutine) -> Response:
    """Await ``work``, cancelling it (which aborts its request in the engine) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.wait({task})
    return Response(status_code=499)  # nobody will read it


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends, then calls ``on_close``. A client
    disconnect cancels Starlette's send task and leaves the generator suspended; closing it aborts
    the request in the engine."""

    on_close: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]  # Starlette types the body as any async iterable; ours is always an async generator
            finally:
                if self.on_close is not None:
                    self.on_close()
