"""Overload through the epd router, on real processes: a private Redis, one encoder, one prefill and
one decode (Mooncake) with small ``--max-num-seqs``/``--max-waiting``, and the router in front.

A burst well past the stages' limits is answered, never crashed: every request gets a 200 or a 503
with ``Retry-After`` (a stage's "busy" is back-pressure: it opens no breaker, and a worker whose
breaker refuses is never begun; a request that waited on a shared image whose encode was abandoned,
as the request that claimed it was refused, gets ``encode_abandoned``: back-pressure too), and
afterwards every server is healthy, every circuit closed, the KV blocks back to 0 and a plain request
answered.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from cache.config import MIB
from cache.embedded import EmbeddedRedis
from tests.support.epd_helpers import EPD, start_epd
from tests.support.router_helpers import ask, data_url, messages, metric, png, wait_metric

pytestmark = pytest.mark.timeout(300)
BURST = 120  # concurrent requests, each with one image
LIMITS = ("--max-num-seqs", "2", "--max-waiting", "2")  # P and D hold 4 requests each; more get 503
TIMEOUTS = ("--pair-timeout-s", "30", "--transfer-timeout-s", "30")
BURST_DEADLINE_S = 150.0


@pytest.fixture(scope="module")
def stack(start_server, tmp_path_factory):
    redis = EmbeddedRedis(64 * MIB).start()
    epd = start_epd("qwen2_vl", "mooncake", redis.url, tmp_path_factory.mktemp("overload-logs"),
                    encoder_flags=("--max-waiting", "0"), prefill_flags=(*LIMITS, *TIMEOUTS),
                    decode_flags=(*LIMITS, *TIMEOUTS, "--kv-timeout-s", "60"))
    try:
        router = start_server("router", "--encoder", epd.encoders[0].url, "--prefill", epd.prefill.url,
                              "--decode", epd.decode.url, "--redis-url", redis.url, "--upstream-timeout-s", "60",
                              "--health-interval-s", "0.5")
        yield epd, router
    finally:
        epd.stop()
        redis.stop()


async def _one(client: httpx.AsyncClient, url: str, i: int) -> httpx.Response:
    """Request ``i``: a new image, or (every third) one of three images other requests share, so a
    key may be claimed for a request the encoder then refuses while another waits for it."""
    seed = 60_000 + (i // 3) % 3 if i % 3 == 0 else 50_000 + i
    body = {"messages": messages(f"burst {i}", [data_url(png(32, 32, seed))]), "max_tokens": 4,
            "temperature": 0, "stream": i % 2 == 1}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        await response.aread()
    return response


async def test_a_burst_past_the_stages_limits_gets_only_200s_and_503s_with_retry_after(stack):
    epd, router = stack
    outcomes = {o: metric(router.url, f'epd_router_requests_total{{outcome="{o}"}}') for o in ("success", "rejected")}
    limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        answers = await asyncio.wait_for(asyncio.gather(*(_one(client, router.url, i) for i in range(BURST))),
                                         BURST_DEADLINE_S)
    statuses = Counter(a.status_code for a in answers)
    assert set(statuses) == {200, 503}, {a.status_code: a.text for a in answers if a.status_code not in (200, 503)}
    for refused in (a for a in answers if a.status_code == 503):
        error = refused.json()["error"]
        assert refused.headers["Retry-After"] == "1" and error["type"] == "server_error", error
        assert error["message"].startswith("The "), error
        if error["code"] == "encode_abandoned":  # waited on a shared image whose claiming request was refused
            assert error["stage"] == "encoder" and error["image_key"] in error["message"], error
            assert error["message"].endswith("Nothing is wrong with the image; retry after 1 s."), error
        else:
            assert error["code"] == "server_overloaded", error
            assert "(--max-num-seqs + --max-waiting)" in error["message"], error
    for answer in (a for a in answers if a.status_code == 200):
        assert answer.text.endswith("data: [DONE]\n\n") if "event-stream" in answer.headers["content-type"] \
            else answer.json()["usage"]["completion_tokens"] == 4
    wait_metric(router.url, 'epd_router_requests_total{outcome="success"}', outcomes["success"] + statuses[200])
    wait_metric(router.url, 'epd_router_requests_total{outcome="rejected"}', outcomes["rejected"] + statuses[503])
    _assert_recovered(epd, router)


def _assert_recovered(epd: EPD, router) -> None:
    """Every server healthy, every circuit closed, KV blocks back to 0, and a plain request answered."""
    for server in (router, epd.prefill, epd.decode, *(e.server for e in epd.encoders)):
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200, server.url
    for role, server in (("encoder", epd.encoders[0].server), ("prefill", epd.prefill), ("decode", epd.decode)):
        assert metric(router.url, f'epd_router_circuit_state{{role="{role}",worker="{server.url}"}}') == 0
        assert metric(router.url, f'epd_router_worker_healthy{{role="{role}",worker="{server.url}"}}') == 1
    deadline = time.monotonic() + 15
    while (used := epd.blocks_used()) != (0, 0):
        assert time.monotonic() < deadline, f"KV blocks still in use on (P, D): {used}"
        time.sleep(0.1)
    text, usage = ask(router.base_url, messages("after the burst", [data_url(png(40, 40, 49_999))]), stream=False)
    assert text and usage["completion_tokens"] == 12
