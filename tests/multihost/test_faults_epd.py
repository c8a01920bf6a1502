"""Network faults around the embedding cache on the rig (issue 16, item 3), every deadline flag at its
default (``fault_helpers.start_default_stack``: 2E2P2D over Mooncake, Redis with a password), 8
concurrent streams through the router from the client host:

- e1's host vanishes mid-encode (frozen once the router has claimed the images for it, its link cut,
  then thawed: it has the work but cannot renew a claim or answer): the claims lapse after
  ``--claim-lease-s``, the waiters wake, the router retries on e2, every request succeeds within 10 s.
- Redis's host vanishes (its link cut): a request needing an uncached image gets 503
  ``cache_unavailable`` naming Redis (password masked) within 10 s, text requests keep working; once
  the link is back caching resumes with no restart (a new image encoded once, then a hit).
- the path router -> e1's HTTP port is blackholed for 30 s (nft drop: calls on pooled connections and
  new ones, and health checks, go unanswered): waves of 8 image requests (half of their images e1's by
  the router's cache_aware ring) all succeed within 10 s, moved to e2; e1's breaker opens; once the
  path is back e1 is readmitted and encodes again within 30 s.
After each test: KV blocks back to 0 on every P and D, no image claim left in Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests.multihost.fault_helpers import CONCURRENT, DEADLINE_S, READMIT_S, Answer, blocks_used, chat, claims, \
    client_of, encoded_total, frozen, images_for, in_rotation, retries, start_default_stack, wait_until, \
    worker_metric
from tests.multihost.rig import PORTS, REDIS_PORT
from tests.multihost.stack import Stack
from tests.support.router_helpers import png

pytestmark = pytest.mark.timeout(240)
BLACKHOLE_S = 30.0
WAVE_EVERY_S = 2.0  # waves start at most this often (once e1's breaker is open a wave takes a moment)
MAX_WAVES = int(BLACKHOLE_S / WAVE_EVERY_S) + 1


@pytest.fixture(scope="module")
def stack(make_rig) -> Stack:
    return start_default_stack(make_rig(4))


@pytest.fixture(autouse=True)
def clean(stack: Stack) -> Iterator[None]:
    rig = stack.rig
    rig.client(wait_until, lambda: all(in_rotation(stack.router, role, w) for role, group in
                                       (("encoder", stack.encoders), ("prefill", stack.prefills),
                                        ("decode", stack.decodes)) for w in group),
               READMIT_S, "every worker in rotation")
    yield
    rig.client(wait_until, lambda: not any(blocks_used([*stack.prefills, *stack.decodes])), 15,
               "KV blocks back to 0 on p1, p2, d1, d2")
    rig.client(wait_until, lambda: not claims(rig), 15, "no image claim left in Redis")


def test_an_encoder_host_that_vanishes_mid_encode(stack):
    rig, (victim, survivor) = stack.rig, stack.encoders
    images = images_for(stack, victim, seed=7000, count=CONCURRENT)
    retried = rig.client(retries, stack.router, "encoder")
    encoded = rig.client(encoded_total, survivor)

    async def scenario() -> tuple[list[Answer], float]:
        async with client_of(stack) as (client, model):
            with frozen(victim):
                requests = [asyncio.create_task(chat(client, model, f"vanishing encoder {i}", [image]))
                            for i, image in enumerate(images)]
                await asyncio.to_thread(wait_until, lambda: len(claims(rig)) == CONCURRENT, 10,
                                        "every image claimed for e1")
                rig.cut("e1")
            cut_at = time.monotonic()
            answers = await asyncio.gather(*requests)
            return answers, cut_at

    try:
        answers, cut_at = rig.client_async(scenario)
    finally:
        rig.restore("e1")
    assert all(a.error is None and a.text for a in answers), [(a.seconds, a.status, a.message) for a in answers]
    assert all(a.ended_at - cut_at < DEADLINE_S for a in answers), [a.ended_at - cut_at for a in answers]
    assert rig.client(retries, stack.router, "encoder") > retried
    assert rig.client(encoded_total, survivor) >= encoded + CONCURRENT


def test_a_redis_host_that_vanishes(stack):
    rig = stack.rig
    named = f"Redis at redis://:***@{rig.hostport('redis', REDIS_PORT)}/0"
    half = CONCURRENT // 2

    async def outage() -> tuple[list[Answer], float]:
        async with client_of(stack) as (client, model):
            warm = await asyncio.gather(*(chat(client, model, f"warm {i}") for i in range(2)))
            assert all(a.error is None for a in warm), [a.message for a in warm]
            rig.cut("redis")
            cut_at = time.monotonic()
            answers = await asyncio.gather(*(chat(client, model, f"needs redis {i}", [png(40, 40, 7900 + i)])
                                             for i in range(half)),
                                           *(chat(client, model, f"text only {i}") for i in range(half)))
            return answers, cut_at

    try:
        answers, cut_at = rig.client_async(outage)
    finally:
        rig.restore("redis")
    assert all(a.ended_at - cut_at < DEADLINE_S for a in answers), [a.ended_at - cut_at for a in answers]
    for answer in answers[:half]:
        assert answer.status == 503 and answer.error.body["code"] == "cache_unavailable", (answer.status,
                                                                                          answer.message)
        assert named in answer.message and rig.redis_password not in answer.message, answer.message
    assert all(a.error is None and a.text for a in answers[half:]), [a.message for a in answers[half:]]

    async def resumed() -> list[Answer]:
        async with client_of(stack) as (client, model):
            image = png(40, 40, 7990)
            return [await chat(client, model, "after redis came back", [image]) for _ in range(2)]

    encoded = sum(rig.client(encoded_total, e) for e in stack.encoders)
    again = rig.client_async(resumed)  # caching resumed, no restart: encoded once, then a hit
    assert all(a.error is None and a.text and a.seconds < DEADLINE_S for a in again), \
        [(a.seconds, a.message) for a in again]
    assert sum(rig.client(encoded_total, e) for e in stack.encoders) == encoded + 1


def test_the_path_to_an_encoder_blackholed_for_30_s(stack):
    rig, (victim, survivor) = stack.rig, stack.encoders
    half = CONCURRENT // 2
    theirs = {e.url: images_for(stack, e, seed=8000 + 2000 * i, count=half * MAX_WAVES)
              for i, e in enumerate(stack.encoders)}
    circuit = lambda: worker_metric(stack.router, "epd_router_circuit_state", "encoder", victim)  # noqa: E731

    async def scenario() -> tuple[list[list[Answer]], set[float]]:
        async with client_of(stack) as (client, model):
            waves: list[list[Answer]] = []
            states, started = set(), time.monotonic()
            while time.monotonic() - started < BLACKHOLE_S:
                assert len(waves) < MAX_WAVES, "more waves than images made for them"
                n = len(waves)
                images = [*theirs[victim.url][n * half:(n + 1) * half], *theirs[survivor.url][n * half:(n + 1) * half]]
                waves.append(await asyncio.gather(*(chat(client, model, f"blackhole {n}.{i}", [image])
                                                    for i, image in enumerate(images))))
                states.add(await asyncio.to_thread(circuit))
                await asyncio.sleep(max(0.0, started + len(waves) * WAVE_EVERY_S - time.monotonic()))
            return waves, states

    rig.block("e1", PORTS["encoder"], "drop")
    try:
        waves, states = rig.client_async(scenario)
    finally:
        assert rig.unblock("e1", PORTS["encoder"]) == 1
    unblocked_at = time.monotonic()
    answers = [a for wave in waves for a in wave]
    assert all(a.error is None and a.text and a.seconds < DEADLINE_S for a in answers), \
        [(a.seconds, a.status, a.message) for a in answers if a.error or a.seconds >= DEADLINE_S]
    assert 2.0 in states, f"e1's breaker never opened: {states}"  # 0 closed, 1 half-open, 2 open
    rig.client(wait_until, lambda: in_rotation(stack.router, "encoder", victim), READMIT_S, "e1 readmitted")
    encoded = rig.client(encoded_total, victim)

    async def back() -> Answer:
        async with client_of(stack) as (client, model):
            return await chat(client, model, "e1 is back", [theirs[victim.url][-1]])

    answer = rig.client_async(back)
    assert answer.error is None and answer.text, answer.message
    assert rig.client(encoded_total, victim) == encoded + 1  # e1's image, encoded by e1
    assert time.monotonic() - unblocked_at < READMIT_S
