"""Network faults around the embedding cache on the rig (issue 16, item 3), every deadline flag at its
default (``fault_helpers.start_default_stack``: 2E2P2D over Mooncake, Redis with a password), 8
concurrent streams through the router from the client host:

- e1's host vanishes mid-encode (frozen once the router has claimed the images for it, its link cut,
  then thawed: it has the work but cannot renew a claim or answer): the claims lapse after
  ``--claim-lease-s``, the waiters wake, the router retries on e2, every request succeeds within 10 s.
- Redis's host vanishes (its link cut): a request needing an uncached image gets 503
  ``cache_unavailable`` naming Redis (password masked) within 10 s, text requests keep working; once
  the link is back caching resumes with no restart (a new image encoded once, then a hit).
After each test: KV blocks back to 0 on every P and D, no image claim left in Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests.multihost.fault_helpers import CONCURRENT, DEADLINE_S, READMIT_S, Answer, blocks_used, chat, claims, \
    client_of, encoded_total, frozen, images_for, in_rotation, retries, start_default_stack, wait_until
from tests.multihost.rig import REDIS_PORT
from tests.multihost.stack import Stack
from tests.router_helpers import png

pytestmark = pytest.mark.timeout(240)


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
        client, model = client_of(stack)
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
        client, model = client_of(stack)
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
        client, model = client_of(stack)
        image = png(40, 40, 7990)
        return [await chat(client, model, "after redis came back", [image]) for _ in range(2)]

    encoded = sum(rig.client(encoded_total, e) for e in stack.encoders)
    again = rig.client_async(resumed)  # caching resumed, no restart: encoded once, then a hit
    assert all(a.error is None and a.text and a.seconds < DEADLINE_S for a in again), \
        [(a.seconds, a.message) for a in again]
    assert sum(rig.client(encoded_total, e) for e in stack.encoders) == encoded + 1
