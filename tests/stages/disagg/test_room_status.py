"""A room's handover status is its state machine's (``transfer.rooms.Room``), on real servers: a
prefill and a decode over Mooncake on loopback. ``GET /rooms/{room}`` gives the status the room's
state last entered, and the events that are status changes (prefill ``paired``, ``ready_sent``,
``failed``; decode ``kv_requested``, ``kv_ready``, ``failed``) come from the state, so every way a
room ends shows as ``success`` or ``failed`` with the reason, including the failures of a room that
never paired; each ends with the blocks on both sides back to zero."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.pd_pair import FAST, Pair, arm, chat, error, start_prefill, wait_blocks_free

pytestmark = pytest.mark.timeout(300)
KV_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen2_vl")


@pytest.fixture(scope="module")
def pair(start_server, model) -> Pair:
    prefill, port = start_prefill(start_server, model, "mooncake", "--debug-faults")
    decode = start_server("decode", "--model", str(model), "--transfer", "mooncake", *FAST[:2],
                          "--kv-timeout-s", str(KV_TIMEOUT_S), "--abort-grace-s", "1")
    return Pair(prefill, decode, port)


def room_view(server, room: int) -> tuple[str | None, list[dict]]:
    response = httpx.get(f"{server.url}/rooms/{room}", timeout=10)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["room"] == room and set(body) == {"room", "role", "status", "events"}
    return body["status"], body["events"]


def names(events: list[dict]) -> list[str]:
    return [e["event"] for e in events]


def paired_and_prefilled(*rest: str) -> tuple[list[str], list[str]]:
    """A prefill's events for a room that was paired and prefilled, then ``rest``: its forward pass
    starts when its own half arrives, so ``prefilled`` may come before or after ``paired``."""
    return ["queued", "paired", "prefilled", *rest], ["queued", "prefilled", "paired", *rest]


def failure(events: list[dict]) -> str:
    """The reason of the room's one ``failed`` event, which is its last."""
    assert [e["event"] for e in events].count("failed") == 1 and events[-1]["event"] == "failed", events
    return events[-1]["reason"]


async def test_a_finished_room_is_success_on_both_stages(pair):
    body = pair.room(chat("all the way", max_tokens=4))
    room = body["bootstrap_room"]
    async with httpx.AsyncClient(timeout=60) as client:
        p, d = await asyncio.gather(client.post(f"{pair.prefill.url}/v1/chat/completions", json=body),
                                    client.post(f"{pair.decode.url}/v1/chat/completions", json=body))
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    status, events = room_view(pair.prefill, room)
    assert status == "success"
    assert names(events) in paired_and_prefilled("kv_written", "ready_sent")
    status, events = room_view(pair.decode, room)
    assert status == "success"
    assert names(events) == ["queued", "blocks_reserved", "kv_requested", "kv_ready", "first_token", "finished"]
    wait_blocks_free(pair.prefill, pair.decode)


async def test_a_prefill_half_whose_partner_never_comes_is_failed_with_the_reason(pair):
    body = pair.room(chat("alone"))
    room = body["bootstrap_room"]
    async with httpx.AsyncClient(timeout=60) as client:
        p = await client.post(f"{pair.prefill.url}/v1/chat/completions", json=body)
    reason = "partner never arrived within 3 s (decode's KV request missing)"
    assert p.status_code == 504, p.text
    assert (error(p)["code"], error(p)["message"]) == ("room_timeout", f"bootstrap room {room}: {reason}")
    status, events = room_view(pair.prefill, room)
    # its forward pass ran without the partner; the blocks it finished with are freed with the room
    assert (status, names(events), failure(events)) == ("failed", ["queued", "prefilled", "failed"], reason)
    wait_blocks_free(pair.prefill, pair.decode)


async def test_a_decode_that_gives_up_before_pairing_fails_the_room_on_both(pair):
    """The decode's client leaves while the prefill holds only the decode's half: the prefill's room
    (``bootstrapping``, no event yet) is failed and closed, its late own half refused with the reason."""
    body = pair.room(chat("never mind"))
    room = body["bootstrap_room"]
    async with httpx.AsyncClient(timeout=60) as client:
        waiting = asyncio.ensure_future(client.post(f"{pair.decode.url}/v1/chat/completions", json=body))
        await asyncio.to_thread(wait_for_status, pair.prefill, room, "bootstrapping")
        assert room_view(pair.prefill, room) == ("bootstrapping", [])
        waiting.cancel()  # the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.to_thread(wait_for_status, pair.prefill, room, "failed")
        late = await client.post(f"{pair.prefill.url}/v1/chat/completions", json=body)
    reason = "decode aborted: the decode's client went away"
    status, events = room_view(pair.prefill, room)
    assert (status, names(events), failure(events)) == ("failed", ["failed"], reason)
    assert late.status_code == 409, late.text
    assert (error(late)["code"], error(late)["message"]) == (
        "room_conflict", f"bootstrap room {room}: room {room} is closed: {reason}")
    await asyncio.to_thread(wait_for_status, pair.decode, room, "failed")
    status, events = room_view(pair.decode, room)
    assert names(events) == ["queued", "blocks_reserved", "kv_requested", "failed"]
    assert failure(events) == f"room {room} aborted by decode: the decode's client went away"
    wait_blocks_free(pair.prefill, pair.decode)


async def test_a_paired_room_aborted_while_transferring_stops_before_kv_ready(pair):
    """The decode gives up (its KV timeout) after the write and before ``KVReady``: the prefill's
    room goes from ``transferring`` to ``failed``, and ``success`` is refused at the safe point."""
    arm(pair.prefill, "prefill.delay_ready", delay_s=KV_TIMEOUT_S + 3)
    body = pair.room(chat("too slow"))
    room = body["bootstrap_room"]
    async with httpx.AsyncClient(timeout=60) as client:
        p, d = await asyncio.gather(client.post(f"{pair.prefill.url}/v1/chat/completions", json=body),
                                    client.post(f"{pair.decode.url}/v1/chat/completions", json=body))
    assert (d.status_code, error(d)["code"]) == (504, "room_timeout"), d.text
    assert (p.status_code, error(p)["code"]) == (502, "peer_failed"), p.text
    status, events = room_view(pair.prefill, room)
    assert status == "failed"
    assert names(events) in paired_and_prefilled("kv_written", "failed")
    assert failure(events).startswith(f"decode aborted: no KV from prefill 127.0.0.1:{pair.bootstrap_port} "
                                      f"for room {room} within {KV_TIMEOUT_S} s")
    assert error(p)["message"] == failure(events)
    status, events = room_view(pair.decode, room)
    assert (status, names(events)) == ("failed", ["queued", "blocks_reserved", "kv_requested", "failed"])
    wait_blocks_free(pair.prefill, pair.decode, within_s=15)


def wait_for_status(server, room: int, status: str, within_s: float = 30.0) -> None:
    """Until ``GET /rooms/{room}`` answers ``status`` (bounded; polled every 50 ms)."""
    deadline = time.monotonic() + within_s
    while True:
        response = httpx.get(f"{server.url}/rooms/{room}", timeout=10)
        if response.status_code == 200 and response.json()["status"] == status:
            return
        assert time.monotonic() < deadline, f"room {room} never reached {status}: {response.text}"
        time.sleep(0.05)
