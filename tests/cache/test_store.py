"""``EmbeddingCache`` against a real redis-server: round trips, repairs, the byte budget, the TTL, metrics."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import redis
import torch
from prometheus_client import CollectorRegistry

from cache import scripts
from cache.entry import decode_entry, encode_entry
from cache.errors import CacheUnavailable, EntryTooLarge
from cache.keys import image_key
from cache.metrics import register_cache_metrics
from cache.store import CacheStats, EmbeddingCache, Lookup
from contract.claims import ClaimState, EncodeEnd
from process.ports import free_port
from tests.support.redis_fixtures import cache, make_config, redis_server, redis_url  # noqa: F401

pytestmark = pytest.mark.timeout(30)
FP = "f0" * 32


def key(n: int) -> str:
    return image_key(f"image-{n}".encode(), FP)


def embedding(n: int, tokens: int = 16, dim: int = 64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return {"embeddings": torch.randn(tokens, dim, generator=gen)}


def deepstack(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return {"embeddings": torch.randn(6, 32, generator=gen).to(torch.bfloat16),
            "deepstack": torch.randn(3, 6, 32, generator=gen).to(torch.bfloat16)}


def raw(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2)


def entry_size(url: str, k: str) -> int:
    with raw(url) as r:
        return r.hstrlen(scripts.entry_key(k), "meta") + r.hstrlen(scripts.entry_key(k), "payload")


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


async def test_round_trip_with_bfloat16_deepstack_and_metadata(cache: EmbeddingCache, redis_url: str) -> None:
    tensors = deepstack(1)
    written = await cache.put(key(1), tensors, num_tokens=6, image_grid=[1, 4, 6], encoder="enc-a")
    assert await cache.get(key(2)) is None
    hit = await cache.get(key(1))
    assert hit is not None
    assert_same(hit.tensors, tensors)
    entry = hit.entry
    assert (entry.key, entry.num_tokens, entry.image_grid, entry.encoder) == (key(1), 6, [1, 4, 6], "enc-a")
    assert [(s.name, s.shape, s.dtype) for s in entry.tensors] == [
        ("embeddings", [6, 32], "bfloat16"), ("deepstack", [3, 6, 32], "bfloat16")]
    assert entry.created_at == written.created_at and entry.last_used_at >= entry.created_at - 1
    size = entry_size(redis_url, key(1))
    assert cache.stats() == CacheStats(hits=1, misses=1, stored_bytes=size)
    assert await cache.stored_bytes() == size
    with raw(redis_url) as r:
        assert sorted(r.keys("epd:*")) == sorted(
            [scripts.entry_key(key(1)).encode(), b"epd:lru", b"epd:sizes", b"epd:bytes"])
        assert 0 < r.pttl(scripts.entry_key(key(1))) <= 60_000


async def test_float32_and_float16_round_trip(cache: EmbeddingCache) -> None:
    for n, dtype in ((1, torch.float32), (2, torch.float16)):
        tensors = {"embeddings": embedding(n)["embeddings"].to(dtype)}
        await cache.put(key(n), tensors, num_tokens=16, image_grid=[1, 8, 8], encoder="e")
        hit = await cache.get(key(n))
        assert hit is not None
        assert_same(hit.tensors, tensors)


async def test_contains_many_and_delete(cache: EmbeddingCache, redis_url: str) -> None:
    await cache.put(key(1), embedding(1), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
    await cache.put(key(2), embedding(2), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
    assert await cache.contains_many([key(1), key(2), key(3), key(1)]) == {key(1), key(2)}
    assert await cache.contains_many([]) == set()
    assert (cache.stats().hits, cache.stats().misses) == (2, 1)
    assert await cache.delete(key(1)) is True
    assert await cache.delete(key(1)) is False
    assert await cache.contains_many([key(1), key(2)]) == {key(2)}
    assert await cache.stored_bytes() == entry_size(redis_url, key(2))
    with pytest.raises(ValueError, match="not an image cache key"):
        await cache.contains_many([key(1), "epd:*"])


async def test_replacing_an_entry_counts_its_bytes_once(cache: EmbeddingCache, redis_url: str) -> None:
    await cache.put(key(1), embedding(1, tokens=8), num_tokens=8, image_grid=[1, 4, 8], encoder="e")
    await cache.put(key(1), embedding(2, tokens=16), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
    assert await cache.stored_bytes() == entry_size(redis_url, key(1))
    hit = await cache.get(key(1))
    assert hit is not None and hit.entry.num_tokens == 16
    assert_same(hit.tensors, embedding(2, tokens=16))


def rewrite(url: str, k: str, **fields: bytes) -> None:
    with raw(url) as r:
        r.hset(scripts.entry_key(k), mapping=fields)


def stored_meta(url: str, k: str):
    with raw(url) as r:
        return decode_entry(r.hget(scripts.entry_key(k), "meta"))


@pytest.mark.parametrize("damage", ["truncated payload", "shape", "dtype", "garbage meta", "other key"])
async def test_a_corrupt_entry_is_a_miss_and_is_deleted(cache: EmbeddingCache, redis_url: str, damage: str) -> None:
    await cache.put(key(1), embedding(1), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
    await cache.put(key(2), embedding(2), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
    meta = stored_meta(redis_url, key(1))
    spec = meta.tensors[0]
    if damage == "truncated payload":
        with raw(redis_url) as r:
            payload = r.hget(scripts.entry_key(key(1)), "payload")
        rewrite(redis_url, key(1), payload=payload[:-4])
    elif damage == "garbage meta":
        rewrite(redis_url, key(1), meta=b"\xc1not msgpack")
    else:
        changed = {"shape": msgspec.structs.replace(spec, shape=[17, 64]),
                   "dtype": msgspec.structs.replace(spec, dtype="float16"),
                   "other key": spec}[damage]
        new_key = key(9) if damage == "other key" else meta.key
        rewrite(redis_url, key(1), meta=encode_entry(msgspec.structs.replace(meta, key=new_key, tensors=[changed])))
    assert await cache.get(key(1)) is None
    assert cache.stats().repairs == 1
    with raw(redis_url) as r:
        assert not r.exists(scripts.entry_key(key(1)))
        assert r.zscore(scripts.LRU, key(1)) is None and r.hget(scripts.SIZES, key(1)) is None
    assert await cache.stored_bytes() == entry_size(redis_url, key(2))
    assert await cache.get(key(2)) is not None


@pytest.mark.parametrize("damage", ["entry deleted", "payload field deleted"])
async def test_a_dangling_entry_is_a_miss_and_is_repaired(cache: EmbeddingCache, redis_url: str, damage: str) -> None:
    async def damaged_entry() -> None:
        await cache.put(key(1), embedding(1), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
        with raw(redis_url) as r:
            if damage == "entry deleted":
                r.delete(scripts.entry_key(key(1)))
            else:
                r.hdel(scripts.entry_key(key(1)), "payload")

    def assert_repaired() -> None:
        with raw(redis_url) as r:
            assert r.zcard(scripts.LRU) == r.hlen(scripts.SIZES) == 0 and not r.exists(scripts.entry_key(key(1)))

    await damaged_entry()
    assert await cache.get(key(1)) is None
    assert cache.stats().repairs == 1
    assert await cache.stored_bytes() == 0
    assert_repaired()
    await damaged_entry()
    assert await cache.contains_many([key(1)]) == set()
    assert await cache.stored_bytes() == 0
    assert_repaired()


async def test_eviction_keeps_stored_bytes_within_the_budget_in_lru_order(redis_url: str) -> None:
    async with EmbeddingCache(make_config(redis_url)) as probe:
        await probe.put(key(0), embedding(0), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
        size = await probe.stored_bytes()
    budget = 5 * size + size // 2  # room for 5 entries
    async with EmbeddingCache(make_config(redis_url, budget_bytes=budget)) as cache:
        await cache.delete(key(0))
        for n in range(1, 31):
            await cache.put(key(n), embedding(n), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
            assert await cache.stored_bytes() <= budget
            if n == 10:  # key 6 is the oldest now; reading it makes key 7 the oldest
                assert await cache.get(key(6)) is not None
        assert cache.stats().evictions == 25
        present = await cache.contains_many([key(n) for n in range(1, 31)])
        assert present == {key(n) for n in range(26, 31)}
        for n in range(1, 26):
            assert await cache.get(key(n)) is None  # never served once evicted
        for n in range(26, 31):
            hit = await cache.get(key(n))
            assert hit is not None
            assert_same(hit.tensors, embedding(n))
        assert await cache.stored_bytes() == 5 * size
        with raw(redis_url) as r:
            assert r.zcard(scripts.LRU) == r.hlen(scripts.SIZES) == 5
            assert len(r.keys(scripts.ENTRY_PREFIX + "*")) == 5


async def test_a_read_moves_an_entry_to_the_back_of_the_eviction_queue(redis_url: str) -> None:
    async with EmbeddingCache(make_config(redis_url)) as probe:
        await probe.put(key(0), embedding(0), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
        size = await probe.stored_bytes()
        await probe.delete(key(0))
    async with EmbeddingCache(make_config(redis_url, budget_bytes=3 * size)) as cache:
        for n in (1, 2, 3):
            await cache.put(key(n), embedding(n), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
        assert await cache.get(key(1)) is not None
        await cache.put(key(4), embedding(4), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
        assert await cache.contains_many([key(n) for n in (1, 2, 3, 4)]) == {key(1), key(3), key(4)}


async def test_an_entry_larger_than_the_budget_is_refused_and_changes_nothing(redis_url: str) -> None:
    async with EmbeddingCache(make_config(redis_url, budget_bytes=10_000)) as cache:
        await cache.put(key(1), embedding(1, tokens=4), num_tokens=4, image_grid=[1, 2, 8], encoder="e")
        before = await cache.stored_bytes()
        with pytest.raises(EntryTooLarge) as info:
            await cache.put(key(2), embedding(2, tokens=64), num_tokens=64, image_grid=[1, 8, 32], encoder="e")
        assert str(info.value).startswith("an embedding of ")
        assert str(info.value).endswith(
            " bytes does not fit in the cache budget of 10000 bytes; raise --cache-budget-mib")
        assert await cache.stored_bytes() == before
        assert await cache.contains_many([key(1), key(2)]) == {key(1)}


async def test_ttl_drops_unused_entries_and_their_bookkeeping(redis_url: str) -> None:
    async with EmbeddingCache(make_config(redis_url, ttl_s=0.3)) as cache:
        await cache.put(key(1), embedding(1), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
        await cache.put(key(2), embedding(2), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
        await asyncio.sleep(0.2)
        assert await cache.get(key(1)) is not None  # a read restarts the TTL
        await asyncio.sleep(0.2)
        assert await cache.contains_many([key(1), key(2)]) == {key(1)}
        await asyncio.sleep(0.35)
        await cache.put(key(3), embedding(3), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
        assert cache.stats().expired == 1  # key 1's stale LRU member swept by the put (key 2's by contains)
        assert await cache.stored_bytes() == entry_size(redis_url, key(3))
        with raw(redis_url) as r:
            assert r.zrange(scripts.LRU, 0, -1) == [key(3).encode()]


async def test_put_rejects_bad_arguments_before_touching_redis(cache: EmbeddingCache) -> None:
    with pytest.raises(ValueError, match="not an image cache key"):
        await cache.put("nope", embedding(1), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
    with pytest.raises(ValueError, match="num_tokens and image_grid must be non-negative ints"):
        await cache.put(key(1), embedding(1), num_tokens=16, image_grid=[1, -8, 8], encoder="e")
    with pytest.raises(ValueError, match="the cache stores"):
        await cache.put(key(1), {"e": torch.zeros(2, dtype=torch.int64)}, num_tokens=2, image_grid=[1], encoder="e")
    assert await cache.stored_bytes() == 0


async def test_metrics_read_the_stats_at_scrape_time(redis_url: str) -> None:
    async with EmbeddingCache(make_config(redis_url)) as probe:
        await probe.put(key(0), embedding(0), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
        size = await probe.stored_bytes()
        await probe.delete(key(0))
    registry = CollectorRegistry()
    async with EmbeddingCache(make_config(redis_url, budget_bytes=2 * size)) as cache:
        register_cache_metrics(registry, cache.stats)
        for n in (1, 2, 3):
            await cache.put(key(n), embedding(n), num_tokens=16, image_grid=[1, 8, 8], encoder="e")
        await cache.get(key(3))
        await cache.get(key(1))
        await cache.contains_many([key(2), key(9)])
        value = registry.get_sample_value
        assert value("epd_cache_hits_total") == 2.0
        assert value("epd_cache_misses_total") == 2.0
        assert value("epd_cache_evictions_total") == 1.0
        assert value("epd_cache_bytes") == 2.0 * size
        assert value("epd_cache_claims_total") == 0.0
        assert await cache.claim(key(7), "me", 5.0) and not await cache.claim(key(7), "other", 5.0)
        assert not await cache.claim(key(3), "me", 5.0)  # cached: nobody needs to encode it
        assert value("epd_cache_claims_total") == 1.0
        # several keys in one call: free -> claimed; claimed by another or cached -> not
        assert await cache.claim_many([(key(8), "a"), (key(7), "a"), (key(3), "a"), (key(9), "b")], 5.0) == \
            [True, False, False, True]
        assert not await cache.claim(key(9), "a", 5.0) and await cache.claim_many([], 5.0) == []
        assert value("epd_cache_claims_total") == 3.0
        # the lookup and the claims in one call: cached -> CACHED (a hit), claimed by another -> PENDING,
        # free -> CLAIMED for its owner (both misses)
        assert await cache.lookup_claim([(key(3), "a"), (key(9), "a"), (key(6), "c")], 5.0) == \
            [Lookup.CACHED, Lookup.PENDING, Lookup.CLAIMED]
        assert not await cache.claim(key(6), "a", 5.0)
        assert await cache.end(key(6), "c", EncodeEnd.REFUSED, "x") is ClaimState.Abandoned
        assert await cache.lookup_claim([], 5.0) == []
        with pytest.raises(ValueError, match="distinct keys"):
            await cache.lookup_claim([(key(5), "a"), (key(5), "b")], 5.0)
        assert (value("epd_cache_hits_total"), value("epd_cache_misses_total")) == (3.0, 4.0)
        assert value("epd_cache_claims_total") == 4.0
        assert value("epd_cache_unavailable_total") == 0.0


async def test_unavailable_counts_every_failed_redis_call() -> None:
    registry = CollectorRegistry()
    async with EmbeddingCache(make_config(f"redis://127.0.0.1:{free_port()}/0", op_timeout_s=2.0)) as cache:
        register_cache_metrics(registry, cache.stats)
        for call in (cache.get(key(1)), cache.claim(key(1), "me", 5.0)):
            with pytest.raises(CacheUnavailable, match="Redis at redis://127.0.0.1:"):
                await call
        assert registry.get_sample_value("epd_cache_unavailable_total") == 2.0
        assert cache.stats().hits + cache.stats().misses + cache.stats().claims == 0
