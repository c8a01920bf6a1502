"""Flights: this process's work on one image key, from its claim to its release.

``Flights.start`` creates a flight and, shielded from the caller's cancellation, claims the key for
this encoder (``renew`` first: the router may have claimed it on this encoder's behalf; then
``claim``, NX). Won: the job is queued for the encoder thread and a completion task waits for it,
then ends the claim in one Redis call (``contract.claims``): the entry written (``put``), or how the
encode ended told to every waiter (``end`` of an ``EncodeEnd``: back-pressure or failure). Lost: the
flight ends at once as ``pending_elsewhere``. A flight ends exactly once: its
``result`` future holds ``"encoded"``, ``"pending_elsewhere"`` or a ``Failure``; it leaves the table
(``get`` no longer finds it) in the same step.

Interest: a flight knows which requests (serial -> room) wait for it. ``forget`` drops interests;
a job nobody waits for that is still queued is cancelled (its completion task then ends it as
``CANCELLED``: abandoned, so waiters elsewhere know to try again). Work already running
finishes and is cached.

Single event loop: everything here runs on the server's loop except ``deliver`` (the encoder
thread's callback), which crosses with ``call_soon_threadsafe``. Every wait has a deadline:
``encode_timeout_s`` for the encoder thread, the cache's per-call deadline for Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cache.errors import CacheUnavailable, EntryTooLarge
from cache.store import EmbeddingCache
from contract.claims import EncodeEnd
from contract.encode import ENCODED, PENDING_ELSEWHERE
from contract.errors import Code
from stages.config import EncoderConfig
from stages.encoder.batcher import Batcher, Job
from stages.engine.multimodal import ImageEmbedding

log = logging.getLogger(__name__)
_CANCELLED = "cancelled: every request waiting for this image went away (room aborted or deadline passed)"
SHUTDOWN_GRACE_S = 3.0  # at shutdown, how long flights get to report their end before they are abandoned


@dataclass(frozen=True)
class Failure:
    """Why a flight ended without an entry; each waiting request turns it into its own APIError."""

    status: int
    message: str
    code: str


@dataclass(eq=False)
class Flight:
    job: Job
    encoded: asyncio.Future  # ImageEmbedding | str (why not): set by the encoder thread, or on cancel
    result: asyncio.Future  # ENCODED | PENDING_ELSEWHERE | Failure, set when the flight ends
    interests: dict[int, int] = field(default_factory=dict)  # request serial -> room
    owned: bool = False  # this process holds the key's claim
    cancelled: bool = False
    ended_at: float = 0.0  # time.monotonic() when it ended
    # time.monotonic() when its embedding was ready and its entry's write began: before any reader can see the
    # entry (a prefill may read it before this encoder hears its write succeeded, so ended_at can come after)
    encoded_at: float = 0.0


class Flights:
    def __init__(self, config: EncoderConfig, cache: EmbeddingCache, batcher: Batcher, encoder_id: str) -> None:
        self.config = config
        self.cache = cache
        self.batcher = batcher
        self.encoder_id = encoder_id
        self._table: dict[str, Flight] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop ``deliver`` crosses to; call once from the server's lifespan."""
        self._loop = loop

    def __len__(self) -> int:
        """Flights not ended yet (each holds or awaits its key's claim)."""
        return len(self._table)

    def get(self, key: str) -> Flight | None:
        return self._table.get(key)

    async def cached(self, keys: Iterable[str]) -> set[str]:
        """Which of ``keys`` the cache holds now (``EmbeddingCache.contains_many``). Raises CacheUnavailable."""
        return await self.cache.contains_many(keys)

    async def start(self, job: Job, serial: int, room: int) -> Flight:
        """A new flight for ``job`` (an image or a video; none of its key may be in the table), joined by
        request ``serial``. Returns once it is queued or has ended; a caller cancelled meanwhile leaves
        no half-started flight."""
        assert job.key not in self._table
        loop = asyncio.get_running_loop()
        flight = Flight(job, loop.create_future(), loop.create_future(), {serial: room})
        self._table[job.key] = flight  # before any await: concurrent requests join this flight
        await asyncio.shield(self._launch(flight))
        return flight

    def forget(self, gone: Callable[[int, int], bool]) -> int:
        """Drop the interests ``gone(serial, room)`` selects; cancel queued jobs nobody waits for.
        Returns how many jobs were cancelled."""
        cancelled = 0
        for flight in list(self._table.values()):
            for serial, room in list(flight.interests.items()):
                if gone(serial, room):
                    del flight.interests[serial]
            if not flight.interests and flight.owned and self.batcher.cancel(flight.job):
                flight.cancelled = True
                _set(flight.encoded, _CANCELLED)
                cancelled += 1
        return cancelled

    def deliver(self, job: Job, result: ImageEmbedding | str) -> None:
        """The encoder thread's callback (see ``worker.py``): crosses to the event loop."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._delivered, job, result)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    async def renew_claims(self) -> None:
        """Supervised loop: restart the lease of every claim this process holds, every third of it."""
        lease = self.config.claim_lease_s
        while True:
            await asyncio.sleep(lease / 3)
            for key in [key for key, flight in self._table.items() if flight.owned]:
                try:
                    if not await self.cache.renew(key, self.encoder_id, lease):
                        log.warning("lost the claim on image %s (it lapsed or Redis lost it); encoding it anyway", key)
                except CacheUnavailable as exc:
                    log.warning("cannot renew claims: %s", exc)
                    break

    async def shutdown(self) -> None:
        """Cancel every queued job, then give flights ``SHUTDOWN_GRACE_S`` to report and release."""
        self.forget(lambda _serial, _room: True)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=SHUTDOWN_GRACE_S)

    # --- internals -----------------------------------------------------------------------------
    async def _launch(self, flight: Flight) -> None:
        key, lease = flight.job.key, self.config.claim_lease_s
        try:
            owned = (await self.cache.renew(key, self.encoder_id, lease)
                     or await self.cache.claim(key, self.encoder_id, lease))
        except CacheUnavailable as exc:
            self._end(flight, redis_failure(exc))
            return
        except Exception as exc:  # a bug: fail this image, never leave a flight nobody ends
            log.exception("starting the encode of image %s failed", key)
            self._end(flight, Failure(500, f"Internal error: {type(exc).__name__}: {exc}", Code.INTERNAL_ERROR))
            return
        if not owned:
            self._end(flight, PENDING_ELSEWHERE)
            return
        flight.owned = True
        self.batcher.put(flight.job)
        task = asyncio.get_running_loop().create_task(self._complete(flight), name=f"encode-{key[:12]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _delivered(self, job: Job, result: ImageEmbedding | str) -> None:
        flight = self._table.get(job.key)
        if flight is not None and flight.job is job:
            _set(flight.encoded, result)

    async def _complete(self, flight: Flight) -> None:
        """Wait for the encoder thread, then end the claim: the entry written, or the end told."""
        key, outcome = flight.job.key, None
        end, reason = EncodeEnd.SHUTDOWN, "the encoder stopped before it was encoded"
        try:
            try:
                result = await asyncio.wait_for(asyncio.shield(flight.encoded), self.config.encode_timeout_s)
            except TimeoutError:
                self.batcher.cancel(flight.job)
                result = f"not encoded within {self.config.encode_timeout_s:g} s (--encode-timeout-s)"
            if isinstance(result, ImageEmbedding):
                flight.encoded_at = time.monotonic()
                outcome, end, reason = await self._store(key, result)
            else:
                outcome, end, reason = _encode_failure(result, flight.cancelled), _ending(result, flight), result
        finally:
            if end is not EncodeEnd.ENCODED:
                await self._end_claim(key, end, reason)
            self._end(flight, outcome or Failure(500, "The encoder stopped before this image was encoded.",
                                                 Code.ENCODE_FAILED))

    async def _store(self, key: str, embedding: ImageEmbedding) -> tuple[str | Failure, EncodeEnd, str]:
        """Write the entry (the claim ends with it); else the encoder's own answer and how it ended."""
        tensors = {"embeds": embedding.embeds}
        if embedding.deepstack is not None:
            tensors["deepstack"] = embedding.deepstack
        try:
            await self.cache.put(key, tensors, num_tokens=embedding.num_tokens,
                                 image_grid=list(embedding.grid_thw or ()), encoder=self.encoder_id)
        except CacheUnavailable as exc:
            return redis_failure(exc), EncodeEnd.CACHE_REFUSED, f"cache write failed: {exc}"
        except EntryTooLarge as exc:
            return (Failure(500, f"The embedding could not be cached: {exc}", Code.CACHE_ENTRY_TOO_LARGE),
                    EncodeEnd.TOO_LARGE, f"cache write failed: {exc}")
        return ENCODED, EncodeEnd.ENCODED, ""

    async def _end_claim(self, key: str, end: EncodeEnd, reason: str) -> None:
        """``cache.end``, tried twice (a call lost under load would leave the waiters a lapse to find)."""
        for attempt in (1, 2):
            try:
                await self.cache.end(key, self.encoder_id, end, reason)
                return
            except CacheUnavailable as exc:
                log.warning("could not end the claim on image %s (try %d of 2): %s", key, attempt, exc)

    def _end(self, flight: Flight, outcome: str | Failure) -> None:
        if self._table.get(flight.job.key) is flight:
            del self._table[flight.job.key]
        flight.ended_at = time.monotonic()
        _set(flight.result, outcome)


def redis_failure(exc: CacheUnavailable) -> Failure:
    return Failure(503, f"The embedding cache is unavailable: {exc}", Code.CACHE_UNAVAILABLE)


def _ending(reason: str, flight: Flight) -> EncodeEnd:
    """How an encode that gave no embedding ended (``reason``: the encoder thread's, or the timeout's)."""
    if flight.cancelled:
        return EncodeEnd.CANCELLED
    if reason.startswith("not encoded within"):
        return EncodeEnd.TIMED_OUT
    return EncodeEnd.ENCODE_ERROR


def _encode_failure(reason: str, cancelled: bool) -> Failure:
    if cancelled:
        return Failure(409, f"The encode was {reason}.", Code.ROOM_ABORTED)
    if reason.startswith("not encoded within"):
        return Failure(504, f"The image was {reason}.", Code.ENCODE_TIMEOUT)
    return Failure(500, f"The image could not be encoded: {reason}", Code.ENCODE_FAILED)


def _set(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)
