"""The typed fields of an error body (docs/protocol.md, Typed error fields): the stages write them and
the router reads them by the same names, and nothing the router decides depends on the message.

Both sides name the fields from the contract (``contract.errors.TYPED_FIELDS``, tests/contract); this
test reads what the stages' own error type writes with the router's reader. Real servers' answers are read the same
way in ``tests/stages/disagg/test_epd_cache.py`` (a failed encode, an image not cached: HTTP and in-band) and
``tests/stages/api/test_json_depth.py`` (every role's ``stage``).
"""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest

from contract.errors import TYPED_FIELDS
from router.errors import stage_failed
from router.dispatch.verdict import Failure, blame, blame_encoder, from_answer, from_event
from stages.api.errors import APIError, ErrorFields, stamped
from stages.disagg.errors import DisaggError, bad_gateway
from stages.disagg.server import _api_error

pytestmark = pytest.mark.unit

KEY, OTHER = "ab" * 32, "cd" * 32
OPENAI = ("message", "type", "param", "code")


def test_a_stage_error_body_is_the_openai_four_then_the_fields_it_knows():
    error = APIError(502, "The encoder failed", param="messages[0].content[0].image_ref", code="peer_failed",
                     fields=ErrorFields(stage="decode", room=7, image_key=KEY, peer_code="encode_failed"))
    assert list(error.body()["error"]) == [*OPENAI, *TYPED_FIELDS]
    assert [field.name for field in dataclasses.fields(ErrorFields)] == list(TYPED_FIELDS)
    bare = APIError(400, "bad", code="invalid_value")
    assert list(bare.body()["error"]) == list(OPENAI)  # unknown fields are absent, never null
    assert stamped(bare, "decode").body()["error"]["stage"] == "decode"
    assert stamped(error, "prefill").fields.stage == "decode"  # a stage it names already is kept


@pytest.mark.parametrize("message", ["The encoder failed on image " + KEY, "The encoder failed on image " + OTHER,
                                     "", "unrelated words"])
def test_the_routers_verdict_follows_the_field_whatever_the_message(message):
    """What a stage writes (HTTP body and in-band event), read by the router: the image is the
    ``image_key`` field's, even when the message names another image or none."""
    fields = ErrorFields(stage="prefill", room=7, image_key=KEY)
    body = APIError(502, message or "x", code="encode_failed", fields=fields).body()
    body["error"]["message"] = message
    sent = {KEY: "http://e:1", OTHER: "http://e:2"}
    for failure in (from_answer("prefill", "http://p:1", 502, json.dumps(body).encode()),
                    from_event("prefill", "http://p:1", body)):
        assert (failure.code, failure.room, failure.image_key) == ("encode_failed", 7, KEY)
        verdict = blame_encoder(failure, sent)
        assert (verdict.stage, verdict.url, verdict.status) == ("encoder", "http://e:1", 502)


def test_a_disagg_errors_image_key_is_kept():
    error = DisaggError(400, "not cached", "image_not_cached", "messages[0].content[0].image_ref.key", image_key=KEY)
    assert error.image_key == KEY and DisaggError(502, "m", "peer_failed").image_key is None


def test_a_decode_reporting_its_prefills_failure_names_the_prefills_code_and_image():
    """The decode's answer (``_api_error``, as its server writes it): its own stage and code, the
    prefill's code as ``peer_code`` and the image; the router's reader, then ``blame`` (the prefill
    not answered yet) and ``blame_encoder``, charge the encoder the image was sent to."""
    error = bad_gateway("bootstrap room 7: prefill p:1 failed room 7: boom", peer_code="encode_failed", image_key=KEY)
    body = _api_error(error, "decode", 7).body()
    assert body == {"error": {"message": "bootstrap room 7: prefill p:1 failed room 7: boom", "type": "server_error",
                              "param": None, "code": "peer_failed", "stage": "decode", "room": 7, "image_key": KEY,
                              "peer_code": "encode_failed"}}
    body["error"]["message"] = f"unrelated, image {OTHER}"
    for failure in (from_answer("decode", "http://d:1", 502, json.dumps(body).encode()),
                    from_event("decode", "http://d:1", body)):
        assert (failure.code, failure.peer_code, failure.image_key) == ("peer_failed", "encode_failed", KEY)
        verdict = blame_encoder(blame(failure, ("prefill", "http://p:1")), {KEY: "http://e:1", OTHER: "http://e:2"})
        assert (verdict.stage, verdict.url, verdict.status, verdict.code, verdict.room, verdict.image_key) == (
            "encoder", "http://e:1", 502, "encode_failed", 7, KEY)
    plain = _api_error(bad_gateway("bootstrap room 7: lost connection"), "decode", 7).body()["error"]
    assert set(plain) == {*OPENAI, "stage", "room"}  # no prefill code, no image: both absent


def test_the_routers_answer_to_its_client_keeps_the_fields():
    error = stage_failed(Failure("encoder", "http://e:1", 502, "the prefill stage reports: boom", "encode_failed",
                                 room=7, image_key=KEY))
    assert msgspec.json.decode(msgspec.json.encode(error.body())) == {"error": {
        "message": "The encoder stage failed: the prefill stage reports: boom", "type": "server_error",
        "param": None, "code": "encode_failed", "stage": "encoder", "room": 7, "image_key": KEY}}
    assert set(stage_failed(Failure("decode", "http://d:1", 504, "m", "upstream_timeout")).body()["error"]) == {
        *OPENAI, "stage"}
