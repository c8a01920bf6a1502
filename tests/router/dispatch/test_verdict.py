"""Failure verdicts (router/dispatch/verdict.py): a stage's answer or error event read as a
Failure (status, code, client fault, busy), and the blame moved to the unfinished partner for a
peer's error. Pure: no sockets."""

from __future__ import annotations

import json

import pytest

from router.dispatch.verdict import Failure, blame, from_answer, from_event, timed_out, unreachable
from router.errors import stage_failed

pytestmark = pytest.mark.unit

P, D = "http://127.0.0.1:8100", "http://127.0.0.1:8200"


def test_failures_from_answers_and_events():
    raw = b'{"error":{"message":"bad image","type":"invalid_request_error","param":"p","code":"invalid_image"}}'
    failure = from_answer("decode", D, 400, raw)
    assert (failure.message, failure.code, failure.raw, failure.client_fault) == ("bad image", "invalid_image", raw, True)
    assert from_answer("decode", D, 409, b'{"error":{"message":"m","code":"room_conflict"}}').client_fault is False
    assert from_answer("decode", D, 502, b"<html>bad gateway</html>").message == "<html>bad gateway</html>"
    event = from_event("decode", D, {"error": {"message": "lost the prefill", "code": "peer_failed"}})
    assert (event.status, event.code, event.client_fault) == (502, "peer_failed", False)
    assert from_event("decode", D, {"error": {"message": "m", "code": "room_timeout"}}).status == 504
    assert unreachable("decode", D, "ServerDisconnectedError").unreachable
    assert timed_out("decode", D, 5, "--upstream-timeout-s").message == \
        f"{D} did not answer within 5 s (--upstream-timeout-s)"


def test_a_busy_stage_is_back_pressure_not_a_fault():
    """A 503 with Retry-After is the stage at its limits: busy (no breaker charge, tried elsewhere,
    the client's 503 keeps the Retry-After); a 503 without it, or another status with it, is not."""
    raw = b'{"error":{"message":"at its limit","code":"server_overloaded"}}'
    busy = from_answer("prefill", P, 503, raw, "2")
    assert (busy.busy, busy.retry_after, busy.client_fault, busy.unreachable) == (True, "2", False, False)
    assert not from_answer("prefill", P, 503, b'{"error":{"message":"redis","code":"cache_unavailable"}}').busy
    assert not from_answer("prefill", P, 500, raw, "2").busy
    error = stage_failed(busy)
    assert (error.status, error.headers, error.code) == (503, {"Retry-After": "2"}, "server_overloaded")
    assert stage_failed(Failure("prefill", P, 503, "m", "engine_unavailable")).headers == {"Retry-After": "1"}



def test_blame_goes_to_the_unfinished_partner_only_for_peer_errors():
    peer = from_event("decode", D, {"error": {"message": "partner never arrived within 3 s", "code": "peer_failed"}})
    blamed = blame(peer, ("prefill", P))
    assert (blamed.stage, blamed.url, blamed.code) == ("prefill", P, "peer_failed")
    assert blamed.message == "the decode stage reports: partner never arrived within 3 s"
    assert blame(peer, None) is peer  # the prefill answered fine: the decode is to blame
    own = from_event("decode", D, {"error": {"message": "engine died", "code": "engine_error"}})
    assert blame(own, ("prefill", P)) is own


def test_blame_moved_to_the_prefill_takes_its_code_and_image_from_the_decodes_fields():
    """The decode names its prefill's code (``peer_code``) and image (``image_key``): the prefill's
    failure has that code and image, the room kept; without ``peer_code`` the decode's code stays."""
    key = "ab" * 32
    raw = json.dumps({"error": {"message": "prefill failed room 9: x", "type": "server_error", "param": None,
                                         "code": "peer_failed", "stage": "decode", "room": 9, "image_key": key,
                                         "peer_code": "encode_failed"}}).encode()
    answer = from_answer("decode", D, 502, raw)
    assert (answer.code, answer.peer_code, answer.image_key, answer.room) == ("peer_failed", "encode_failed", key, 9)
    blamed = blame(answer, ("prefill", P))
    assert (blamed.stage, blamed.url, blamed.status, blamed.code, blamed.room, blamed.image_key, blamed.peer_code) == (
        "prefill", P, 502, "encode_failed", 9, key, None)
    assert blamed.message == "the decode stage reports: prefill failed room 9: x"
    assert blame(answer, None) is answer  # the prefill answered: the decode's own failure, fields as they came
    timeout = from_event("decode", D, {"error": {"message": "no KV", "code": "room_timeout", "room": 9,
                                                 "peer_code": "", "image_key": 5}})
    assert (timeout.peer_code, timeout.image_key) == (None, None)  # empty or wrongly typed: no field
    assert (blame(timeout, ("prefill", P)).code, blame(timeout, ("prefill", P)).image_key) == ("room_timeout", None)
