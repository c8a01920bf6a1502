"""Helpers shared by the router's end-to-end tests (tests/test_router_*.py): test images as data
URLs, chat messages, the official client's greedy answer, a /metrics sample (now, or once it
reaches a value), arming a stage's fault."""

from __future__ import annotations

import base64
import io
import time

import httpx
import openai

from tests.hf_reference import random_image


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
    """Greedy text and usage through the official client."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
    kwargs = dict(model=client.models.list().data[0].id, messages=msgs, max_tokens=max_tokens, temperature=0,
                  extra_body={"ignore_eos": True})
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return reply.choices[0].message.content, reply.usage.model_dump()
    text, usage = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
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
