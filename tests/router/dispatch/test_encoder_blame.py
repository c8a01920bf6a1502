"""The encoder blame (router/dispatch/verdict.py's blame_encoder): a prefill's image failure charged
to the encoder the image was sent to, or to nobody (back-pressure); the image named by the typed
field, not the message; the typed fields read from answers and events alike. Pure: no sockets."""

from __future__ import annotations

import msgspec
import pytest

from router.dispatch.verdict import Failure, blame_encoder, from_answer, from_event

pytestmark = pytest.mark.unit

K1, K2, K3 = "1" * 64, "2" * 64, "3" * 64
IMAGES = {K1: "http://e:1", K2: ""}


def prefill_failure(status: int, code: str, key: str | None, message: str = "words") -> Failure:
    return Failure("prefill", "http://p:1", status, message, code, room=7, image_key=key)


def charged(url: str, status: int, code: str, key: str, message: str = "the prefill stage reports: words",
            retry_after: str | None = None) -> Failure:
    """The verdict on a prefill_failure: the encoder's (or, url "", nobody's), the message as the client reads it."""
    return Failure("encoder", url, status, message, code, room=7, image_key=key, retry_after=retry_after)


@pytest.mark.parametrize("failure, expected", [
    (prefill_failure(502, "encode_failed", K1), charged("http://e:1", 502, "encode_failed", K1)),
    (prefill_failure(504, "embedding_timeout", K1), charged("http://e:1", 504, "embedding_timeout", K1)),
    # the router's stale view of the cache: nobody to charge, back-pressure (retried, then a 503 with Retry-After)
    (prefill_failure(400, "image_not_cached", K2), charged("", 503, "encode_abandoned", K2, retry_after="1", message=(
        f"the encode of image {K2} that this request waited for (under way for another request) ended without an "
        "entry before the prefill looked. Nothing is wrong with the image; retry after 1 s."))),
    # the claim this attempt took lapsed (or ended) before the prefill looked: back-pressure, nobody charged
    (prefill_failure(400, "image_not_cached", K1), charged("", 503, "encode_abandoned", K1, retry_after="1", message=(
        f"the encode of image {K1} that this request waited for (sent to http://e:1) ended without an entry before "
        "the prefill looked. Nothing is wrong with the image; retry after 1 s."))),
    (prefill_failure(503, "encode_abandoned", K1), charged("", 503, "encode_abandoned", K1, retry_after="1")),
    (prefill_failure(503, "encode_abandoned", K2), charged("", 503, "encode_abandoned", K2, retry_after="1")),
    # a key the router did not put there (a client's own image_ref): the client's 400 as it is
    (prefill_failure(400, "image_not_cached", K3), None),
    (prefill_failure(400, "image_not_cached", None), None),  # no field: nothing to charge
    (prefill_failure(500, "internal_error", K1), None),
    (Failure("encoder", "http://e:1", 502, "The encoder failed", "encode_failed", image_key=K1), None),
])
def test_a_prefills_image_failure_is_charged_to_the_encoder_it_was_sent_to(failure, expected):
    assert blame_encoder(failure, IMAGES) == (expected or failure)
    assert expected is None or not expected.client_fault


@pytest.mark.parametrize("message", [f"The encoder failed on image {K2}: boom", "", "something else entirely"])
def test_the_image_is_the_one_the_field_names_whatever_the_message_says(message):
    """A message that names another key, or none: the ``image_key`` field decides (no prose parsed)."""
    raw = msgspec.json.encode({"error": {"message": message, "type": "server_error", "param": None,
                                         "code": "encode_failed", "stage": "prefill", "room": 7, "image_key": K1}})
    failure = from_answer("prefill", "http://p:1", 502, raw)
    assert (failure.room, failure.image_key) == (7, K1)
    verdict = blame_encoder(failure, IMAGES)
    assert (verdict.stage, verdict.url, verdict.status, verdict.image_key) == ("encoder", "http://e:1", 502, K1)
    without = msgspec.json.encode({"error": {"message": f"The encoder failed on image {K1}: boom",
                                             "code": "encode_failed"}})
    assert blame_encoder(from_answer("prefill", "http://p:1", 502, without), IMAGES).stage == "prefill"


@pytest.mark.parametrize("error, room, key", [
    ({"room": 7, "image_key": K1}, 7, K1),
    ({"room": "7", "image_key": 1}, None, None),  # the wrong types are no fields
    ({"room": True, "image_key": ""}, None, None),
    ({}, None, None),
])
def test_typed_fields_are_read_from_answers_and_events(error, room, key):
    body = {"error": {"message": "m", "code": "encode_failed", **error}}
    answer = from_answer("prefill", "http://p:1", 502, msgspec.json.encode(body))
    event = from_event("prefill", "http://p:1", body)
    assert (answer.room, answer.image_key) == (event.room, event.image_key) == (room, key)
