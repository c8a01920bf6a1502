"""What the dispatcher (router/dispatch/dispatcher.py) adds to an answer: the x-epd-room,
x-epd-stage-times and x-epd-cache headers, and the cache hit and miss counts by image part.
In-process: no sockets."""

from __future__ import annotations

import asyncio

import pytest

from router.dispatch.dispatcher import _headers, cache_counts
from router.plan.modes import Plan, Target
from tests.support.router_epd import body_with, refs_of, worker
from tests.support.router_helpers import png

pytestmark = pytest.mark.unit


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
