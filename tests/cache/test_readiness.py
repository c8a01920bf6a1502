"""Readiness and single flight against a real redis-server: wake-ups by pub/sub, failures, claims."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
import torch

from cache import scripts
from cache.errors import EncodeAbandoned, EncodeFailed, NotPending, ReadyTimeout
from cache.keys import image_key
from cache.store import CachedEmbedding, EmbeddingCache
from contract.claims import ClaimState, EncodeEnd
from tests.support.redis_fixtures import cache, make_config, redis_server, redis_url, waiting  # noqa: F401

pytestmark = pytest.mark.timeout(30)
FP = "0f" * 32
LEASE_S = 5.0


def key(n: int) -> str:
    return image_key(f"image-{n}".encode(), FP)


def embedding(n: int) -> dict[str, torch.Tensor]:
    return {"embeddings": torch.randn(16, 64, generator=torch.Generator().manual_seed(n))}


async def put(cache: EmbeddingCache, n: int) -> None:
    await cache.put(key(n), embedding(n), num_tokens=16, image_grid=[1, 8, 8], encoder="enc")


async def test_a_cached_key_is_returned_at_once(cache: EmbeddingCache) -> None:
    await put(cache, 1)
    hit = await asyncio.wait_for(cache.wait_ready(key(1), 5.0), 1.0)
    assert torch.equal(hit.tensors["embeddings"], embedding(1)["embeddings"])
    assert (cache.stats().hits, cache.stats().misses) == (1, 0)


async def test_a_key_neither_cached_nor_claimed_fails_at_once(cache: EmbeddingCache) -> None:
    started = time.monotonic()
    with pytest.raises(NotPending) as info:
        await cache.wait_ready(key(1), 10.0)
    assert time.monotonic() - started < 1.0
    assert str(info.value) == f"image {key(1)} is not in the cache and no encoder is encoding it"
    assert cache._events._waiters == {}


async def test_a_waiter_wakes_when_its_key_lands_in_about_a_millisecond(redis_url: str) -> None:
    async with EmbeddingCache(make_config(redis_url)) as prefill, \
            EmbeddingCache(make_config(redis_url)) as encoder:
        wake_ms = []
        for n in range(10):
            assert await encoder.claim(key(n), "enc", LEASE_S)
            task = await waiting(prefill, key(n))
            started = time.perf_counter()
            await put(encoder, n)
            hit = await asyncio.wait_for(task, 2.0)
            wake_ms.append((time.perf_counter() - started) * 1000)
            assert torch.equal(hit.tensors["embeddings"], embedding(n)["embeddings"])
            assert not await encoder._redis.exists(scripts.claim_key(key(n)))  # the put ended the claim
        print(f"put() start -> waiter woken with its entry: p50 {statistics.median(wake_ms):.2f} ms, "
              f"max {max(wake_ms):.2f} ms over {len(wake_ms)}")
        assert statistics.median(wake_ms) < 50  # ~1 ms on an idle loopback; generous for shared CPUs
        assert prefill.stats().misses == 10 and prefill._events._waiters == {}


async def test_an_encoder_failure_wakes_every_waiter_with_its_reason(redis_url: str) -> None:
    async with EmbeddingCache(make_config(redis_url)) as prefill, \
            EmbeddingCache(make_config(redis_url)) as encoder:
        assert await encoder.claim(key(1), "enc-a", LEASE_S)
        tasks = [await waiting(prefill, key(1)) for _ in range(3)]
        started = time.monotonic()
        assert await encoder.end(key(1), "enc-a", EncodeEnd.ENCODE_ERROR, "image is not decodable: truncated PNG") \
            is ClaimState.Failed
        for task in tasks:
            with pytest.raises(EncodeFailed) as info:
                await asyncio.wait_for(task, 2.0)
            assert str(info.value) == f"encode of image {key(1)} failed: image is not decodable: truncated PNG"
            assert info.value.reason == "image is not decodable: truncated PNG"
        assert time.monotonic() - started < 0.5  # the deadline was 10 s


async def test_abandoned_claims_are_released_and_their_waiters_told_so_in_one_call(redis_url: str) -> None:
    """The router gives up the claims it took for an encoder that refused the request: the owner's
    claims go, each waiter hears ``EncodeAbandoned`` at once (not a lapsed claim after claim_check_s),
    and a claim its encoder took up (its to end) is left alone, its waiter still waiting."""
    async with EmbeddingCache(make_config(redis_url)) as prefill, \
            EmbeddingCache(make_config(redis_url)) as router:
        assert await router.claim_many([(key(1), "enc-a"), (key(2), "enc-a")], LEASE_S) == [True, True]
        assert await router.claim(key(3), "enc-a", LEASE_S)  # an encoder's own claim: its to end
        tasks = {n: await waiting(prefill, key(n)) for n in (1, 2, 3)}
        started = time.monotonic()
        assert await router.abandon([key(1), key(2), key(3)], "enc-a", "refused as busy") == 2
        for n in (1, 2):
            with pytest.raises(EncodeAbandoned) as info:
                await asyncio.wait_for(tasks[n], 2.0)
            assert str(info.value) == f"encode of image {key(n)} failed: refused as busy"
        assert time.monotonic() - started < 0.5 and not tasks[3].done()
        assert await router.claim(key(1), "enc-c", LEASE_S)  # released: a new try claims it at once
        await router._redis.delete(scripts.claim_key(key(3)))  # its encoder died: the claim lapses
        with pytest.raises(EncodeFailed) as lapsed:
            await asyncio.wait_for(tasks[3], 2.0)
        assert not isinstance(lapsed.value, EncodeAbandoned)
        assert await router.abandon([], "enc-a", "nothing") == 0


async def test_a_lapsed_claim_wakes_waiters_with_an_error_not_a_timeout(cache: EmbeddingCache) -> None:
    assert await cache.claim(key(1), "enc-that-dies", 0.3)  # and never renews
    task = await waiting(cache, key(1), deadline_s=10.0)
    started = time.monotonic()
    with pytest.raises(EncodeFailed) as info:
        await asyncio.wait_for(task, 5.0)
    assert time.monotonic() - started < 0.3 + 0.1 + 0.5  # lease + claim_check_s + slack
    assert info.value.reason == "its encoder stopped without a result (the claim lapsed)"


async def test_a_claim_renewed_in_time_keeps_waiters_waiting_until_the_deadline(cache: EmbeddingCache) -> None:
    assert await cache.claim(key(1), "enc-a", 0.3)
    task = await waiting(cache, key(1), deadline_s=0.8)
    for _ in range(6):
        await asyncio.sleep(0.15)
        assert await cache.renew(key(1), "enc-a", 0.3)
    with pytest.raises(ReadyTimeout) as info:
        await asyncio.wait_for(task, 2.0)
    assert str(info.value) == f"image {key(1)} was not encoded within 0.8 s"


async def test_claims_belong_to_their_owner(cache: EmbeddingCache) -> None:
    assert await cache.claim(key(1), "enc-a", LEASE_S)
    assert not await cache.claim(key(1), "enc-b", LEASE_S)
    assert not await cache.renew(key(1), "enc-b", LEASE_S)
    assert await cache.end(key(1), "enc-b", EncodeEnd.ENCODE_ERROR, "not mine") is ClaimState.Claimed  # left alone
    assert await cache.renew(key(1), "enc-a", LEASE_S)
    assert await cache.end(key(1), "enc-a", EncodeEnd.CANCELLED, "nobody waits") is ClaimState.Abandoned
    assert await cache.claim(key(1), "enc-b", LEASE_S)
    await put(cache, 2)
    assert not await cache.claim(key(2), "enc-a", LEASE_S)  # cached: nothing to encode
    with pytest.raises(ValueError, match="a lease must be positive"):
        await cache.claim(key(3), "enc-a", 0)


async def test_twenty_concurrent_requests_across_two_encoders_encode_once(redis_url: str) -> None:
    encodes = []

    async def request(cache: EmbeddingCache, owner: str) -> CachedEmbedding:
        if await cache.claim(key(7), owner, LEASE_S):
            encodes.append(owner)
            await asyncio.sleep(0.05)  # the vision tower
            await put(cache, 7)
        return await cache.wait_ready(key(7), 5.0)

    async with EmbeddingCache(make_config(redis_url)) as enc_a, EmbeddingCache(make_config(redis_url)) as enc_b:
        results = await asyncio.wait_for(asyncio.gather(
            *(request(enc_a if i % 2 else enc_b, f"enc-{i % 2}") for i in range(20))), 10.0)
    assert len(encodes) == 1
    assert all(torch.equal(r.tensors["embeddings"], embedding(7)["embeddings"]) for r in results)


async def test_waiters_on_other_keys_are_not_woken(cache: EmbeddingCache) -> None:
    assert await cache.claim(key(1), "enc-a", LEASE_S)
    assert await cache.claim(key(2), "enc-a", LEASE_S)
    task = await waiting(cache, key(1), deadline_s=0.6)
    await put(cache, 2)
    await cache.end(key(2), "enc-a", EncodeEnd.ENCODE_ERROR, "unrelated")
    with pytest.raises(ReadyTimeout):
        await asyncio.wait_for(task, 2.0)


async def test_wait_ready_rejects_a_bad_key(cache: EmbeddingCache) -> None:
    with pytest.raises(ValueError, match="not an image cache key"):
        await cache.wait_ready("x", 1.0)
