"""A request that can be refused before its answer starts is refused with an HTTP status, stream or not.

Real servers: a colocated server, a prefill and a decode over Mooncake, and a pd router in front of
the pair. For every refusal that needs no progress of the engine (a missing bootstrap field, a
prefill the decode may not dial, a room already held, a bad parameter, a wrong model, a prompt too
long), ``stream: true`` gets the same status and the same JSON error body as ``stream: false``, never
a 200 with an in-band error event; through the router too, which forwards the stage's 4xx.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from process.ports import free_port
from tests.support.router_helpers import data_url, png

pytestmark = pytest.mark.timeout(300)
HOLD = ["--kv-cache-mib", "16", "--transfer", "mooncake", "--pair-timeout-s", "60", "--transfer-timeout-s", "5"]
BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2_vl"))


@pytest.fixture(scope="module")
def colocated(start_server, model):
    return start_server("colocated", "--model", model, "--kv-cache-mib", "16")


@pytest.fixture(scope="module")
def prefill(start_server, model):
    port = free_port()
    server = start_server("prefill", "--model", model, *HOLD, "--bootstrap-port", str(port))
    server.bootstrap_port = port
    return server


@pytest.fixture(scope="module")
def decode(start_server, model):
    return start_server("decode", "--model", model, *HOLD, "--kv-timeout-s", "60", "--abort-grace-s", "1")


@pytest.fixture(scope="module")
def switchable(start_server, model):
    """A pd worker no router has given a role yet."""
    return start_server("pd", "--model", model, *HOLD, "--bootstrap-port", str(free_port()))


@pytest.fixture(scope="module")
def router(start_server, prefill, decode):
    return start_server("router", "--prefill", prefill.url, "--decode", decode.url, "--upstream-timeout-s", "30")


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, **fields}


def with_room(prefill, body: dict, room: int | None = None, host: str = "127.0.0.1") -> dict:
    room = random.getrandbits(63) if room is None else room
    return {**body, "bootstrap_host": host, "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}


def refused(url: str, body: dict, status: int, one_stage: bool = True) -> dict:
    """POST ``body`` as stream: false and as stream: true; both must be ``status`` with the same JSON
    error body (the stream's a plain JSON answer, not an event stream). Returns the error.
    ``one_stage`` False (a pd router, which forwards the refusal of whichever of its prefill and
    decode refused first): the two may differ in their ``stage`` field alone, which is then dropped."""
    answers = []
    for stream in (False, True):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": stream}, timeout=30) as r:
            r.read()
            assert r.status_code == status, (stream, r.status_code, r.text)
            assert r.headers["content-type"] == "application/json", (stream, r.headers["content-type"])
            answers.append(r.json())
    if not one_stage:
        assert all(a["error"]["stage"] in ("prefill", "decode") for a in answers), answers
        answers = [{"error": {k: v for k, v in a["error"].items() if k != "stage"}} for a in answers]
    assert answers[0] == answers[1]
    error = answers[0]["error"]
    assert {"message", "type", "param", "code"} <= set(error) <= {"message", "type", "param", "code", "stage", "room"}
    assert error["code"] is not None  # the typed fields (docs/protocol.md) are checked by the callers
    return error


def blocks_used(server) -> int:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()["kv_blocks"]["used"]


def wait_for_event(server, room: int, event: str, within_s: float = 30.0) -> None:
    """Until the server's room timeline (GET /rooms/{room}) has ``event``."""
    deadline = time.monotonic() + within_s
    while True:
        response = httpx.get(f"{server.url}/rooms/{room}", timeout=10)
        if response.status_code == 200 and any(e["event"] == event for e in response.json()["events"]):
            return
        assert time.monotonic() < deadline, f"room {room} never reached {event}: {response.text}"
        time.sleep(0.05)


def wait_blocks_free(*servers, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while any(blocks_used(s) for s in servers):
        assert time.monotonic() < deadline, f"blocks still in use: {[blocks_used(s) for s in servers]}"
        time.sleep(0.1)


# --- prefill and decode ---------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("missing", BOOTSTRAP)
def test_a_missing_bootstrap_field_is_400_naming_it(request, prefill, role, missing):
    server = request.getfixturevalue(role)
    body = {k: v for k, v in with_room(prefill, chat()).items() if k != missing}
    error = refused(server.url, body, 400)
    assert (error["param"], error["code"], error["type"]) == (missing, "missing_required_parameter",
                                                              "invalid_request_error")
    assert (error["stage"], error.get("room")) == (role, None)
    assert error["message"] == (f"Missing required parameter: '{missing}' (a prefill or decode server needs "
                                "bootstrap_host, bootstrap_port and bootstrap_room).")


def test_a_prefill_the_decode_may_not_dial_is_403(prefill, decode):
    body = with_room(prefill, chat(), host="10.0.0.1")
    error = refused(decode.url, body, 403)
    assert (error["param"], error["code"]) == ("bootstrap_host", "bootstrap_not_allowed")
    assert (error["stage"], error["room"]) == ("decode", body["bootstrap_room"])
    assert error["message"].startswith(f"prefill 10.0.0.1:{prefill.bootstrap_port} is not allowed by "
                                       "--allowed-bootstrap")
    assert blocks_used(decode) == 0


async def test_a_room_the_prefill_holds_or_closed_is_409(prefill):
    room = random.getrandbits(63)
    body = with_room(prefill, chat(), room)
    async with httpx.AsyncClient(timeout=60) as client:
        held = asyncio.ensure_future(client.post(f"{prefill.url}/v1/chat/completions", json=body))
        try:
            await asyncio.to_thread(wait_for_event, prefill, room, "queued")  # its half waits for a decode
            error = await asyncio.to_thread(refused, prefill.url, body, 409)
            assert (error["code"], error["message"]) == (
                "room_conflict", f"bootstrap room {room}: room {room}: prefill's own request arrived twice")
            assert (error["stage"], error["room"]) == ("prefill", room)
        finally:
            held.cancel()  # the client leaves: the prefill closes the room
            await asyncio.gather(held, return_exceptions=True)
    deadline = time.monotonic() + 15
    while (error := refused(prefill.url, body, 409))["message"].endswith("arrived twice"):
        assert time.monotonic() < deadline, "the room was never closed"
        time.sleep(0.05)
    assert error["code"] == "room_conflict"
    assert error["message"] == f"bootstrap room {room}: room {room} is closed: the prefill's client went away"


async def test_a_room_in_flight_on_the_decode_is_409(prefill, decode):
    room = random.getrandbits(63)
    body = with_room(prefill, chat(), room)
    async with httpx.AsyncClient(timeout=90) as client:
        held = asyncio.ensure_future(client.post(f"{decode.url}/v1/chat/completions", json=body))
        try:
            await asyncio.to_thread(wait_for_event, decode, room, "kv_requested")  # the prefill's half never comes
            error = await asyncio.to_thread(refused, decode.url, body, 409)
            assert (error["code"], error["param"], error["stage"], error["room"]) == ("room_conflict", None, "decode",
                                                                                      room)
            assert error["message"] == f"bootstrap room {room}: room {room} is already in flight on this decode"
        finally:
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
    wait_blocks_free(prefill, decode)


def test_a_pd_worker_without_a_role_is_503(prefill, switchable):
    for body in (chat(), with_room(prefill, chat())):
        error = refused(switchable.url, body, 503)
        assert (error["code"], error["type"], error.get("stage")) == ("no_role", "server_error", None)


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_bad_parameters_model_and_length_are_the_same_status_stream_or_not(request, prefill, role):
    server = request.getfixturevalue(role)
    room = {} if role == "colocated" else with_room(prefill, {})
    cases = [({"top_p": 1.5}, 400, "top_p", "invalid_value"),
             ({"messages": []}, 400, "messages", "invalid_value"),
             ({"model": "nope"}, 404, "model", "model_not_found"),
             ({"max_tokens": 10**6}, 400, "messages", "context_length_exceeded"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]},
              400, "messages[0].content[0].image_url", "invalid_image_url")]
    for fields, status, param, code in cases:
        error = refused(server.url, {**chat(**fields), **room}, status)
        assert (error["param"], error["code"], error["stage"]) == (param, code, role), fields


