"""Helpers for the tests of a prefill and a decode over a real transfer (1P1D): short deadlines
(``FAST``), a PNG data URL, a chat body, a ``Pair`` that sends one body to both halves with a
fresh room, a prefill started on its own bootstrap port, KV blocks in use and waiting for them to
be freed, one greedy request to both halves at once (``run_room``), a fault point armed on a server
(``arm``) and an answer's error object (``error``)."""

from __future__ import annotations

import asyncio
import base64
import io
import random
import time

import httpx

from process.ports import free_port
from tests.support.hf_reference import random_image

FAST = ["--kv-cache-mib", "16", "--pair-timeout-s", "3", "--transfer-timeout-s", "3"]


def chat(text: str, images: list[tuple[int, int]] = (), max_tokens: int = 8, **extra) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": png_url(w, h, i)}} for i, (w, h) in enumerate(images)]
    parts.append({"type": "text", "text": text})
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


class Pair:
    def __init__(self, prefill, decode, bootstrap_port: int) -> None:
        self.prefill, self.decode, self.bootstrap_port = prefill, decode, bootstrap_port

    def room(self, body: dict, port: int | None = None) -> dict:
        return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": port or self.bootstrap_port,
                "bootstrap_room": random.getrandbits(63)}

    async def run(self, client: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, httpx.Response]:
        body = self.room(body)
        return await asyncio.gather(client.post(f"{self.prefill.url}/v1/chat/completions", json=body),
                                    client.post(f"{self.decode.url}/v1/chat/completions", json=body))


def start_prefill(start_server, model, transfer: str, *flags, env=None):
    port = free_port()
    server = start_server("prefill", "--model", str(model), "--transfer", transfer, "--bootstrap-port", str(port),
                          *FAST, *flags, env=env)
    return server, port


def blocks_used(server) -> int:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()["kv_blocks"]["used"]


def wait_blocks_free(*servers, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while any(blocks_used(s) for s in servers):
        assert time.monotonic() < deadline, f"blocks still in use: {[blocks_used(s) for s in servers]}"
        time.sleep(0.2)


def png_url(width: int, height: int, seed: int) -> str:
    buffer = io.BytesIO()
    random_image(width, height, seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def run_room(prefill, decode, bootstrap: int, text: str, sizes: list[tuple[int, int]],
                   max_tokens: int) -> tuple[httpx.Response, httpx.Response]:
    """One greedy request (``text`` after PNGs of ``sizes``) sent to ``prefill`` and ``decode`` at once
    with a fresh bootstrap room; both answers, each asserted 200."""
    parts = [{"type": "image_url", "image_url": {"url": png_url(w, h, i)}} for i, (w, h) in enumerate(sizes)]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            "max_tokens": max_tokens, "temperature": 0, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
            "bootstrap_room": random.getrandbits(63)}
    async with httpx.AsyncClient(timeout=60) as client:
        p, d = await asyncio.gather(client.post(f"{prefill.url}/v1/chat/completions", json=body),
                                    client.post(f"{decode.url}/v1/chat/completions", json=body))
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    return p, d


def arm(server, point: str, delay_s: float = 0.0) -> None:
    response = httpx.post(f"{server.url}/debug/faults", json={"point": point, "delay_s": delay_s}, timeout=10)
    assert response.status_code == 200, response.text
    assert {"point": point, "times": 1, "delay_s": delay_s} in response.json()["armed"]


def error(response: httpx.Response) -> dict:
    return response.json()["error"]
