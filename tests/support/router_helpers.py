"""Helpers shared by the router's end-to-end tests (tests/e2e/, tests/router/): test images as data
URLs, chat messages, the official client's greedy answer, a /metrics sample (now, or once it
reaches a value), arming a stage's fault."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import openai

from tests.support.hf_reference import random_image


def png(width: int, height: int, seed: int) -> bytes:
    buffer = io.BytesIO()
    random_image(width, height, seed).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def messages(text: str, urls: list[str]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def ask(base_url: str, msgs: list[dict], stream: bool, max_tokens: int = 12) -> tuple[str, dict]:
    """Greedy text and usage through the official client. The usage leaves out
    ``prompt_tokens_details``: its ``cached_tokens`` depends on what the server's prefix cache saw
    before (the same prompt asked twice hits the second time), which the parity tests here do not
    hold fixed; tests/e2e/test_prefix_cache.py and test_prefix_routing.py assert it."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
    kwargs = dict(model=client.models.list().data[0].id, messages=msgs, max_tokens=max_tokens, temperature=0,
                  extra_body={"ignore_eos": True})
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return reply.choices[0].message.content, reply.usage.model_dump(exclude={"prompt_tokens_details"})
    text, usage = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(exclude={"prompt_tokens_details"})
    return text, usage


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in {url}/metrics")


def wait_metric(url: str, name: str, value: float, within_s: float = 5.0) -> None:
    """Until ``name`` reads ``value``: a request's metrics are recorded just after its last byte is sent."""
    deadline = time.monotonic() + within_s
    while (seen := metric(url, name)) != value:
        assert time.monotonic() < deadline, f"{name} is {seen}, expected {value}"
        time.sleep(0.05)


def arm(server, point: str, times: int, delay_s: float = 0.0) -> None:
    response = httpx.post(f"{server.url}/debug/faults", json={"point": point, "times": times, "delay_s": delay_s})
    assert response.status_code == 200, response.text


async def mixed_answers(router_url: str, router_base: str, colocated_base: str, bodies, count: int = 32) -> None:
    """Send ``count`` mixed requests (``bodies(i) -> (messages, max_tokens, stream)``) through the router and
    the same ones to a colocated server with the official client; assert equal, non-empty greedy answers and
    that the router counted each one as a success."""
    model = httpx.get(f"{router_url}/v1/models").json()["data"][0]["id"]
    success = metric(router_url, 'epd_router_requests_total{outcome="success"}')

    async def run(client: openai.AsyncOpenAI, i: int) -> str:
        msgs, max_tokens, stream = bodies(i)
        kwargs = dict(model=model, messages=msgs, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            return (await client.chat.completions.create(**kwargs)).choices[0].message.content
        return "".join([chunk.choices[0].delta.content or "" async for chunk in
                        await client.chat.completions.create(**kwargs, stream=True) if chunk.choices])

    through = openai.AsyncOpenAI(base_url=router_base, api_key="x", max_retries=0, timeout=120)
    direct = openai.AsyncOpenAI(base_url=colocated_base, api_key="x", max_retries=0, timeout=120)
    async with through, direct:
        answers = await asyncio.wait_for(asyncio.gather(*(run(through, i) for i in range(count))), 150)
        expected = await asyncio.gather(*(run(direct, i) for i in range(count)))
    assert answers == expected and all(answers)
    wait_metric(router_url, 'epd_router_requests_total{outcome="success"}', success + count)
