"""EPD liveness with default deadlines, through a real router in front of two encoders, a prefill and
a decode (Mooncake) on a private Redis; every stage and the router run with their default deadlines.

- An encoder vanishes mid-encode (SIGSTOP: its socket stays open, it renews nothing): its claims lapse
  after ``--claim-lease-s``, the prefill's waiters wake (``claim_check_s``), the router retries each
  request on the other encoder, and all 8 concurrent requests succeed within 10 s.
- Redis vanishes (SIGSTOP): a request needing an uncached image gets 503 ``cache_unavailable`` naming
  Redis within 10 s, text requests keep working, and once Redis runs again caching resumes with no
  restart.
KV blocks are back to zero on P and D, and no claim is left, after each test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import openai
import pytest
import redis

from cache import scripts
from cache.config import MIB
from cache.embedded import EmbeddedRedis
from tests.support.epd_helpers import EPD, image_for, key_of, start_epd
from tests.support.process_stop import stopped
from tests.support.router_helpers import arm, data_url, messages, metric, png

pytestmark = pytest.mark.timeout(240)
DEADLINE_S = 10.0
CONCURRENT = 8




def wait_until(check, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def redis_server():
    server = EmbeddedRedis(64 * MIB).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def epd(redis_server, tmp_path_factory):
    stages = start_epd("qwen2_vl", "mooncake", redis_server.url, tmp_path_factory.mktemp("epd-logs"), encoders=2,
                       encoder_flags=("--debug-faults",))
    yield stages
    stages.stop()


@pytest.fixture(scope="module")
def router(start_server, epd, redis_server):
    flags = [flag for e in epd.encoders for flag in ("--encoder", e.url)]
    return start_server("router", *flags, "--prefill", epd.prefill.url, "--decode", epd.decode.url,
                        "--redis-url", redis_server.url)


def claims(redis_url: str) -> list[bytes]:
    with redis.Redis.from_url(redis_url, socket_timeout=2) as client:
        return list(client.scan_iter(match=scripts.claim_key("*")))


@pytest.fixture(autouse=True)
def stages_end_clean(epd: EPD, redis_server):
    yield
    wait_until(lambda: epd.blocks_used() == (0, 0), 15, "KV blocks back to 0 on P and D")
    wait_until(lambda: not claims(redis_server.url), 15, "no image claim left in Redis")


@asynccontextmanager
async def client_of(router) -> AsyncIterator[tuple[openai.AsyncOpenAI, str]]:
    """An OpenAI client of the router and its model, closed on leaving: an unclosed client schedules
    its close on whichever event loop runs when it is collected, a later test's."""
    model = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"][0]["id"]
    async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=60) as client:
        yield client, model


async def ask(client: openai.AsyncOpenAI, model: str, text: str, images: list[bytes]
              ) -> tuple[float, str | openai.APIStatusError]:
    started = time.monotonic()
    try:
        answer = await client.chat.completions.create(
            model=model, messages=messages(text, [data_url(image) for image in images]), max_tokens=4, temperature=0)
        return time.monotonic() - started, answer.choices[0].message.content or ""
    except openai.APIStatusError as error:
        return time.monotonic() - started, error


async def test_an_encoder_that_vanishes_mid_encode_is_retried_on_the_other(router, epd, redis_server):
    a, b = epd.encoders
    images = [image_for(epd, a.url, seed=9000 + 100 * i) for i in range(CONCURRENT)]
    async with client_of(router) as (client, model):
        retries = metric(router.url, 'epd_router_retries_total{stage="encoder"}')
        encoded_b = b.encoded_total()
        arm(a.server, "encoder.stall", times=1, delay_s=2.0)  # its first batch is taken, then it stops mid-encode
        requests = [asyncio.create_task(ask(client, model, f"mid-encode {i}", [image]))
                    for i, image in enumerate(images)]
        await asyncio.to_thread(wait_until, lambda: len(claims(redis_server.url)) == CONCURRENT, 10,
                                "every image claimed for encoder A")
        with stopped(a.server.proc.pid):
            stopped_at = time.monotonic()
            answers = await asyncio.gather(*requests)
            ended = time.monotonic() - stopped_at
        assert ended < DEADLINE_S, answers
        assert all(isinstance(answer, str) and answer for _, answer in answers), answers
        assert metric(router.url, 'epd_router_retries_total{stage="encoder"}') >= retries + 1
        assert b.encoded_total() >= encoded_b + 1
        assert all(not _claimed(redis_server.url, key_of(epd, image)) for image in images)


def _claimed(redis_url: str, key: str) -> bool:
    with redis.Redis.from_url(redis_url, socket_timeout=2) as client:
        return bool(client.exists(scripts.claim_key(key)))


async def test_a_redis_that_vanishes_is_a_503_naming_it_and_caching_resumes(router, epd, redis_server):
    async with client_of(router) as (client, model):
        text_only = [asyncio.create_task(ask(client, model, f"warm {i}", [])) for i in range(2)]
        assert all(isinstance(answer, str) for _, answer in await asyncio.gather(*text_only))
        with stopped(redis_server.process.pid):
            started = time.monotonic()
            answers = await asyncio.gather(
                *(ask(client, model, f"needs redis {i}", [png(40, 40, 9900 + i)]) for i in range(CONCURRENT // 2)),
                *(ask(client, model, f"text only {i}", []) for i in range(CONCURRENT // 2)))
            ended = time.monotonic() - started
        assert ended < DEADLINE_S, answers
        for _, error in answers[: CONCURRENT // 2]:
            assert isinstance(error, openai.APIStatusError), error
            assert error.status_code == 503 and error.body["code"] == "cache_unavailable", error.body
            assert f"Redis at redis://127.0.0.1:{redis_server.port}/0" in error.message, error.message
        assert all(isinstance(answer, str) and answer for _, answer in answers[CONCURRENT // 2:]), answers
        encoded = epd.encoded_total()
        image = png(40, 40, 9990)
        for attempt in range(2):  # caching resumed: encoded once, then a hit
            seconds, answer = await ask(client, model, "after redis came back", [image])
            assert isinstance(answer, str) and answer and seconds < DEADLINE_S, answer
        assert epd.encoded_total() == encoded + 1
