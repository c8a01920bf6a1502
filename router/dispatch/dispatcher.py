"""Running one request: plan, attempt, retry, commit, settle.

An attempt sends every stage of its plan its body at once (the decode and the prefill of one room
together), then waits for the first of: the answer under way (``open_answer`` returns), a side call
failing (its stage is to blame; the rest of the attempt is aborted at once instead of waiting for
the answering stage to time out), or the answering stage failing (``blame`` decides whether its
partner was the cause). A failure before anything reached the client is retried once on a fresh
plan (new room, the blamed worker excluded) unless the request itself was wrong (4xx) or a
dependency every worker shares failed (``verdict.SHARED_CODES``: the embedding cache's Redis). A
stage shutting down (``verdict.LEAVING_CODES``: 503 ``draining``, it took none of the request; or
``drain_timeout``) is taken out of rotation at once without a breaker charge, and the request is
retried on another worker, as when a connection could not be opened.

Aborting: whenever an attempt ends early (a failure, or the client leaving, which cancels the
handler), every upstream call still open is cancelled, which closes its connection; the prefill and
the decode abort the room on a closed connection (``docs/protocol.md``), and the plan's ``on_abort``
(epd: the encoders' ``/v1/abort``) runs in the background. Each worker's lease gets exactly one
verdict for its breaker: success, failure (it was to blame) or none.

Blame in epd mode: a prefill failing on an image the router put in the attempt (the encode
failed, timed out, or the cache entry went away) is charged to that image's encoder
(``verdict.blame_encoder``); a decode reporting its prefill's failure waits up to
``PEER_GRACE_S`` for the prefill's own answer, which names the cause (and a prefill whose decode never
came, while the decode has not answered, or whose KV write into it failed, while the decode stays
silent as long, charges the decode: ``_decode_behind``), and a prefill reporting an
image's failure waits as long for the encoder's own answer (``_encoder_behind``: an encoder that
refused the image as busy makes the request's answer a 503 with Retry-After, not a 502; one still
silent when the claim taken for it ended untaken is charged).

The answer carries ``x-epd-room`` (the attempt's room), ``x-epd-stage-times`` (seconds of each
call, sent to its last byte: a JSON answer every stage's, as it is sent once every side call has
ended; a stream those of the side calls that had answered when it started:
``encoder=0.0123;prefill=0.0456;decode=0.0789``; the prefill's encode call for its own request's images,
``local_encode=``: ``Plan.label``) and, in epd mode, ``x-epd-cache: hit=N miss=M``
(the request's image parts whose keys the cache held, or not, when the attempt was planned).

Metrics: an attempt's stage times (every stage), TTFT and TPOT are recorded when it is settled,
before the client's last byte (``_attempt``; a stream's ``[DONE]`` is held back until then); the
request's outcome and end-to-end time after it, by the app, before the handler returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Collection, Sequence
from dataclasses import dataclass

from contract.errors import Code
from router.dispatch.attempt import Head, Wakeup, open_answer, side_call
from router.dispatch.client_params import as_client_sees
from router.config import RouterConfig
from router.errors import RouterError
from router.http import Request, Response, StreamResponse
from router.plan.image_refs import Referenced
from router.metrics import Metrics
from router.plan.modes import Call, Plan, Planner
from router.dispatch.relay import finish_stream, relay_stream, send_json
from router.dispatch.tally import Tally
from router.dispatch.timeline import RoomLog, RoomRecord
from router.dispatch.trace import AttemptSpans, attempt_spans
from router.upstream.client import StageError, Upstream
from router.dispatch.verdict import DECODE_SIDE_CODES, IMAGE_CODES, PEER_CODES, ROUTER_CODES, SHARED_CODES, Failure, blame, blame_encoder
from router.fleet.workers import Lease, lease_all

log = logging.getLogger(__name__)
PEER_GRACE_S = 1.0  # a decode reports its prefill's failure: the prefill's own answer is this close behind
# a prefill's image codes that can mean the claim taken for the encoder ended before that encoder took it up
UNTAKEN_CODES = frozenset({Code.ENCODE_ABANDONED, Code.IMAGE_NOT_CACHED})


@dataclass
class Answered:
    response: Response | StreamResponse
    failure: Failure | None  # the stage failed after the answer started (the client got an error event)


class Dispatcher:
    def __init__(self, config: RouterConfig, planner: Planner, upstream: Upstream, metrics: Metrics,
                 rooms: RoomLog) -> None:
        self.config = config
        self.planner = planner
        self.upstream = upstream
        self.metrics = metrics
        self.rooms = rooms  # each attempt's room, for GET /admin/rooms
        self._background: set[asyncio.Task] = set()  # aborts still being sent

    async def handle(self, request: Request, call: Call) -> Answered:
        """The client's answer, sent. Raises RouterError (no worker) or StageError (every attempt
        failed, or a stage refused the request) while nothing has been sent.

        A plan's workers are leased in one step (``workers.lease_all``); if a breaker opened since
        the pick (an epd plan awaits the cache in between), the plan is dropped and made again
        without that worker: not an attempt, and bounded, as each pass excludes one more worker."""
        exclude: set[str] = set()
        last: StageError | None = None
        attempts, cached = 0, None
        try:
            while attempts <= self.config.retries:
                planning = time.perf_counter()
                try:
                    plan = await self.planner.plan(call, exclude)
                except RouterError:
                    if last is None:
                        raise
                    break  # nobody left to retry on: the client gets the stage's failure
                cached = plan.cached if cached is None else cached
                leases = lease_all([target.worker for target in (plan.answer, *plan.sides)])
                if leases is None:
                    exclude.update(t.worker.url for t in (plan.answer, *plan.sides) if not t.worker.breaker.allows())
                    self._drop(plan)
                    continue
                attempts += 1
                if last is not None:
                    self.metrics.retry(last.failure.stage).inc()
                try:
                    spans = attempt_spans(call.span, plan, attempts, (planning, time.perf_counter()))
                    return await self._attempt(request, call, plan, leases, spans)
                except StageError as exc:
                    if exc.failure.client_fault or exc.failure.code in SHARED_CODES:
                        raise
                    last = exc
                    log.warning("%s stage %s failed before the answer started: %s", exc.failure.stage,
                                exc.failure.url, exc.failure.message)
                    if exc.failure.code != Code.ROOM_CONFLICT:
                        exclude.add(exc.failure.url)
        finally:
            self._count_images(call, cached or frozenset())
        assert last is not None
        raise last

    async def _attempt(self, request: Request, call: Call, plan: Plan, leases: list[Lease],
                       spans: AttemptSpans) -> Answered:
        """One attempt on ``plan``'s leased workers, traced in ``spans`` (``router.dispatch.trace``).
        Settled (``_settle``: every verdict and stage time recorded) before the client's last byte: a
        JSON answer after every side call has ended, before its body is sent; a stream once the
        stage's stream has ended, before the final chunk."""
        record = self._record(call, plan)
        if plan.local_encode:
            self.metrics.local_encodes.inc(sum(1 for url in plan.images.values() if url))
        tally = Tally(call.started)
        wakeup = Wakeup(request.connection.loop)
        answer = open_answer(self.upstream, spans.target(plan, plan.answer), call.stream, tally, wakeup)
        sides = [side_call(self.upstream, spans.target(plan, side), wakeup) for side in plan.sides]
        head: Head | None = None
        cache = cache_counts(call.media, plan.cached) if self.config.mode == "epd" else None
        outcome, untouched, failed = "aborted", frozenset[str](), None
        try:
            head = await self._head(plan, answer, sides, wakeup)
            answer_s = time.perf_counter() - head.sent_at
            response: Response | StreamResponse
            if call.stream:
                record.first_byte = time.time()
                response, failure = await relay_stream(request, self.upstream, head, _headers(plan, sides, None, cache))
                failed, answer_s = failure, time.perf_counter() - head.sent_at
                await self._settle(plan, sides, wakeup, leases, answer_s, failure)
                spans.settled(sides, answer_s)
                self._observe_stream(tally)
                await finish_stream(response)
            else:
                failure = None
                await self._settle(plan, sides, wakeup, leases, answer_s, failure)
                spans.settled(sides, answer_s)
                record.first_byte = time.time()
                response = await send_json(request, head, _headers(plan, sides, answer_s, cache))
            outcome = "success" if failure is None else f"failed after the answer started: {failure.message}"
            return Answered(response, failure)
        except StageError as exc:
            failure = failed = as_client_sees(blame_encoder(exc.failure, plan.images), call.media, plan.sides)
            self._charge(failure, plan, leases)
            outcome = f"failed: the {failure.stage} stage: {failure.message}"
            untouched = frozenset({failure.url} if failure.unreachable or failure.refused else ())
            raise exc if failure is exc.failure else StageError(failure) from None
        finally:
            if outcome != "success" and plan.on_abort is not None:
                self._spawn(plan.on_abort(untouched))
            record.done, record.outcome = time.time(), outcome
            spans.close(record, failed)
            if head is not None and head.response is not None:
                head.response.close()  # a stream the client left: the stage aborts the room (no-op once read)
            tasks: tuple[asyncio.Future, ...] = (answer, *sides)
            for task in tasks:
                task.cancel()  # closes what is still open: the stage aborts the room
            if all(task.done() for task in tasks):  # the common case: no extra turn of the event loop
                for task in tasks:
                    task.cancelled() or task.exception()  # a failure is marked as seen (no "never retrieved")
            else:
                await asyncio.gather(*tasks, return_exceptions=True)
            for lease in leases:
                lease.cancel()  # no verdict for whoever has none yet

    def _record(self, call: Call, plan: Plan) -> RoomRecord:
        """This attempt's entry in the room log (a colocated plan has no room: a detached record)."""
        now = time.time()
        record = RoomRecord(plan.room if plan.room is not None else -1, now - (time.perf_counter() - call.started),
                            now, call.stream, tuple((plan.label(t), t.worker) for t in (plan.answer, *plan.sides)))
        return self.rooms.open(record) if plan.room is not None else record

    async def _head(self, plan: Plan, answer: asyncio.Future[Head], sides: Sequence[asyncio.Future[float]],
                    wakeup: Wakeup) -> Head:
        pending: list[asyncio.Future] = [answer, *sides]
        while True:
            await wakeup.any_done(pending)
            done = [task for task in pending if task.done()]
            pending = [task for task in pending if not task.done()]
            failed = [task for task in done if task is not answer and task.exception() is not None]
            if failed:  # a side call failed: it is to blame (an encoder's own answer first)
                failed.sort(key=lambda t: plan.sides[sides.index(t)].stage != "encoder")
                side_error = failed[0].exception()
                assert side_error is not None
                raise await _encoder_behind(plan, sides, await _decode_behind(plan, answer, side_error))
            if answer in done:
                error = answer.exception()
                if error is None:
                    return answer.result()
                if not isinstance(error, StageError):
                    raise error
                partner = plan.partner
                if partner is None:
                    raise StageError(blame(error.failure, None))
                feed = sides[plan.sides.index(partner)]
                if not feed.done() and error.failure.code in PEER_CODES:
                    await asyncio.wait([feed], timeout=PEER_GRACE_S)
                    feed_error = feed.exception() if feed.done() else None
                    if feed_error is not None:
                        raise await _encoder_behind(plan, sides, feed_error)  # the prefill's own failure names the cause
                blamed = blame(error.failure, (partner.stage, partner.worker.url) if not feed.done() else None)
                raise await _encoder_behind(plan, sides, StageError(blamed))

    async def _settle(self, plan: Plan, sides: Sequence[asyncio.Future[float]], wakeup: Wakeup, leases: list[Lease],
                      answer_s: float, failure: Failure | None) -> None:
        """The answer is complete (``failure``: the answering stage's, after it started): every
        lease's verdict and every stage's time. Waits for the side calls still open (normally none:
        the prefill answers once its KV is written; each is bounded by ``--upstream-timeout-s``)."""
        while open_ := [task for task in sides if not task.done()]:
            await wakeup.any_done(open_)
        for side, task, lease in zip(plan.sides, sides, leases[1:]):
            error = task.exception()
            if error is None:
                lease.success()
                self.metrics.stage_time(plan.label(side)).observe(task.result())
            elif isinstance(error, StageError):
                log.warning("%s stage %s failed after the answer started: %s", side.stage, side.worker.url,
                            error.failure.message)
                lease.failure()
            else:
                raise error
        self.metrics.stage_time(plan.answer.stage).observe(answer_s)
        if failure is not None:
            self._charge(failure, plan, leases)
        else:
            leases[0].success()

    def _drop(self, plan: Plan) -> None:
        """A plan that was never sent: the claims its encoders' images were taken with are released."""
        if plan.on_abort is not None:
            self._spawn(plan.on_abort(frozenset(t.worker.url for t in plan.sides if t.stage == "encoder")))

    def _count_images(self, call: Call, cached: frozenset[str]) -> None:
        """epd: the request's images in ``epd_router_images_total``, by the cache's answer to its first
        plan (no plan made: misses). Other modes count them as they arrive (``app.py``)."""
        hit, miss = cache_counts(call.media, cached)
        if hit:
            self.metrics.image_count("hit").inc(hit)
        if miss:
            self.metrics.image_count("miss").inc(miss)

    def _charge(self, failure: Failure, plan: Plan, leases: list[Lease]) -> None:
        for target, lease in zip((plan.answer, *plan.sides), leases):
            if target.worker.url != failure.url:
                continue
            if failure.client_fault:
                lease.success()  # it answered, correctly refusing a bad request
            elif failure.busy or failure.leaving or failure.code in ROUTER_CODES or failure.code in SHARED_CODES:
                lease.cancel()  # back-pressure, shutting down, or not its fault
            else:
                lease.failure()
            if (failure.unreachable or failure.leaving) and target.worker.healthy:
                log.warning("%s stage %s marked unhealthy: %s", target.stage, target.worker.url, failure.message)
                target.worker.healthy = False  # the health loop brings it back once /health answers

    def _spawn(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` past the end of the request (a handler the client left is being cancelled)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _observe_stream(self, tally: Tally) -> None:
        if tally.ttft is not None:
            self.metrics.ttft.observe(tally.ttft)
        if tally.tpot is not None:
            self.metrics.tpot.observe(tally.tpot)


def cache_counts(images: Sequence[Referenced], cached: Collection[str]) -> tuple[int, int]:
    """(hits, misses) among a request's image and video parts sent as references (each part counts, a
    repeated one too; a video the router did not key, none)."""
    keys = [image.key for image in images if image.key is not None]
    hit = sum(1 for key in keys if key in cached)
    return hit, len(keys) - hit


def _headers(plan: Plan, sides: Sequence[asyncio.Future[float]], answer_s: float | None,
             cache: tuple[int, int] | None = None) -> dict[str, str]:
    """``x-epd-room``, ``x-epd-stage-times`` and (epd, ``cache``: hits and misses) ``x-epd-cache`` of
    an answer about to start (see the module doc); several encoders of one stage: the longest."""
    if plan.room is None:
        return {}
    times: dict[str, float] = {}
    for side, task in zip(plan.sides, sides):
        if task.done() and not task.cancelled() and task.exception() is None:
            seconds, stage = task.result(), plan.label(side)
            times[stage] = max(times[stage], seconds) if stage in times else seconds
    if answer_s is not None:
        times[plan.answer.stage] = answer_s
    headers = {"x-epd-room": str(plan.room),
               "x-epd-stage-times": ";".join(["%s=%.4f" % item for item in times.items()])}
    if cache is not None:
        headers["x-epd-cache"] = f"hit={cache[0]} miss={cache[1]}"
    return headers


async def _decode_behind(plan: Plan, answer: asyncio.Future, error: BaseException) -> BaseException:
    """``error``, or the decode's failure behind it: a prefill saying its partner never came or went
    silent (``PEER_CODES``) while the decode's own call has not answered reports the decode (a frozen
    or vanished decode host), which is then the one charged and left out of the retry. A prefill
    whose KV write into the decode failed (``kv_transfer_failed``) may be at fault itself: a live
    decode answers (its prefill failed) within ``PEER_GRACE_S``, and then the prefill's word stands;
    a decode still silent after that, or whose call the router saw go idle, time out or drop
    (``_silent``), is the one charged."""
    if not (isinstance(error, StageError) and error.failure.stage == "prefill"
            and error.failure.code in DECODE_SIDE_CODES and plan.answer.stage == "decode"):
        return error
    if error.failure.code not in PEER_CODES and not answer.done():
        await asyncio.wait([answer], timeout=PEER_GRACE_S)
    if answer.done() and not _silent(answer):
        return error
    return StageError(blame(error.failure, (plan.answer.stage, plan.answer.worker.url)))


def _silent(answer: asyncio.Future) -> bool:
    """Whether the decode's call ended without a word from the decode: the router saw its connection
    lost, its stream go idle or its deadline pass. That is no answer: a decode frozen after sending
    its stream's head ends so (``--stream-idle-timeout-s``), and is charged as one that never answered."""
    if answer.cancelled():
        return False
    failed = answer.exception()
    return isinstance(failed, StageError) and (failed.failure.unreachable or failed.failure.code == Code.UPSTREAM_TIMEOUT)


async def _encoder_behind(plan: Plan, sides: Sequence[asyncio.Future], error: BaseException) -> BaseException:
    """``error``, or the encoder's own failure behind it: a prefill failing on an image this attempt
    sent to an encoder (``IMAGE_CODES``, its ``image_key``) reports that encoder's failure, and the
    encoder's own answer, at most ``PEER_GRACE_S`` behind, names the cause (a 503 busy is
    back-pressure, not the encoder's fault). Whichever of the two the event loop hands over first.

    An encode that ended as back-pressure before the encoder took it up (``UNTAKEN_CODES``: the
    claim taken for it lapsed untaken, ``contract.claims``) while that encoder's call stays silent
    ``PEER_GRACE_S`` more is the encoder's silence, not back-pressure: a live encoder at its limits
    refuses at once (its 503 busy is its own answer); one frozen or cut off says nothing for the
    claim's whole lease. It is charged (``_silent_encoder``) and left out of the retry."""
    if not isinstance(error, StageError) or error.failure.stage != "prefill" or error.failure.code not in IMAGE_CODES:
        return error
    url = plan.images.get(error.failure.image_key or "")
    index = next((i for i, side in enumerate(plan.sides) if side.stage == "encoder" and side.worker.url == url), None)
    if index is None:
        return error
    encoder = sides[index]
    if not encoder.done():
        await asyncio.wait([encoder], timeout=PEER_GRACE_S)
    own = encoder.exception() if encoder.done() and not encoder.cancelled() else None
    if isinstance(own, StageError):
        return own
    if not encoder.done() and error.failure.code in UNTAKEN_CODES:
        return StageError(_silent_encoder(error.failure, plan.sides[index].worker.url))
    return error


def _silent_encoder(reported: Failure, url: str) -> Failure:
    """The encoder's failure when the claim taken for it ended untaken and its own call said nothing."""
    return Failure("encoder", url, 504, f"{url} sent nothing while the claim taken for it on image "
                   f"{reported.image_key} ended untaken (the {reported.stage} stage reports: {reported.message})",
                   Code.UPSTREAM_TIMEOUT, room=reported.room, image_key=reported.image_key)
