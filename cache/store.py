"""``EmbeddingCache``: the embedding cache over one Redis, for encoders (put, claims) and prefills
(get, wait_ready) and the router (contains_many and claim_many, or both at once: lookup_claim).

Contract for every async method: it returns or raises within its deadline (``op_timeout_s`` per
Redis call; ``deadline_s`` for ``wait_ready``). Redis being down, slow or refusing raises
``CacheUnavailable`` with a message naming Redis and its URL. After Redis comes back the same object
works again (the pool reconnects; the pub/sub dispatcher reconnects and re-subscribes). A Redis that
lost its data only causes misses. A stored entry that does not decode or does not match its payload
is a miss and is deleted (``stats().repairs``), never returned.

Keys are ``cache.keys.image_key`` values (ValueError for anything else). The key layout, budget and
TTL mechanics are in ``cache.scripts``. Create one ``EmbeddingCache`` per process and event loop;
close it with ``aclose`` (or ``async with``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from cache import scripts
from cache.config import CacheConfig
from cache.entry import Entry, InRedis, decode_entry, encode_entry, pack, unpack
from cache.errors import (CacheUnavailable, CorruptEntry, EncodeAbandoned, EncodeFailed, EntryTooLarge, NotPending,
                          ReadyTimeout)
from cache.keys import check_key
from cache.readiness import Event, ReadyEvents, Waiter, encode_event
from contract.claims import HELD, ClaimState, EncodeEnd, ending_state, lapsed

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
T = TypeVar("T")
_BOOKKEEPING = [scripts.LRU, scripts.SIZES, scripts.BYTES]

# Redis refuses a bulk string over proto-max-bulk-len (512 MB by default): an entry's payload is one value.
# A video's entry can reach it (e.g. 256 frames of Qwen2.5-VL-7B at its per-frame pixel bound).
MAX_VALUE_BYTES = 512 * 2**20


class Lookup(IntEnum):
    """What ``EmbeddingCache.lookup_claim`` found of one key (the values its Lua script answers)."""

    PENDING = 0  # another owner holds the claim: it is being encoded there
    CLAIMED = 1  # claimed now for the owner given: it must encode it
    CACHED = 2  # the entry is there (touched)


@dataclass(frozen=True)
class CachedEmbedding:
    """A hit: the entry and its tensors (host memory, owned by the caller)."""

    entry: Entry
    tensors: dict[str, torch.Tensor]


@dataclass
class CacheStats:
    """Counts of this process since start. ``hits``/``misses``: keys looked up by ``get``,
    ``contains_many`` and ``wait_ready`` (a wait that had to wait is a miss). ``evictions``: entries
    this process's writes evicted for the budget; ``expired``: stale entries its writes swept;
    ``repairs``: dangling, half or corrupt entries its reads found and dropped (``contains_many``
    drops dangling ones too, uncounted). ``claims``: claims this process won (it had to encode);
    ``unavailable``: Redis calls that failed or timed out (each raised ``CacheUnavailable``).
    ``stored_bytes``: the shared byte count as of this process's last Redis call (all processes together)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expired: int = 0
    repairs: int = 0
    claims: int = 0
    unavailable: int = 0
    stored_bytes: int = 0


