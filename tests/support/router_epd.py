"""Helpers for the router's epd unit tests: the vision fingerprint of their image keys (``FP``,
another ``OTHER_FP``), a chat body of images, its image references, and known, healthy workers of a
role (a three-failure breaker; prefill and decode with a KV fingerprint, a prefill with a bootstrap
address; ``encoder`` with an encoder id and a vision fingerprint)."""

from __future__ import annotations

from router.fleet.breaker import CircuitBreaker
from router.fleet.workers import Worker
from router.plan.image_refs import ref_images
from router.plan.images import image_parts
from tests.support.router_helpers import data_url, messages

FP = "ab" * 32
OTHER_FP = "cd" * 32
KV_FP = {"model": "m", "block_size": 16}


def body_with(*images: bytes, text: str = "hi") -> dict:
    return {"model": "m", "messages": messages(text, [data_url(im) for im in images]), "max_tokens": 4}


def refs_of(body: dict, max_bytes: int = 1 << 20):
    return ref_images(image_parts(body), FP, max_bytes)


def worker(url: str, role: str, **kw) -> Worker:
    w = Worker(url, role, CircuitBreaker(3, 10.0), healthy=True, known=True, models=("m",), **kw)
    if role in ("prefill", "decode"):
        w.fingerprint = KV_FP
    if role == "prefill":
        w.bootstrap = ("127.0.0.1", 9000)
    return w


def encoder(url: str, fingerprint: str = FP) -> Worker:
    return worker(url, "encoder", encoder_id=f"enc-{url[-1]}", vision_fingerprint=fingerprint)
