"""Committing an answer to the client: the non-stream body as it is, or the stream relayed event by
event as the stage produces it.

Pacing: each read from the stage's socket is written to the client at once (its complete events;
a partial event waits for its end, so the client never sees half an event). Nothing is buffered
beyond that, and TCP_NODELAY is on at both ends (``router.http`` and ``router.upstream.client`` set it on
every connection), so chunks
leave in the order and at the pace the stage produced them.

The stage's ``[DONE]`` is not relayed: the caller settles the request (every stage's time, TTFT and
TPOT recorded) and then ends the stream with ``finish_stream``, so a client that stops reading at
``[DONE]`` finds the request's metrics already there (docs/router.md, "When they are recorded").
A stream that fails after it started (connection lost, deadline, no byte for
``--stream-idle-timeout-s``, or ended without ``[DONE]``) ends with an OpenAI error event naming the
stage, then ``[DONE]``, and its upstream connection is closed. The stages' ``: keep-alive`` comments
are forwarded as they come (they keep a client's own idle timer alive; SSE clients skip them). A stage's own in-band error event is
forwarded as it is. Errors writing to the client (it left) propagate to the caller, which closes
the stage's response (``Head.response``), aborting the request there.
"""

from __future__ import annotations

import time

from router.dispatch.attempt import Head
from router.errors import stage_failed
from router.http import Request, Response, StreamResponse
from router.dispatch.sse import DONE_EVENT, Kind, classify, error_event, text_choice
from router.upstream.client import StageError, Upstream
from router.dispatch.verdict import Failure, from_event, unreachable

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


async def send_json(request: Request, head: Head, headers: dict[str, str] | None = None) -> Response:
    """Send the stage's JSON answer (``head.held``) now; returns it, sent."""
    response = Response(head.held, 200, "application/json", headers)
    await response.prepare(request)
    return response


async def relay_stream(request: Request, upstream: Upstream, head: Head,
                       headers: dict[str, str] | None = None) -> tuple[StreamResponse, Failure | None]:
    """Send the held events, then every event the stage sends but ``[DONE]``, until its stream ends.
    Returns the client response, not yet ended (the caller settles the request, then calls
    ``finish_stream``), and the stage's failure after the stream started, if any (an in-band error
    counts as one)."""
    assert head.response is not None and head.splitter is not None and head.tally is not None
    stage, worker = head.target.stage, head.target.worker
    response = StreamResponse(headers={**SSE_HEADERS, **(headers or {})})
    await response.prepare(request, head.held)
    failure: Failure | None = None
    pump = _Pump(head, response)
    try:
        while True:
            await upstream.follow(stage, worker, head.response, pump.feed)
            if pump.error is not None:
                raise pump.error  # the client left (or a bug): the caller closes the stage's response
            if not pump.blocked:
                break
            await response.drain()  # the client's socket is full: the stage's waits, unread, meanwhile
            pump.blocked = False
            head.response.connection.resume()
        if not head.tally.done:
            failure = unreachable(stage, worker.url, "the stream ended without [DONE]")
    except StageError as exc:
        failure = exc.failure
    if failure is None:
        head.response.release()  # read to its end: the connection goes back to the pool
    else:
        head.response.close()  # cut or broken mid-stream: the stage aborts the request on the closed connection
    if failure is not None:
        await response.write(error_event(stage_failed(failure).body()))
    elif head.tally.error is not None:
        failure = from_event(stage, worker.url, head.tally.error)
    return response, failure


class _Pump:
    """The sink of ``Upstream.follow`` for one relayed stream: each piece the stage's socket gives is
    split into events, tallied, and its complete events but ``[DONE]`` written to the client at once,
    in the connection's own callback (no task wakes per event). When the client's socket is full it
    pauses the stage's connection and detaches (``blocked``; ``relay_stream`` waits for the drain and
    follows on); when writing fails (the client left) it detaches with ``error`` set."""

    def __init__(self, head: Head, response: StreamResponse) -> None:
        assert head.response is not None and head.splitter is not None and head.tally is not None
        self.upstream, self.splitter, self.tally = head.response, head.splitter, head.tally
        self.client = response
        self.blocked = False
        self.error: BaseException | None = None

    def feed(self, data: bytes) -> None:
        try:
            events = self.splitter.feed(data)
            if not events:
                return
            now = time.perf_counter()
            relayed = []
            for raw in events:
                if (index := text_choice(raw)) is not None:  # most events: no decode (``router.dispatch.sse``)
                    self.tally.text(index, now)
                    relayed.append(raw)
                    continue
                event = classify(raw)
                self.tally.see(event, now)
                if event.kind is not Kind.DONE:
                    relayed.append(raw)
            if relayed and not self.client.push(relayed[0] if len(relayed) == 1 else b"".join(relayed)):
                self.blocked = True
                self.upstream.connection.pause()
                self.upstream.detach()
        except Exception as exc:  # raised again by relay_stream, not in the socket's callback
            self.error = exc
            self.upstream.detach()


async def finish_stream(response: StreamResponse) -> None:
    """End a relayed stream once its request is settled: ``[DONE]`` and the final chunk, in one write."""
    await response.write_eof(DONE_EVENT)
