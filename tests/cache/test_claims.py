"""Every transition of ``contract.claims`` as the cache's Lua makes it, against a real redis-server:
the state a waiter's probe sees after each call, who may make it, and what the waiters hear."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cache import scripts
from cache.errors import EncodeAbandoned, EncodeFailed
from cache.keys import image_key
from cache.store import EmbeddingCache, Lookup
from contract.claims import ClaimState, EncodeEnd
from tests.support.redis_fixtures import cache, make_config, redis_server, redis_url, waiting  # noqa: F401

pytestmark = pytest.mark.timeout(30)
FP = "1e" * 32
LEASE_S = 5.0
C = ClaimState


def key(n: int) -> str:
    return image_key(f"claim-{n}".encode(), FP)


async def state(cache: EmbeddingCache, n: int) -> ClaimState:
    hit, held = await cache._probe(key(n))
    return C.Cached if hit is not None else held


async def put(cache: EmbeddingCache, n: int, encoder: str) -> None:
    await cache.put(key(n), {"embeds": torch.zeros(2, 4)}, num_tokens=2, image_grid=[1, 2, 2], encoder=encoder)


async def test_the_router_claims_for_an_encoder_which_takes_it_up_then_writes_it(cache: EmbeddingCache) -> None:
    assert await state(cache, 1) is C.Unclaimed
    assert await cache.lookup_claim([(key(1), "enc-a")], LEASE_S, "7") == [Lookup.CLAIMED]
    assert await state(cache, 1) is C.Claimed
    assert not await cache.renew(key(1), "enc-b", LEASE_S) and await state(cache, 1) is C.Claimed
    assert await cache.renew(key(1), "enc-a", LEASE_S)  # Claimed -> Encoding
    assert await state(cache, 1) is C.Encoding
    await put(cache, 1, "enc-a")  # Encoding -> Cached: the claim ends with the write
    assert await state(cache, 1) is C.Cached and not await cache._redis.exists(scripts.claim_key(key(1)))


async def test_an_encoder_claims_for_itself_and_a_write_by_another_leaves_its_claim(cache: EmbeddingCache) -> None:
    assert await cache.claim(key(2), "enc-a", LEASE_S) and await state(cache, 2) is C.Encoding
    await put(cache, 2, "enc-b")  # an encoder that lost its claim still writes; enc-a's claim stays its own
    assert await cache._redis.exists(scripts.claim_key(key(2)))
    assert await cache.end(key(2), "enc-a", EncodeEnd.ENCODE_ERROR, "x") is C.Failed


async def test_abandon_drops_only_the_claims_taken_with_its_tag_that_nobody_took_up(redis_url: str) -> None:
    async with EmbeddingCache(make_config(redis_url)) as router, EmbeddingCache(make_config(redis_url)) as prefill:
        assert await router.claim_many([(key(1), "enc-a"), (key(2), "enc-a"), (key(3), "enc-a")], LEASE_S, "1") \
            == [True, True, True]
        assert await router.renew(key(2), "enc-a", LEASE_S)  # taken up: enc-a's to end
        await router._redis.delete(scripts.claim_key(key(3)))  # lapsed, then claimed anew for another request
        assert await router.lookup_claim([(key(3), "enc-a")], LEASE_S, "2") == [Lookup.CLAIMED]
        waiters = {n: await waiting(prefill, key(n)) for n in (1, 2, 3)}
        assert await router.abandon([key(1), key(2), key(3)], "enc-a", "refused", "1") == 1
        with pytest.raises(EncodeAbandoned, match="refused"):
            await asyncio.wait_for(waiters[1], 2.0)
        assert [await state(router, n) for n in (1, 2, 3)] == [C.Unclaimed, C.Encoding, C.Claimed]
        await asyncio.sleep(0.3)
        assert not waiters[2].done() and not waiters[3].done()
        assert await router.abandon([key(3)], "enc-a", "refused", "2") == 1  # its own request's abandon
        with pytest.raises(EncodeAbandoned):
            await asyncio.wait_for(waiters[3], 2.0)
        waiters[2].cancel()


@pytest.mark.parametrize("end, error", [(EncodeEnd.CANCELLED, EncodeAbandoned), (EncodeEnd.CACHE_REFUSED, EncodeAbandoned),
                                        (EncodeEnd.TIMED_OUT, EncodeAbandoned), (EncodeEnd.ENCODE_ERROR, EncodeFailed),
                                        (EncodeEnd.TOO_LARGE, EncodeFailed)])
async def test_the_holder_ends_an_encode_as_back_pressure_or_as_a_failure(
        redis_url: str, end: EncodeEnd, error: type[EncodeFailed]) -> None:
    async with EmbeddingCache(make_config(redis_url)) as encoder, EmbeddingCache(make_config(redis_url)) as prefill:
        assert await encoder.claim(key(4), "enc-a", LEASE_S)
        waiter = await waiting(prefill, key(4))
        assert await encoder.end(key(4), "enc-b", end, "not mine") is C.Claimed  # another's: nothing happens
        assert await encoder.end(key(4), "enc-a", end, "why") is (C.Abandoned if error is EncodeAbandoned else C.Failed)
        with pytest.raises(EncodeFailed) as info:
            await asyncio.wait_for(waiter, 2.0)
        assert type(info.value) is error and info.value.reason == "why"
        assert await state(encoder, 4) is C.Unclaimed and await encoder.claim(key(4), "enc-c", LEASE_S)


async def test_an_end_after_the_claim_lapsed_is_still_told(redis_url: str) -> None:
    async with EmbeddingCache(make_config(redis_url)) as encoder, EmbeddingCache(make_config(redis_url)) as prefill:
        assert await encoder.claim(key(5), "enc-a", LEASE_S)
        waiter = await waiting(prefill, key(5), deadline_s=5.0)
        await encoder._redis.delete(scripts.claim_key(key(5)))
        assert await encoder.end(key(5), "enc-a", EncodeEnd.CACHE_REFUSED, "write timed out") is C.Abandoned
        with pytest.raises(EncodeFailed):  # the end if heard first, else the lapse
            await asyncio.wait_for(waiter, 2.0)


async def test_a_lapse_is_back_pressure_before_the_take_up_and_a_failure_after(redis_url: str) -> None:
    async with EmbeddingCache(make_config(redis_url)) as router, EmbeddingCache(make_config(redis_url)) as prefill:
        assert await router.claim_many([(key(6), "enc-a"), (key(7), "enc-a")], 0.4, "3") == [True, True]
        assert await router.renew(key(7), "enc-a", 0.4)  # taken up, then never renewed: its encoder died
        untaken, taken = await waiting(prefill, key(6)), await waiting(prefill, key(7))
        with pytest.raises(EncodeAbandoned, match="lapsed before that encoder took the image up"):
            await asyncio.wait_for(untaken, 2.0)
        with pytest.raises(EncodeFailed, match="its encoder stopped without a result") as info:
            await asyncio.wait_for(taken, 2.0)
        assert not isinstance(info.value, EncodeAbandoned)


async def test_the_router_takes_over_a_claim_held_for_an_encoder_it_will_not_send_to(cache: EmbeddingCache) -> None:
    assert await cache.lookup_claim([(key(8), "enc-a")], LEASE_S, "1") == [Lookup.CLAIMED]
    assert await cache.claim(key(9), "enc-a", LEASE_S)  # taken up by enc-a, which then vanished
    assert await cache.lookup_claim([(key(8), "enc-b"), (key(9), "enc-b")], LEASE_S, "2") == [Lookup.PENDING] * 2
    assert await cache.lookup_claim([(key(8), "enc-b"), (key(9), "enc-b")], LEASE_S, "2", takeover=["enc-a"]) \
        == [Lookup.CLAIMED] * 2
    assert [await state(cache, n) for n in (8, 9)] == [C.Claimed, C.Claimed]
    assert not await cache.renew(key(9), "enc-a", LEASE_S)  # enc-a lost it: its end tells nobody
    assert await cache.end(key(9), "enc-a", EncodeEnd.ENCODE_ERROR, "late") is C.Claimed
    assert await cache.renew(key(9), "enc-b", LEASE_S) and await state(cache, 9) is C.Encoding
    # claim_many takes over too, and never from the owner it claims for
    assert await cache.claim_many([(key(8), "enc-c")], LEASE_S, "3", takeover=["enc-b"]) == [True]
    assert await cache.claim_many([(key(8), "enc-c")], LEASE_S, "4", takeover=["enc-c"]) == [False]
    with pytest.raises(ValueError, match="no ':'"):
        await cache.claim_many([(key(10), "enc-c")], LEASE_S, "a:b")
