"""Driving real E, P and D server processes the way the router will: keys from the encoder's
fingerprint, a claim on the encoder's behalf, the image to E and ``image_ref`` parts to P and D
with one room, all at once.

``start_epd(variant, transfer, redis_url, logs, encoders=1, ..., path=None) -> EPD`` starts the servers
(on ``path``, default the variant's generated checkpoint) in parallel (most of the wait is imports);
``epd.stop()`` stops them. ``await epd.run(client, images, ...)`` sends one request and returns the three answers. ``key_of(epd, data)`` is an image's key;
``image_for(epd, encoder_url, seed)`` a new PNG the router's cache_aware policy sends to that encoder.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random
import re
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from cache.config import MIB, CacheConfig
from cache.keys import image_key
from cache.store import EmbeddingCache
from process.ports import free_port
from router.plan.policy import CacheAware
from tests.conftest import ServerProcess, launch
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image

START_TIMEOUT_S = 180.0
CLAIM_LEASE_S = 3.0  # a claim taken for an encoder: it renews it once the image is queued there


def png(width: int, height: int, seed: int) -> bytes:
    buffer = io.BytesIO()
    random_image(width, height, seed).save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass(frozen=True)
class Image:
    data: bytes
    width: int
    height: int

    @classmethod
    def random(cls, width: int, height: int, seed: int) -> Image:
        return cls(png(width, height, seed), width, height)


@dataclass
class Encoder:
    server: ServerProcess
    encoder_id: str
    fingerprint: str

    @property
    def url(self) -> str:
        return self.server.url

    def encoded_total(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return float(re.search(r"^epd_encoder_images_encoded_total (\S+)$", text, re.M).group(1))


@dataclass
class Answers:
    encode: list[httpx.Response | httpx.HTTPError]  # an encoder that died mid-request: the error
    prefill: httpx.Response
    decode: httpx.Response

    @property
    def text(self) -> str:
        assert self.prefill.status_code == self.decode.status_code == 200, (self.prefill.text, self.decode.text)
        return self.decode.json()["choices"][0]["message"]["content"]


@dataclass
class EPD:
    encoders: list[Encoder]
    prefill: ServerProcess
    decode: ServerProcess
    bootstrap_port: int
    redis_url: str
    path: Path

    @property
    def fingerprint(self) -> str:
        return self.encoders[0].fingerprint

    def key(self, image: Image) -> str:
        return image_key(image.data, self.fingerprint)

    def body(self, images: list[Image], text: str, max_tokens: int, room: int | None = None) -> dict:
        parts = [{"type": "image_ref", "image_ref": {"key": self.key(im), "width": im.width, "height": im.height}}
                 for im in images]
        return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                "max_tokens": max_tokens, "temperature": 0, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": random.getrandbits(63) if room is None else room}

    async def claim(self, images: list[Image], encoder: Encoder) -> list[bool]:
        """Claim each image's key for ``encoder`` as the router does before dispatching (``Claimed``, not
        yet taken up: ``contract.claims``)."""
        async with EmbeddingCache(CacheConfig(url=self.redis_url, budget_bytes=MIB, ttl_s=60.0)) as cache:
            return await cache.claim_many([(self.key(im), encoder.encoder_id) for im in images], CLAIM_LEASE_S)

    async def encode(self, client: httpx.AsyncClient, images: list[Image], encoder: Encoder,
                     room: int) -> httpx.Response:
        parts = [{"key": self.key(im), "data": base64.b64encode(im.data).decode()} for im in images]
        return await client.post(f"{encoder.url}/v1/encode", json={"room": room, "images": parts})

    async def chat(self, client: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, httpx.Response]:
        return await asyncio.gather(client.post(f"{self.prefill.url}/v1/chat/completions", json=body),
                                    client.post(f"{self.decode.url}/v1/chat/completions", json=body))

    async def run(self, client: httpx.AsyncClient, images: list[Image], text: str = "what is it",
                  max_tokens: int = 8, encoder: Encoder | None = None, send: bool = True) -> Answers:
        """One request: claim for ``encoder`` (default the first), then at once the images to it
        (unless ``send`` is False) and the references to P and D."""
        encoder = encoder or self.encoders[0]
        body = self.body(images, text, max_tokens)
        if images and send:
            await self.claim(images, encoder)
        encode = [_or_error(self.encode(client, images, encoder, body["bootstrap_room"]))] if images and send else []
        *encoded, (prefill, decode) = await asyncio.gather(*encode, self.chat(client, body))
        return Answers(list(encoded), prefill, decode)

    def encoded_total(self) -> float:
        return sum(e.encoded_total() for e in self.encoders)

    def info(self, server: ServerProcess) -> dict:
        return httpx.get(f"{server.url}/server_info", timeout=10).json()

    def blocks_used(self) -> tuple[int, int]:
        return tuple(self.info(s)["kv_blocks"]["used"] for s in (self.prefill, self.decode))

    def stop(self) -> None:
        for server in (self.prefill, self.decode, *(e.server for e in self.encoders)):
            server.stop()


def start_epd(variant: str, transfer: str, redis_url: str, logs: Path, *, encoders: int = 1,
              encoder_flags: tuple[str, ...] = (), prefill_flags: tuple[str, ...] = (),
              decode_flags: tuple[str, ...] = (), path: Path | None = None) -> EPD:
    """E (``encoders`` of them), P and D of ``variant`` (its checkpoint at ``path``, default
    ``model_dir(variant)``) on ``redis_url``, started in parallel."""
    path = path or model_dir(variant)
    bootstrap = free_port()
    common = ["--model", str(path), "--device", DEVICE, "--redis-url", redis_url]
    jobs = [("encoder", [*common, *encoder_flags], logs / f"encoder-{i}.log") for i in range(encoders)]
    jobs += [("prefill", [*common, "--transfer", transfer, "--kv-cache-mib", "16", "--bootstrap-port",
                          str(bootstrap), *prefill_flags], logs / "prefill.log"),
             ("decode", [*common, "--transfer", transfer, "--kv-cache-mib", "16", *decode_flags], logs / "decode.log")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        servers = list(pool.map(lambda job: _launch_or_none(*job), jobs))
    if any(s is None for s in servers):
        for server in servers:
            if server is not None:
                server.stop()
        raise RuntimeError(f"a server did not start; logs in {logs}: "
                           + "; ".join(p.read_text(errors='replace')[-2000:] for p in logs.glob("*.log")))
    *encoder_servers, prefill, decode = servers
    found = []
    for server in encoder_servers:
        info = httpx.get(f"{server.url}/server_info", timeout=10).json()
        found.append(Encoder(server, info["encoder_id"], info["vision_fingerprint"]))
    return EPD(found, prefill, decode, bootstrap, redis_url, path)


async def _or_error(call: Awaitable[httpx.Response]) -> httpx.Response | httpx.HTTPError:
    try:
        return await call
    except httpx.HTTPError as exc:
        return exc


def _launch_or_none(role: str, flags: list[str], log_path: Path) -> ServerProcess | None:
    try:
        return launch(role, flags, log_path, START_TIMEOUT_S)
    except RuntimeError:
        return None


def image_for(epd: EPD, encoder_url: str, seed: int) -> bytes:
    """A new PNG whose key the router's cache_aware policy maps to ``encoder_url`` (both encoders up)."""
    ring = CacheAware()
    candidates = [_Named(e.url) for e in epd.encoders]
    for s in range(seed, seed + 100):
        data = png(40, 40, s)
        if ring.choose(candidates, key_of(epd, data)).name == encoder_url:
            return data
    raise AssertionError("no image maps to that encoder")


def key_of(epd: EPD, data: bytes) -> str:
    return image_key(data, epd.fingerprint)


@dataclass(frozen=True)
class _Named:
    name: str
    outstanding: int = 0
