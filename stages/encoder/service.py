"""The encoder's request logic: which images to encode, single flight, writing to the cache, aborts.

For each image of a request (key = ``cache.keys.image_key(bytes, vision_fingerprint)``):

- cached -> ``cached`` (nothing to do);
- already in flight in this process (another request asked first) -> the request joins that flight;
- claimed by this encoder (the router claimed it on its behalf) or claimed now (``claim``, NX) ->
  a new flight: preprocessed, queued for the encoder thread, written with ``put``, claim released;
- claimed by someone else -> ``pending_elsewhere`` (a prefill waits for it with ``wait_ready``).

A flight is this process's work on one key, from the claim to the release; every request that
needs the key waits on the same flight, so N requests for one image cost one encode here, and the
claim makes it one encode across encoders. While a flight is queued or running its claim is renewed
every third of ``claim_lease_s``; if this process dies the claim lapses and waiters are told. A
failed flight publishes the failure (``publish_failed``) before it releases the claim.

Interest: a flight knows which requests (and rooms) wait for it. When the last one goes (its room
aborted, its deadline passed) and the job is still queued, the job is cancelled. Work already
running finishes and is cached: it cannot be interrupted and is useful to the next request.

Deadlines: a request returns within ``encode_timeout_s`` (504 after it); a flight whose image is
not encoded within ``encode_timeout_s`` fails; every Redis call has the cache's deadline (503).
Everything here runs on the server's event loop, except the encoder thread's ``deliver``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from PIL import Image

from cache.errors import CacheUnavailable, EntryTooLarge
from cache.store import EmbeddingCache
from stages.api.errors import APIError, bad_request
from stages.api.images import open_image
from stages.config import EncoderConfig, ImageLimits
from stages.encoder.batcher import Batcher, Job, RecentRooms
from stages.engine.models.base import ModelAdapter
from stages.engine.multimodal import ImageEmbedding, ImageInput
from stages.prompt import preprocess_image
from stages.supervisor import Supervisor

log = logging.getLogger(__name__)
ENCODED, CACHED, PENDING_ELSEWHERE = "encoded", "cached", "pending_elsewhere"
_CANCELLED = "cancelled: every request waiting for this image went away (room aborted or deadline passed)"
SHUTDOWN_GRACE_S = 3.0  # at shutdown, how long flights get to report their end before they are abandoned


@dataclass(frozen=True)
class Upload:
    """One image of an encode request: its bytes (decoded from base64) and its cache key."""

    key: str
    data: bytes


@dataclass(frozen=True)
class ImageResult:
    key: str
    status: str  # ENCODED | CACHED | PENDING_ELSEWHERE
    num_tokens: int | None  # the embedding's rows, for ENCODED
    seconds: float  # request arrival -> the embedding is in the cache, for ENCODED


@dataclass(frozen=True)
class Failure:
    """Why a flight ended without an entry: becomes an APIError naming each request's own image."""

    status: int
    message: str
    code: str


@dataclass(eq=False)
class Flight:
    job: Job
    encoded: asyncio.Future  # ImageEmbedding | str (why not): set by the encoder thread, or on cancel
    result: asyncio.Future  # ImageResult status (str) | Failure: set once the flight has ended
    interests: dict[int, int] = field(default_factory=dict)  # request serial -> room
    owned: bool = False  # this process holds the key's claim
    cancelled: bool = False
    ended_at: float = 0.0


@dataclass
class _Request:
    room: int
    aborted: asyncio.Future


