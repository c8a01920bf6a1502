"""The client: one target's requests over kept-alive connections, either through a router or, for
``direct``, to the pair itself with the bootstrap fields (as a PD router sends them); every answer's
text is checked (the fake decode answers ``TOKENS`` times ``a``)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp

TOKENS = 8
JSON_HEADERS = {"Content-Type": "application/json"}


def unique_images(n: int, size: int = 32) -> list[str]:
    """``n`` distinct small PNG ``data:`` URLs (random pixels: each its own cache key, so each request
    of an EPD target is a cache miss that the router claims and sends to the encoder)."""
    import base64
    import io
    import os

    from PIL import Image

    urls = []
    for _ in range(n):
        buffer = io.BytesIO()
        Image.frombytes("RGB", (size, size), os.urandom(size * size * 3)).save(buffer, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    return urls


def chat_body(stream: bool, image: str | None = None) -> dict:
    """The one chat body every target gets (JSON, or a stream with usage); with ``image`` (a ``data:``
    URL: the EPD targets) the message holds that image before its text."""
    content: str | list = "Hello! How far is the moon?"
    if image is not None:
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": content}]
    body = {"model": "fake-model", "messages": [{"role": "user", "content": content}],
            "max_tokens": TOKENS, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


@dataclass
class Sample:
    """One answered request: seconds to the last byte, and for a stream to the first byte and first token."""

    latency_s: float
    first_byte_s: float | None = None
    first_token_s: float | None = None


class Client:
    """Sends one target's requests over kept-alive connections and checks every answer's text."""

    def __init__(self, target: str, url: str, pd: tuple[str, str, int] | None,
                 images: list[str] | None = None) -> None:
        self.target, self.url, self.pd = target, url, pd  # pd: (prefill url, decode url, bootstrap port): direct
        self.images, self._next_image = images, 0  # EPD targets: each request the next image, cycling
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=30))
        self.errors: list[str] = []

    async def close(self) -> None:
        await self.session.close()

    async def one(self, stream: bool) -> Sample | None:
        image = None
        if self.images:
            image = self.images[self._next_image % len(self.images)]
            self._next_image += 1
        body = chat_body(stream, image)
        if self.pd is None:
            return await self._call(self.url, body, stream)
        prefill, decode, bootstrap = self.pd
        body |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": random.getrandbits(63)}
        side = asyncio.ensure_future(self._call(prefill, {**body, "stream": False}, False, expect="a"))
        answer = await self._call(decode, body, stream)
        await side
        return answer

    async def _call(self, url: str, body: dict, stream: bool, expect: str = "a" * TOKENS) -> Sample | None:
        payload = json.dumps(body).encode()
        t0 = time.perf_counter()
        try:
            async with self.session.post(url + "/v1/chat/completions", data=payload, headers=JSON_HEADERS) as r:
                if not stream:
                    raw = await r.read()
                    end = time.perf_counter()
                    text = json.loads(raw)["choices"][0]["message"]["content"] if r.status == 200 else raw.decode()
                    return self._check(r.status, text, expect, Sample(end - t0))
                first_byte = first_token = None
                buffer, text = b"", ""
                async for data in r.content.iter_any():
                    now = time.perf_counter()
                    first_byte = first_byte or now
                    buffer += data
                    *events, buffer = buffer.split(b"\n\n")
                    for event in events:
                        if not event.startswith(b"data: ") or event == b"data: [DONE]":
                            continue
                        choices = json.loads(event[6:]).get("choices") or [{}]
                        content = (choices[0].get("delta") or {}).get("content")
                        if content:
                            first_token = first_token or now
                            text += content
                end = time.perf_counter()
                sample = Sample(end - t0, (first_byte or end) - t0, (first_token or end) - t0)
                return self._check(r.status, text, expect, sample)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return None

    def _check(self, status: int, text: str, expect: str, sample: Sample) -> Sample | None:
        if status == 200 and text == expect:
            return sample
        self.errors.append(f"HTTP {status}: {text[:200]!r}")
        return None


async def run_level(client: Client, concurrency: int, n: int, stream: bool) -> tuple[list[Sample], float]:
    """``n`` requests with at most ``concurrency`` in flight; (samples, wall seconds)."""
    left = n
    samples: list[Sample] = []

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            sample = await client.one(stream)
            if sample is not None:
                samples.append(sample)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - t0