# --- through the router -----------------------------------------------------------------------------
def test_the_router_forwards_a_stage_refusal_of_a_stream_as_its_status(router):
    big = data_url(png(8, 8, 1))
    cases = [({"top_p": 1.5}, 400, "top_p", "invalid_value"),
             ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
             ({"max_tokens": 10**6}, 400, "messages", "context_length_exceeded"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": big[:40]}}]}]},
              400, "messages[0].content[0].image_url", "invalid_base64")]
    for fields, status, param, code in cases:
        error = refused(router.url, chat(**fields), status, one_stage=False)
        assert (error["param"], error["code"]) == (param, code), fields


def test_openai_spellings_through_the_pd_router(router, colocated):
    """Role developer and top_p 0 answer, stream or not, as role system and top_p 1e-6 do."""
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    developer = [{**system[0], "role": "developer"}, system[1]]
    texts = []
    for url in (router.url, colocated.url):
        for messages, top_p in ((system, 1e-6), (developer, 0)):
            for stream in (False, True):
                body = {**chat(messages=messages, top_p=top_p, seed=5, max_tokens=6), "ignore_eos": True}
                with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": stream},
                                  timeout=60) as r:
                    r.read()
                    assert r.status_code == 200, r.text
                    texts.append(r.json()["choices"][0]["message"]["content"] if not stream else "".join(
                        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        for line in r.text.split("\n\n") if line.startswith("data: {") and '"choices":[{' in line))
    assert len(set(texts)) == 1 and texts[0], texts