class EmbeddingCache:
    def __init__(self, config: CacheConfig) -> None:
        """No I/O here: the pool connects on first use."""
        self.config = config
        pool = aioredis.BlockingConnectionPool.from_url(
            config.url, max_connections=config.max_connections, timeout=config.op_timeout_s,
            socket_timeout=config.op_timeout_s, socket_connect_timeout=config.op_timeout_s,
            retry=Retry(NoBackoff(), 1))  # one retry: a pooled connection may predate a Redis restart
        self._redis = aioredis.Redis(connection_pool=pool)
        self._events = ReadyEvents(config)
        self._read = self._redis.register_script(scripts.READ)
        self._put = self._redis.register_script(scripts.PUT)
        self._contains = self._redis.register_script(scripts.CONTAINS)
        self._delete = self._redis.register_script(scripts.DELETE)
        self._claim = self._redis.register_script(scripts.CLAIM)
        self._claim_many = self._redis.register_script(scripts.CLAIM_MANY)
        self._lookup_claim = self._redis.register_script(scripts.LOOKUP_CLAIM)
        self._end = self._redis.register_script(scripts.END)
        self._abandon = self._redis.register_script(scripts.ABANDON)
        self._renew = self._redis.register_script(scripts.RENEW)
        self._stats = CacheStats()

    async def __aenter__(self) -> EmbeddingCache:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the dispatcher and close every connection. Waiters still running fail."""
        await self._events.aclose()
        await self._redis.aclose(close_connection_pool=True)

    def stats(self) -> CacheStats:
        """A snapshot (a copy) of this process's counts."""
        return dataclasses.replace(self._stats)

    # --- reads -----------------------------------------------------------------------------------
    async def get(self, key: str) -> CachedEmbedding | None:
        """The entry and tensors of ``key``, or None (miss). A hit refreshes its LRU place and TTL."""
        hit, _ = await self._probe(check_key(key))
        self._count(hits=hit is not None)
        return hit

    async def contains_many(self, keys: Iterable[str]) -> set[str]:
        """The subset of ``keys`` that is cached now. Found entries are touched (LRU and TTL), as
        they are about to be used; an entry can still be evicted before it is read."""
        members = sorted({check_key(k) for k in keys})
        if not members:
            return set()
        found = await self._call("check keys", lambda: self._contains(
            keys=_BOOKKEEPING, args=[scripts.ENTRY_PREFIX, self.config.ttl_ms, *members]))
        present = {m for m, flag in zip(members, found, strict=True) if flag}
        self._stats.hits += len(present)
        self._stats.misses += len(members) - len(present)
        return present

    async def stored_bytes(self) -> int:
        """Bytes of all entries (metadata + payload), as counted against the budget."""
        value = await self._call("read the byte count", lambda: self._redis.get(scripts.BYTES))
        self._stats.stored_bytes = int(value or 0)
        return self._stats.stored_bytes

    # --- writes ----------------------------------------------------------------------------------
    async def put(self, key: str, tensors: dict[str, torch.Tensor], *, num_tokens: int,
                  image_grid: Sequence[int], encoder: str) -> Entry:
        """Store ``tensors`` (dtypes in ``entry.DTYPES``) under ``key`` with its metadata, replacing any
        entry of that key; evicts least-recently-used entries first if the budget needs it, drops the
        claim on ``key`` if ``encoder`` holds it, and wakes every waiter on ``key``, all in one step
        (``contract.claims``: Encoding -> Cached). ``EntryTooLarge`` if the entry alone exceeds the
        budget or its payload Redis's largest value (``MAX_VALUE_BYTES``) (then nothing changes). The caller keeps its tensors (they are copied)."""
        check_key(key)
        if num_tokens < 0 or any(not isinstance(n, int) or n < 0 for n in image_grid):
            raise ValueError(f"num_tokens and image_grid must be non-negative ints, got {num_tokens}, {image_grid}")
        specs, payload = pack(tensors)
        if len(payload) > MAX_VALUE_BYTES:
            raise EntryTooLarge(f"an embedding of {len(payload)} bytes is over Redis's {MAX_VALUE_BYTES} bytes per "
                                "value (proto-max-bulk-len); a video this large needs fewer frames or pixels "
                                "(--max-video-frames, --mm-processor-kwargs)")
        now = time.time()
        entry = Entry(key, specs, num_tokens, list(image_grid), len(payload), encoder, now, now, InRedis())
        meta = encode_entry(entry)
        reply = await self._call("write", lambda: self._put(
            keys=[*_BOOKKEEPING, scripts.entry_key(key), scripts.claim_key(key)],
            args=[scripts.ENTRY_PREFIX, key, meta, payload, self.config.ttl_ms, self.config.budget_bytes,
                  scripts.CHANNEL, encode_event(Event("ready", key)), encoder]))
        evicted, expired, self._stats.stored_bytes, _ = (int(x) for x in reply)
        if evicted < 0:
            raise EntryTooLarge(f"an embedding of {len(meta) + len(payload)} bytes does not fit in the cache budget "
                                f"of {self.config.budget_bytes} bytes; raise --cache-budget-mib")
        self._stats.evictions += evicted
        self._stats.expired += expired
        return entry

    async def delete(self, key: str) -> bool:
        """Drop ``key``'s entry and bookkeeping; True if an entry was there."""
        return bool(await self._call("delete", lambda: self._delete(
            keys=_BOOKKEEPING, args=[scripts.ENTRY_PREFIX, check_key(key)])))

    # --- single flight ---------------------------------------------------------------------------
    async def claim(self, key: str, owner: str, lease_s: float) -> bool:
        """True: ``owner`` must encode ``key`` now, renew the claim within ``lease_s``, then ``put`` (or
        ``end``). False: the key is cached or another owner is encoding it; ``wait_ready`` gives the
        result. A claim lapses ``lease_s`` after its last renewal."""
        won = bool(await self._call("claim", lambda: self._claim(
            keys=[scripts.claim_key(check_key(key)), scripts.entry_key(key)], args=[owner, _ms(lease_s)])))
        self._stats.claims += won
        return won

    async def claim_many(self, claims: Sequence[tuple[str, str]], lease_s: float, tag: str = "",
                         takeover: Collection[str] = ()) -> list[bool]:
        """``claim`` of each (key, owner) in ``claims`` on the owner's behalf (``Claimed`` until the owner
        ``renew``s it), in one Redis call (one round trip); the answers in order. ``tag`` (the
        request's room) marks these claims: ``abandon`` with another tag leaves them alone. A claim
        held by an owner in ``takeover`` (encoders the caller will not send to) is taken for the new
        owner (``contract.claims``)."""
        if not claims:
            return []
        keys = [k for key, _ in claims for k in (scripts.claim_key(check_key(key)), scripts.entry_key(key))]
        won = [bool(x) for x in await self._call("claim", lambda: self._claim_many(
            keys=keys, args=[_ms(lease_s), _tag(tag), len(takeover), *takeover, *(owner for _, owner in claims)]))]
        self._stats.claims += sum(won)
        return won

    async def lookup_claim(self, claims: Sequence[tuple[str, str]], lease_s: float, tag: str = "",
                           takeover: Collection[str] = ()) -> list[Lookup]:
        """``contains_many`` and ``claim_many`` of each (key, owner) in ``claims`` (distinct keys) in one
        Redis call, for a caller that knows each key's owner before it knows what is cached (the
        router with a key-hashing encoder policy): ``CACHED`` (touched, as ``contains_many`` does),
        ``CLAIMED`` for its owner (with ``tag``; a claim held by an owner in ``takeover`` is taken,
        as ``claim_many`` does), or ``PENDING`` (another owner is encoding it); in order."""
        if not claims:
            return []
        members = [check_key(key) for key, _ in claims]
        if len(set(members)) != len(members):
            raise ValueError("lookup_claim takes distinct keys")
        found = [Lookup(int(x)) for x in await self._call("look up and claim", lambda: self._lookup_claim(
            keys=[*_BOOKKEEPING, *(scripts.claim_key(m) for m in members)],
            args=[scripts.ENTRY_PREFIX, self.config.ttl_ms, _ms(lease_s), _tag(tag), len(takeover), *takeover,
                  *(v for m, (_, owner) in zip(members, claims) for v in (m, owner))]))]
        hits = found.count(Lookup.CACHED)
        self._stats.hits += hits
        self._stats.misses += len(found) - hits
        self._stats.claims += found.count(Lookup.CLAIMED)
        return found

    async def renew(self, key: str, owner: str, lease_s: float) -> bool:
        """Restart ``owner``'s lease on ``key``; False if it no longer holds the claim."""
        return bool(await self._call("renew claim", lambda: self._renew(
            keys=[scripts.claim_key(check_key(key))], args=[owner, _ms(lease_s)])))

    async def abandon(self, keys: Sequence[str], owner: str, reason: str, tag: str = "") -> int:
        """Release each claim on ``keys`` taken with ``tag`` for ``owner`` (``claim_many``,
        ``lookup_claim``) that ``owner`` has not taken up, waking each key's waiters with
        ``EncodeAbandoned(reason)``, in one Redis call; for a caller that claimed keys for an owner
        that will not encode them (the router, for an encoder that refused or never got its request).
        Any other claim (taken up, another owner's, or taken anew for another request after this one
        lapsed) is left alone. Returns how many were released."""
        if not keys:
            return 0
        kind = ending_state(EncodeEnd.REFUSED).event
        events = [encode_event(Event(kind, check_key(key), reason)) for key in keys]
        return int(await self._call("abandon claims", lambda: self._abandon(
            keys=[scripts.claim_key(key) for key in keys], args=[owner, _tag(tag), scripts.CHANNEL, *events])))

    async def end(self, key: str, owner: str, end: EncodeEnd, reason: str) -> ClaimState:
        """``owner``'s encode of ``key`` ended without an entry, as ``end`` says: in one Redis call its
        claim is dropped and every waiter (in every process) hears it, as ``EncodeAbandoned(reason)``
        or ``EncodeFailed(reason)`` (``contract.claims.ending_state``). A claim that lapsed meanwhile
        is told all the same; one another owner holds now is left alone, and its waiters hear
        nothing. The state the key ended in (``Abandoned`` or ``Failed``), or ``Claimed`` when it was
        another owner's."""
        state = ending_state(end)
        if state is ClaimState.Cached:
            raise ValueError("an encode that wrote its entry ends with put, not end")
        event = encode_event(Event(state.event, check_key(key), reason))
        told = int(await self._call("end the claim", lambda: self._end(
            keys=[scripts.claim_key(key)], args=[owner, scripts.CHANNEL, event])))
        return state if told else ClaimState.Claimed

    # --- readiness -------------------------------------------------------------------------------
    async def wait_ready(self, key: str, deadline_s: float) -> CachedEmbedding:
        """The entry of ``key`` once it is cached, waiting while an encoder holds a claim on it.

        Raises, within ``deadline_s`` in every case: ``NotPending`` at once if ``key`` is neither
        cached nor claimed; ``EncodeFailed`` when the encoder publishes a failure, or when the claim
        lapses without an entry (noticed within ``claim_check_s``); ``EncodeAbandoned`` when the
        encode is published as given up (``abandon``, ``end`` of a back-pressure end); ``ReadyTimeout``
        at the deadline; ``CacheUnavailable`` if Redis fails. Woken by the put's event, not by polling.
        """
        check_key(key)
        waiter = self._events.register(key)
        try:
            async with asyncio.timeout(deadline_s):
                await self._events.ensure_subscribed(self.config.op_timeout_s)
                return await self._wait(key, waiter)
        except TimeoutError:
            raise ReadyTimeout(f"image {key} was not encoded within {deadline_s:g} s") from None
        finally:
            self._events.unregister(waiter)

    async def _wait(self, key: str, waiter: Waiter) -> CachedEmbedding:
        """The probe first, then sleep and probe again until the entry lands. A key found neither
        cached nor claimed ends the wait, as the event that says why (heard by now, though the
        probe's answer came first), as ``NotPending`` at once, or as a lapsed claim
        (``contract.claims.lapsed`` of the claim's state seen last)."""
        hit, state = await self._probe(key)
        self._count(hits=hit is not None)
        if hit is None and state not in HELD:
            _raise_ended(key, waiter)
            raise NotPending(f"image {key} is not in the cache and no encoder is encoding it")
        while hit is None:
            await waiter.sleep(self.config.claim_check_s)
            _raise_ended(key, waiter)
            last = state
            hit, state = await self._probe(key)
            if hit is None and state not in HELD:
                _raise_ended(key, waiter)
                raise _lapsed(key, last)
        return hit

    # --- internals -------------------------------------------------------------------------------
    async def _probe(self, key: str) -> tuple[CachedEmbedding | None, ClaimState]:
        """(hit or None, the claim's state: ``Unclaimed``, ``Claimed`` or ``Encoding``; ``Unclaimed`` with a
        hit). Corrupt entries are deleted and reported as misses."""
        reply = await self._call("read", lambda: self._read(
            keys=[*_BOOKKEEPING, scripts.entry_key(key), scripts.claim_key(key)],
            args=[scripts.ENTRY_PREFIX, key, self.config.ttl_ms]))
        if int(reply[0]) == 0:
            self._stats.repairs += int(reply[2])
            self._stats.stored_bytes = int(reply[3])
            return None, ClaimState(int(reply[1]))
        self._stats.stored_bytes = int(reply[4])
        try:
            entry = decode_entry(reply[1])
            if entry.key != key:
                raise CorruptEntry(f"entry stored under {key} names key {entry.key}")
            tensors = unpack(entry, reply[2])
        except CorruptEntry as exc:
            log.warning("embedding cache: dropping a corrupt entry: %s", exc)
            await self.delete(key)
            self._stats.repairs += 1
            return None, ClaimState.Unclaimed
        entry = msgspec.structs.replace(entry, last_used_at=int(reply[3]) / 1e6)
        return CachedEmbedding(entry, tensors), ClaimState.Unclaimed

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis call under ``op_timeout_s``; any Redis or network failure -> CacheUnavailable."""
        try:
            async with asyncio.timeout(self.config.op_timeout_s):
                return await call()
        except TimeoutError:
            self._stats.unavailable += 1
            raise CacheUnavailable(f"Redis at {self.config.safe_url}: {what} got no answer within "
                                   f"{self.config.op_timeout_s:g} s") from None
        except (RedisError, OSError) as exc:
            self._stats.unavailable += 1
            raise CacheUnavailable(f"Redis at {self.config.safe_url}: {what} failed: {exc}") from None

    def _count(self, *, hits: bool) -> None:
        if hits:
            self._stats.hits += 1
        else:
            self._stats.misses += 1


def _ms(seconds: float) -> int:
    if not seconds > 0:
        raise ValueError(f"a lease must be positive, got {seconds} s")
    return max(1, round(seconds * 1000))


def _tag(tag: str) -> str:
    if ":" in tag:
        raise ValueError(f"a claim's tag has no ':', got {tag!r}")
    return tag


def _lapsed(key: str, last: ClaimState) -> EncodeFailed:
    """The error of a wait whose claim, last seen in ``last``, vanished with no word and no entry."""
    if ending_state(lapsed(last)) is ClaimState.Abandoned:
        return EncodeAbandoned(key, "the claim taken for its encoder lapsed before that encoder took the image up "
                                    "(it was too slow to, or never got the request)")
    return EncodeFailed(key, "its encoder stopped without a result (the claim lapsed)")


def _raise_ended(key: str, waiter: Waiter) -> None:
    """``EncodeFailed``, or ``EncodeAbandoned``, if the waiter heard that the encode of ``key`` ended so."""
    ended = waiter.failure
    if ended is not None:
        error = EncodeAbandoned if ended.kind == ClaimState.Abandoned.event else EncodeFailed
        raise error(key, ended.reason or f"the encoder reported it {ended.kind}")
