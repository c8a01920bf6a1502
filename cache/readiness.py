"""Wake-ups for keys being encoded: one pub/sub connection per ``EmbeddingCache``, one dispatcher task.

Every cache write publishes ``Event(kind="ready", key)`` on ``scripts.CHANNEL`` from inside the write
script (so the entry is readable before anyone hears of it); an encoder whose encode failed publishes
``Event(kind="failed", key, reason)``, and one that gave the encode up unfinished as nobody wants it
any more (or the router, for an encoder that refused its request), ``kind="abandoned"``. The
dispatcher reads the channel and wakes the ``Waiter``s registered for that key. One channel for all
keys: a process subscribes once, not once per waiter.

No lost wake-ups: a waiter registers, then (``ensure_subscribed``) makes sure the subscription is
confirmed by Redis, and only then checks the key. An event that lands after the registration sets
the waiter's flag, whether the waiter is sleeping yet or not. While the connection is down events can
be lost, so every (re)connection and every disconnection wakes all waiters to check their key again
(a waiter's check then fails fast with ``CacheUnavailable`` if Redis is down).

The dispatcher owns its own Redis client with no retries: it notices a broken connection, waits
(backoff up to 1 s, cut short when a waiter needs the subscription) and reconnects and re-subscribes
by itself; nothing needs a restart.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from cache.config import CacheConfig
from cache.errors import CacheUnavailable
from cache.scripts import CHANNEL
from contract.claims import EventKind

log = logging.getLogger(__name__)
_BACKOFF_S = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_IDLE_READ_S = 1.0  # how long one read of the channel blocks before looping (and noticing close)


class Event(msgspec.Struct, frozen=True):
    """A message on ``scripts.CHANNEL``: ``key`` is ready (in the cache), its encode failed, or it
    was given up unfinished."""

    kind: EventKind  # the state the key entered (``contract.claims.ClaimState.event``)
    key: str
    reason: str = ""


_encode_event = msgspec.json.Encoder().encode
_decode_event = msgspec.json.Decoder(Event).decode


def encode_event(event: Event) -> bytes:
    return _encode_event(event)


class Waiter:
    """One waiter's mailbox. ``failure`` is set (and sticks) when the key's encode was reported
    failed or abandoned: the first such event."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.failure: Event | None = None
        self._flag = asyncio.Event()

    def wake(self, failure: Event | None = None) -> None:
        if failure is not None and self.failure is None:
            self.failure = failure
        self._flag.set()

    async def sleep(self, timeout_s: float) -> None:
        """Return when woken (since the last ``sleep``) or after ``timeout_s``; clears the flag."""
        if timeout_s > 0:
            try:
                await asyncio.wait_for(self._flag.wait(), timeout_s)
            except TimeoutError:
                pass
        self._flag.clear()


class ReadyEvents:
    """The dispatcher. Created by ``EmbeddingCache``; started on the first ``ensure_subscribed``
    (which needs a running event loop), stopped by ``aclose``. Used from one event loop only."""

    def __init__(self, config: CacheConfig) -> None:
        self._config = config
        self._waiters: dict[str, set[Waiter]] = {}
        self._subscribed = asyncio.Event()
        self._retry_now = asyncio.Event()  # set by a caller that needs the subscription: skip the backoff
        self._last_error = "not connected yet"
        self._task: asyncio.Task[None] | None = None
        self._redis = aioredis.Redis.from_url(
            config.url, retry=Retry(NoBackoff(), 0), socket_timeout=config.op_timeout_s,
            socket_connect_timeout=config.op_timeout_s)

    def register(self, key: str) -> Waiter:
        waiter = Waiter(key)
        self._waiters.setdefault(key, set()).add(waiter)
        return waiter

    def unregister(self, waiter: Waiter) -> None:
        waiters = self._waiters.get(waiter.key)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[waiter.key]

    async def ensure_subscribed(self, timeout_s: float) -> None:
        """Return once the channel subscription is confirmed; ``CacheUnavailable`` after ``timeout_s``."""
        if self._task is None or self._task.done():  # first use, or the dispatcher died of a bug
            if self._task is not None and not self._task.cancelled() and self._task.exception() is not None:
                log.error("cache events: the dispatcher failed; restarting it", exc_info=self._task.exception())
            self._subscribed.clear()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="epd-cache-events")
        if self._subscribed.is_set():
            return
        self._retry_now.set()
        try:
            await asyncio.wait_for(self._subscribed.wait(), timeout_s)
        except TimeoutError:
            raise CacheUnavailable(f"Redis at {self._config.safe_url}: cannot subscribe to {CHANNEL} "
                                   f"within {timeout_s:g} s ({self._last_error})") from None

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._redis.aclose()

    async def _run(self) -> None:
        attempt = 0
        while True:
            pubsub = self._redis.pubsub()
            try:
                await asyncio.wait_for(self._subscribe(pubsub), self._config.op_timeout_s)
                attempt = 0
                self._subscribed.set()
                self._wake_all()  # events may have been missed while not subscribed
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=_IDLE_READ_S)
                    if message is not None and message["type"] == "message":
                        self._dispatch(message["data"])
            except (RedisError, OSError, TimeoutError) as exc:
                self._last_error = f"{type(exc).__name__}: {exc}"
                if self._subscribed.is_set():
                    log.warning("cache events: lost Redis at %s (%s); reconnecting", self._config.safe_url, exc)
                self._subscribed.clear()
                self._wake_all()
            finally:
                await _close_quietly(pubsub)
            await self._backoff(attempt)
            attempt += 1

    async def _backoff(self, attempt: int) -> None:
        """Sleep before reconnecting, shorter if a caller is waiting for the subscription."""
        self._retry_now.clear()
        try:
            await asyncio.wait_for(self._retry_now.wait(), _BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
        except TimeoutError:
            pass

    async def _subscribe(self, pubsub: aioredis.client.PubSub) -> None:
        await pubsub.subscribe(CHANNEL)
        while True:  # the confirmation: from here on, Redis delivers every event to this connection
            message = await pubsub.get_message(timeout=self._config.op_timeout_s)
            if message is not None and message["type"] == "subscribe":
                return

    def _dispatch(self, data: bytes) -> None:
        try:
            event = _decode_event(data)
        except msgspec.DecodeError:
            log.warning("cache events: ignored a malformed message on %s: %r", CHANNEL, data[:200])
            return
        for waiter in self._waiters.get(event.key, ()):
            waiter.wake(event if event.kind != "ready" else None)

    def _wake_all(self) -> None:
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.wake()


async def _close_quietly(pubsub: aioredis.client.PubSub) -> None:
    try:
        await asyncio.wait_for(pubsub.aclose(), 1.0)
    except (RedisError, OSError, TimeoutError):
        pass
