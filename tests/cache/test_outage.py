"""Redis killed, frozen and restarted under a live ``EmbeddingCache``: every call fails fast with a
message naming Redis, nothing hangs, and caching (pub/sub wake-ups included) resumes by itself.
Each test owns its redis-server, since it breaks it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch

from cache.config import MIB
from cache.embedded import EmbeddedRedis
from cache.errors import CacheUnavailable
from cache.keys import image_key
from cache.store import EmbeddingCache
from contract.claims import EncodeEnd
from tests.support.redis_fixtures import make_config, waiting

pytestmark = pytest.mark.timeout(30)
OP_TIMEOUT_S = 0.5
FP = "aa" * 32


def key(n: int) -> str:
    return image_key(f"image-{n}".encode(), FP)


def embedding(n: int) -> dict[str, torch.Tensor]:
    return {"embeddings": torch.randn(16, 64, generator=torch.Generator().manual_seed(n))}


async def put(cache: EmbeddingCache, n: int) -> None:
    await cache.put(key(n), embedding(n), num_tokens=16, image_grid=[1, 8, 8], encoder="enc")


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(64 * MIB) as srv:
        yield srv


def every_call(cache: EmbeddingCache):
    return {
        "get": lambda: cache.get(key(1)),
        "put": lambda: put(cache, 5),
        "contains_many": lambda: cache.contains_many([key(1), key(2)]),
        "delete": lambda: cache.delete(key(1)),
        "claim": lambda: cache.claim(key(6), "enc", 5.0),
        "renew": lambda: cache.renew(key(6), "enc", 5.0),
        "end": lambda: cache.end(key(6), "enc", EncodeEnd.ENCODE_ERROR, "x"),
        "abandon": lambda: cache.abandon([key(6)], "enc", "x"),
        "stored_bytes": lambda: cache.stored_bytes(),
        "wait_ready": lambda: cache.wait_ready(key(6), 10.0),
    }


async def assert_all_fail_fast(cache: EmbeddingCache, url: str) -> None:
    """Every call, all at once: each raises CacheUnavailable naming Redis within its deadline."""

    async def timed(call) -> tuple[float, BaseException | None]:
        started = time.monotonic()
        try:
            await asyncio.wait_for(call(), 5.0)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            return time.monotonic() - started, exc
        return time.monotonic() - started, None

    calls = every_call(cache)
    results = await asyncio.gather(*(timed(call) for call in calls.values()))
    for name, (elapsed, exc) in zip(calls, results, strict=True):
        assert isinstance(exc, CacheUnavailable), (name, exc)
        assert str(exc).startswith(f"Redis at {url}: "), (name, str(exc))
        assert elapsed < OP_TIMEOUT_S + 0.5, f"{name} took {elapsed:.2f} s"


async def assert_pubsub_wakes(waiter_cache: EmbeddingCache, encoder: EmbeddingCache, n: int) -> None:
    assert await encoder.claim(key(n), "enc", 5.0)
    task = await waiting(waiter_cache, key(n))
    started = time.monotonic()
    await put(encoder, n)
    hit = await asyncio.wait_for(task, 2.0)
    assert time.monotonic() - started < 0.05  # woken by the event, not by the 0.1 s claim re-check
    assert torch.equal(hit.tensors["embeddings"], embedding(n)["embeddings"])


async def test_redis_killed_then_restarted_on_the_same_port(server: EmbeddedRedis) -> None:
    url, port = server.url, server.port
    config = make_config(url, op_timeout_s=OP_TIMEOUT_S, claim_check_s=5.0)  # no re-check to hide a lost event
    async with EmbeddingCache(config) as prefill, EmbeddingCache(config) as encoder:
        await put(encoder, 1)
        await assert_pubsub_wakes(prefill, encoder, 2)
        assert await encoder.claim(key(3), "enc", 5.0)
        pending = await waiting(prefill, key(3))

        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(5)
        started = time.monotonic()
        with pytest.raises(CacheUnavailable, match=f"^Redis at {url}: "):
            await asyncio.wait_for(pending, 5.0)  # the waiter hears of it at once, not at its deadline
        assert time.monotonic() - started < OP_TIMEOUT_S + 0.5
        await assert_all_fail_fast(prefill, url)

        with EmbeddedRedis(64 * MIB, port=port) as restarted:
            assert restarted.url == url
            assert await prefill.get(key(1)) is None  # the data is gone: a miss, never a wrong answer
            assert await prefill.contains_many([key(1), key(2)]) == set()
            await put(encoder, 4)
            hit = await prefill.get(key(4))
            assert hit is not None and torch.equal(hit.tensors["embeddings"], embedding(4)["embeddings"])
            await assert_pubsub_wakes(prefill, encoder, 5)  # the dispatcher re-subscribed by itself
            assert await prefill.stored_bytes() == await encoder.stored_bytes() > 0


async def test_a_frozen_redis_times_out_every_call_then_recovers(server: EmbeddedRedis) -> None:
    config = make_config(server.url, op_timeout_s=OP_TIMEOUT_S)
    async with EmbeddingCache(config) as prefill, EmbeddingCache(config) as encoder:
        await put(encoder, 1)
        await assert_pubsub_wakes(prefill, encoder, 2)
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            await assert_all_fail_fast(prefill, server.url)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        hit = await prefill.get(key(1))
        assert hit is not None and torch.equal(hit.tensors["embeddings"], embedding(1)["embeddings"])
        await assert_pubsub_wakes(prefill, encoder, 3)


async def test_a_cache_with_no_redis_at_all_fails_fast(server: EmbeddedRedis) -> None:
    url = server.url
    server.stop()
    async with EmbeddingCache(make_config(url, op_timeout_s=OP_TIMEOUT_S)) as cache:
        await assert_all_fail_fast(cache, url)