class EncodeService:
    def __init__(self, config: EncoderConfig, limits: ImageLimits, cache: EmbeddingCache, batcher: Batcher,
                 adapter: ModelAdapter, image_processor, encoder_id: str) -> None:  # type: ignore[no-untyped-def]
        self.config = config
        self.limits = limits
        self.cache = cache
        self.batcher = batcher
        self.adapter = adapter
        self.image_processor = image_processor
        self.encoder_id = encoder_id
        self._flights: dict[str, Flight] = {}
        self._requests: dict[int, _Request] = {}
        self._serials = itertools.count()
        self._aborted = RecentRooms()
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- requests ------------------------------------------------------------------------------
    async def encode(self, room: int, uploads: list[Upload]) -> list[ImageResult]:
        """Make every image of ``uploads`` cached or pending elsewhere; one result per upload, in
        order. Raises APIError: 400/413 for a bad image (before anything is claimed), 409 if the room
        is aborted, 503 naming Redis, 500 if an encode failed, 504 past ``encode_timeout_s``."""
        if room in self._aborted:
            raise room_aborted(room)
        start = time.monotonic()
        serial = next(self._serials)
        self._requests[serial] = _Request(room, asyncio.get_running_loop().create_future())
        try:
            async with asyncio.timeout(self.config.encode_timeout_s):
                statuses = await self._encode(serial, room, uploads)
        except TimeoutError:
            raise APIError(504, f"The images were not encoded within {self.config.encode_timeout_s:g} s "
                           "(--encode-timeout-s).", code="encode_timeout") from None
        finally:
            del self._requests[serial]
            self._forget(lambda s, _room: s == serial)
        return [_result(u.key, statuses[u.key], start) for u in uploads]

    def abort(self, room: int) -> int:
        """Cancel ``room``: its waiting requests answer 409, later ones are refused, and queued work
        no other room waits for is cancelled. Returns how many images were cancelled."""
        self._aborted.add(room)
        for request in self._requests.values():
            if request.room == room and not request.aborted.done():
                request.aborted.set_result(None)
        return self._forget(lambda _serial, r: r == room)

    async def _encode(self, serial: int, room: int, uploads: list[Upload]) -> dict[str, tuple]:
        first = {u.key: u for u in reversed(uploads)}  # one upload per key
        cached = await self._cache_call(self.cache.contains_many(first))
        todo = [first[key] for key in dict.fromkeys(u.key for u in uploads) if key not in cached]
        fresh = [u for u in todo if u.key not in self._flights]
        inputs = dict(zip([u.key for u in fresh], await asyncio.to_thread(self._prepare_all, fresh, uploads)))
        flights: dict[str, Flight] = {}
        for upload in todo:
            flights[upload.key] = await self._join(serial, room, upload, inputs, uploads)
        await self._wait(serial, room, list(flights.values()))
        statuses: dict[str, tuple] = {key: (CACHED, None, 0.0) for key in cached}
        for key, flight in flights.items():
            outcome = flight.result.result()
            if isinstance(outcome, Failure):
                index = next(i for i, u in enumerate(uploads) if u.key == key)
                raise APIError(outcome.status, outcome.message, param=f"images[{index}]", code=outcome.code)
            statuses[key] = (outcome, flight.job.image.num_tokens if outcome == ENCODED else None, flight.ended_at)
        return statuses

    async def _join(self, serial: int, room: int, upload: Upload, inputs: dict[str, ImageInput],
                    uploads: list[Upload]) -> Flight:
        """This process's flight for ``upload.key``, joined by request ``serial``: an existing one, or
        a new one if the key's claim is (or becomes) this encoder's."""
        while (flight := self._flights.get(upload.key)) is not None and flight.cancelled:
            await asyncio.shield(flight.result)  # a cancelled flight is ending: start afresh after it
        if flight is not None:
            flight.interests[serial] = room
            return flight
        image = inputs.get(upload.key) or (await asyncio.to_thread(self._prepare_all, [upload], uploads))[0]
        if (flight := self._flights.get(upload.key)) is not None:  # another request started it meanwhile
            flight.interests[serial] = room
            return flight
        loop = asyncio.get_running_loop()
        flight = Flight(Job(upload.key, image), loop.create_future(), loop.create_future(), {serial: room})
        self._flights[upload.key] = flight  # before any await: concurrent requests join this flight
        await asyncio.shield(self._launch(flight))  # a request that gives up meanwhile leaves no half-started flight
        return flight

    async def _launch(self, flight: Flight) -> None:
        """Claim the flight's key (or find this encoder already holds it) and queue its job; else end
        the flight: pending elsewhere, or 503 if Redis cannot answer."""
        key, lease = flight.job.key, self.config.claim_lease_s
        try:
            owned = (await self.cache.renew(key, self.encoder_id, lease)
                     or await self.cache.claim(key, self.encoder_id, lease))
        except CacheUnavailable as exc:
            self._end(flight, _redis_failure(exc))
            return
        except Exception as exc:  # a bug: fail this image, never leave a flight nobody ends
            log.exception("starting the encode of image %s failed", key)
            self._end(flight, Failure(500, f"Internal error: {type(exc).__name__}: {exc}", "internal_error"))
            return
        if not owned:
            self._end(flight, PENDING_ELSEWHERE)
            return
        flight.owned = True
        self.batcher.put(flight.job)
        task = asyncio.get_running_loop().create_task(self._complete(flight), name=f"encode-{key[:12]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wait(self, serial: int, room: int, flights: list[Flight]) -> None:
        """Until every flight has ended; 409 at once if the room is aborted meanwhile."""
        aborted = self._requests[serial].aborted
        while pending := [f.result for f in flights if not f.result.done()]:
            await asyncio.wait([*pending, aborted], return_when=asyncio.FIRST_COMPLETED)
            if aborted.done():
                raise room_aborted(room)
        if aborted.done():
            raise room_aborted(room)

    # --- flights -------------------------------------------------------------------------------
    def deliver(self, job: Job, result: ImageEmbedding | str) -> None:
        """The encoder thread's callback (see ``worker.py``): crosses to the event loop."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._delivered, job, result)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def _delivered(self, job: Job, result: ImageEmbedding | str) -> None:
        flight = self._flights.get(job.key)
        if flight is not None and flight.job is job:
            _set(flight.encoded, result)

    async def _complete(self, flight: Flight) -> None:
        """Wait for the encoder thread, write the entry (or report the failure), release the claim."""
        key, outcome = flight.job.key, None
        try:
            try:
                result = await asyncio.wait_for(asyncio.shield(flight.encoded), self.config.encode_timeout_s)
            except TimeoutError:
                self.batcher.cancel(flight.job)
                result = f"not encoded within {self.config.encode_timeout_s:g} s (--encode-timeout-s)"
            if isinstance(result, ImageEmbedding):
                outcome = await self._store(key, result)
            else:
                outcome = _encode_failure(result, cancelled=flight.cancelled)
                await self._quietly("report the failure", self.cache.publish_failed(key, result))
        finally:
            await self._quietly("release the claim", self.cache.release(key, self.encoder_id))
            self._end(flight, outcome or Failure(500, "The encoder stopped before this image was encoded.",
                                                 "encode_failed"))

    async def _store(self, key: str, embedding: ImageEmbedding) -> str | Failure:
        tensors = {"embeds": embedding.embeds}
        if embedding.deepstack is not None:
            tensors["deepstack"] = embedding.deepstack
        try:
            await self.cache.put(key, tensors, num_tokens=embedding.num_tokens,
                                 image_grid=list(embedding.grid_thw or ()), encoder=self.encoder_id)
        except (CacheUnavailable, EntryTooLarge) as exc:
            await self._quietly("report the failure", self.cache.publish_failed(key, f"cache write failed: {exc}"))
            if isinstance(exc, CacheUnavailable):
                return _redis_failure(exc)
            return Failure(500, f"The embedding could not be cached: {exc}", "cache_entry_too_large")
        return ENCODED

    def _end(self, flight: Flight, outcome: str | Failure) -> None:
        if self._flights.get(flight.job.key) is flight:
            del self._flights[flight.job.key]
        flight.ended_at = time.monotonic()
        _set(flight.result, outcome)

    def _forget(self, gone: Callable[[int, int], bool]) -> int:
        """Drop the interests ``gone(serial, room)`` selects; cancel queued jobs nobody waits for."""
        cancelled = 0
        for flight in list(self._flights.values()):
            for serial, room in list(flight.interests.items()):
                if gone(serial, room):
                    del flight.interests[serial]
            if not flight.interests and flight.owned and self.batcher.cancel(flight.job):
                flight.cancelled = True
                _set(flight.encoded, _CANCELLED)
                cancelled += 1
        return cancelled

    def start(self, supervisor: Supervisor) -> None:
        """Call once from the server's event loop (lifespan), before the first request."""
        self._loop = asyncio.get_running_loop()
        supervisor.spawn("claim renewal", self.renew_claims())

    async def renew_claims(self) -> None:
        """Supervised loop: restart the lease of every claim this process holds, every third of it."""
        lease = self.config.claim_lease_s
        while True:
            await asyncio.sleep(lease / 3)
            for key in [key for key, flight in self._flights.items() if flight.owned]:
                try:
                    if not await self.cache.renew(key, self.encoder_id, lease):
                        log.warning("lost the claim on image %s (it lapsed or Redis lost it); encoding it anyway", key)
                except CacheUnavailable as exc:
                    log.warning("cannot renew claims: %s", exc)
                    break

    async def shutdown(self) -> None:
        """Cancel every queued job, then give flights ``SHUTDOWN_GRACE_S`` to report and release."""
        self._forget(lambda _serial, _room: True)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=SHUTDOWN_GRACE_S)

    # --- helpers -------------------------------------------------------------------------------
    def _prepare_all(self, fresh: list[Upload], uploads: list[Upload]) -> list[ImageInput]:
        """Decode and preprocess (runs in a worker thread); 400/413 naming the first bad image."""
        inputs = []
        for upload in fresh:
            param = f"images[{uploads.index(upload)}]"
            image = open_image(upload.data, self.limits, param)
            inputs.append(_preprocess(self.image_processor, self.adapter, image, param))
        return inputs

    async def _cache_call(self, call):  # type: ignore[no-untyped-def]
        try:
            return await call
        except CacheUnavailable as exc:
            failure = _redis_failure(exc)
            raise APIError(failure.status, failure.message, code=failure.code) from None

    async def _quietly(self, what: str, call) -> None:  # type: ignore[no-untyped-def]
        try:
            await call
        except CacheUnavailable as exc:
            log.warning("could not %s: %s", what, exc)


