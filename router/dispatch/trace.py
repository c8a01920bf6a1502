"""One attempt's spans (OpenTelemetry, docs/observability.md), made only for a traced request: one whose
``Call.span`` is live (``router.app`` starts it when the router runs with ``--otlp-traces-endpoint``).
Untraced, the dispatcher holds ``UNTRACED``, which makes nothing and sends each target as it is; a
request the sampler left out makes no span either, but its unsampled ``traceparent`` goes to every
stage, which then leaves it out too (``attempt_spans``).

    chat (SERVER; router.app)                 the client's request, arrival to the answer's end
      router.admission (router.app)           body read, JSON, images fetched and resolved
      router.attempt {epd.room, epd.attempt}  one attempt, from its plan to its settling
        router.plan                           the planner's pick (epd: the embedding cache's lookup)
        router.<stage> (CLIENT)               one call to a stage (``Plan.label``: encoder, prefill,
                                              decode, colocated, local_encode); its ``traceparent`` is
                                              sent with it, so the stage's spans are its children
        router.stream                         a stream's first byte to the client .. its end

A call's span lasts exactly the seconds ``x-epd-stage-times`` shows for it (its start plus those
seconds) when it succeeded; a failed or cancelled one ends when the attempt does, the failed one
with its error. Times are wall clock (``time.time()``), as the room timelines'.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence

from router.dispatch.timeline import RoomRecord
from router.dispatch.verdict import Failure
from router.plan.modes import Plan, Target
from telemetry import NO_SPAN, Span, SpanKind


def wall(perf: float) -> float:
    """The wall-clock time of ``perf`` (a ``time.perf_counter()`` reading of this process)."""
    return time.time() - (time.perf_counter() - perf)


class AttemptSpans:
    """The spans of one traced attempt. The dispatcher calls, on its event loop: ``target`` for each
    call as it sends it (answer first, then the sides in plan order), ``settled`` once the attempt is
    settled (the calls' seconds known), ``close`` once when the attempt ends."""

    __slots__ = ("span", "calls")

    def __init__(self, root: Span, plan: Plan, number: int, planned: tuple[float, float]) -> None:
        """``planned``: the ``perf_counter`` times the plan was asked for and made."""
        start, made = wall(planned[0]), wall(planned[1])
        attributes = {"epd.attempt": number} if plan.room is None else {"epd.attempt": number, "epd.room": plan.room}
        self.span = root.child("router.attempt", start, attributes)
        self.span.child("router.plan", start).end(made)
        self.calls: list[tuple[Target, Span, float] | None] = []

    def target(self, plan: Plan, target: Target) -> Target:
        """``target`` with its call's ``traceparent`` header (its span begun now)."""
        now = time.time()
        span = self.span.child(f"router.{plan.label(target)}", now, {"server.address": target.worker.url,
                                                                     "epd.worker": target.worker.id}, SpanKind.CLIENT)
        self.calls.append((target, span, now))
        if span.traceparent is None:
            return target
        return dataclasses.replace(target, headers=b"traceparent: %s\r\n" % span.traceparent.encode("ascii"))

    def settled(self, sides: Sequence[asyncio.Future[float]], answer_s: float) -> None:
        """The attempt was settled (every side call ended): the answer's call took ``answer_s``, and
        each side that succeeded the seconds its future holds; the spans of those calls end so."""
        for index, seconds in enumerate((answer_s, *(_seconds(side) for side in sides))):
            entry = self.calls[index] if index < len(self.calls) else None
            if entry is not None and seconds is not None:
                _, span, start = entry
                span.end(start + seconds)
                self.calls[index] = None

    def close(self, record: RoomRecord, failure: Failure | None) -> None:
        """The attempt ended (``record.done`` set): the calls still open end now (the failed stage's with
        its error, the rest cancelled), then the stream's span and the attempt's own."""
        now = time.time()
        for entry in self.calls:
            if entry is not None:
                target, span, _ = entry
                error = failure.message if failure is not None and (failure.url, failure.stage) == (
                    target.worker.url, target.stage) else None
                span.end(now, error, {"epd.cancelled": error is None})
        self.calls = []
        if record.stream and record.first_byte is not None:
            self.span.child("router.stream", record.first_byte).end(record.done or now)
        outcome = {"epd.outcome": record.outcome or "aborted"}
        if failure is None:
            self.span.end(record.done or now, None if record.outcome == "success" else record.outcome, outcome)
            return
        self.span.end(record.done or now, failure.message,
                      {**outcome, "error.type": failure.code or "error", "epd.blamed_stage": failure.stage})


def attempt_spans(root: Span, plan: Plan, number: int, planned: tuple[float, float]) -> AttemptSpans:
    """The spans of an attempt of the request whose span is ``root``: ``UNTRACED`` for an untraced request
    (``NO_SPAN``), one that only sends ``root``'s unsampled ``traceparent`` on (so the stages record
    nothing either) for a request the sampler left out, else the attempt's spans."""
    if root is NO_SPAN:
        return UNTRACED
    if not root.sampled:
        return _Unsampled(root.traceparent)
    return AttemptSpans(root, plan, number, planned)


def _seconds(side: asyncio.Future[float]) -> float | None:
    """A settled side call's seconds, None if it failed."""
    return None if side.exception() is not None else side.result()


class _Untraced(AttemptSpans):
    """An untraced attempt: nothing is made, each target is sent as it is."""

    __slots__ = ()

    def __init__(self) -> None:
        self.span = NO_SPAN
        self.calls = []

    def target(self, plan: Plan, target: Target) -> Target:
        return target

    def settled(self, sides: Sequence[asyncio.Future[float]], answer_s: float) -> None:
        return None

    def close(self, record: RoomRecord, failure: Failure | None) -> None:
        return None


UNTRACED = _Untraced()


class _Unsampled(_Untraced):
    """An attempt of a request the sampler left out: each target carries the request's unsampled
    ``traceparent``, so the stages leave it out too; no span is made."""

    __slots__ = ("header",)

    def __init__(self, traceparent: str | None) -> None:
        super().__init__()
        self.header = b"" if traceparent is None else b"traceparent: %s\r\n" % traceparent.encode("ascii")

    def target(self, plan: Plan, target: Target) -> Target:
        return dataclasses.replace(target, headers=self.header) if self.header else target
