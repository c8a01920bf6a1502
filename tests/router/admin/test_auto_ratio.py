"""--auto-ratio-interval-s on real stages: a prefill, a decode and a switchable worker serving as a
second prefill. Under decode-heavy streams the router switches the switchable worker to decode by
itself (the same target twice in a row, and worth it), every request succeeds with its full length
meanwhile, and it does not switch back while the load stays the same."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from process.ports import free_port
from tests.support.router_helpers import messages

pytestmark = pytest.mark.timeout(300)
TOKEN = "admin-token-for-auto-ratio-0123"
FAST = ["--kv-cache-mib", "16", "--transfer", "mooncake", "--pair-timeout-s", "5", "--transfer-timeout-s", "5"]


@pytest.fixture(scope="module")
def stack(start_server, tiny_model):
    model = str(tiny_model("qwen2_vl"))
    prefill = start_server("prefill", "--model", model, *FAST, "--bootstrap-port", str(free_port()))
    decode = start_server("decode", "--model", model, *FAST, "--kv-timeout-s", "10")
    switchable = start_server("pd", "--model", model, *FAST, "--kv-timeout-s", "10", "--bootstrap-port",
                              str(free_port()), "--admin-token", TOKEN)
    router = start_server("router", "--prefill", prefill.url, "--prefill", switchable.url, "--decode", decode.url,
                          "--admin-token", TOKEN, "--auto-ratio-interval-s", "0.5", "--ratio-window-s", "3",
                          "--health-interval-s", "0.5")
    return router, switchable


def role(router, url: str) -> str:
    listing = httpx.get(f"{router.url}/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    return next(w["role"] for w in listing.json()["workers"] if w["url"] == url)


async def test_decode_heavy_load_switches_the_switchable_worker_to_decode(stack):
    router, switchable = stack
    assert role(router, switchable.url) == "prefill"
    done: list[int] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"messages": messages(f"auto {i}", []), "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        response = await client.post(f"{router.url}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        done.append(response.json()["usage"]["completion_tokens"])

    switched_at = None
    async with httpx.AsyncClient(timeout=60) as client:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            await asyncio.gather(*(one(client, len(done) + k) for k in range(4)))
            if switched_at is None and role(router, switchable.url) == "decode":
                switched_at = time.monotonic()
            if switched_at is not None and time.monotonic() - switched_at > 3:  # a few more ticks: no flap
                break
    assert switched_at is not None, "the switchable worker was never switched to decode"
    assert role(router, switchable.url) == "decode"
    assert done and set(done) == {48}
    assert "auto ratio: applying prefill:decode 1:2 (was 2:1)" in router.log()
    assert router.log().count("auto ratio: applying") == 1
    assert httpx.get(f"{switchable.url}/server_info", timeout=10).json()["role"] == "decode"