def room_aborted(room: int) -> APIError:
    return APIError(409, f"Room {room} was aborted on this encoder.", param="room", code="room_aborted")


def _result(key: str, status: tuple, start: float) -> ImageResult:
    kind, num_tokens, ended_at = status
    return ImageResult(key, kind, num_tokens, round(max(0.0, ended_at - start), 6) if kind == ENCODED else 0.0)


def _preprocess(image_processor, adapter: ModelAdapter, image: Image.Image, param: str) -> ImageInput:  # type: ignore[no-untyped-def]
    try:
        return preprocess_image(image_processor, adapter, image)
    except ValueError as exc:  # e.g. an aspect ratio the processor refuses
        raise bad_request(f"The image processor refused the image: {exc}", param, "invalid_image") from None


def _redis_failure(exc: CacheUnavailable) -> Failure:
    return Failure(503, f"The embedding cache is unavailable: {exc}", "cache_unavailable")


def _encode_failure(reason: str, cancelled: bool) -> Failure:
    if cancelled:
        return Failure(409, f"The encode was {reason}.", "room_aborted")
    if reason.startswith("not encoded within"):
        return Failure(504, f"The image was {reason}.", "encode_timeout")
    return Failure(500, f"The image could not be encoded: {reason}", "encode_failed")


def _set(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)
