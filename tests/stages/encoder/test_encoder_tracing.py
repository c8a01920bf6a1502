"""An encoder's OpenTelemetry traces (issue 36) on a real server, a real Redis and the real OTLP
receiver: an encode call with a ``traceparent`` is a request span under the client's, its room's
``encode`` root under that, and one ``encoder.vision_tower`` span per vision-tower call that encoded
the room's images (the ``batch`` events of ``GET /rooms/{room}``, same times); a cache hit runs no
tower; a failed call's root is ERROR with the reason."""

from __future__ import annotations

import base64
import io
import secrets
from collections.abc import Iterator

import httpx
import pytest

from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image
from tests.support.otlp_receiver import OTLPReceiver, SpanRecord
from tests.support.redis_fixtures import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(120)
TOLERANCE_NS = 2_000_000
ENCODE = "/v1/encode"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def encoder(start_server, redis_server, receiver):  # noqa: F811 (the fixture imported above)
    return start_server("encoder", "--model", str(model_dir("qwen2_vl")), "--redis-url", redis_server.url,
                        "--otlp-traces-endpoint", receiver.endpoint, env={"OTEL_BSP_SCHEDULE_DELAY": "50"})


def png(seed: int, size: tuple[int, int] = (56, 56)) -> str:
    buffer = io.BytesIO()
    random_image(*size, seed).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def traced_encode(encoder, room: int, images: list[dict]) -> tuple[httpx.Response, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    response = httpx.post(f"{encoder.url}{ENCODE}", json={"room": room, "images": images},
                          headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}, timeout=60)
    return response, trace_id, parent_id


def spans_of(receiver: OTLPReceiver, trace_id: str, *wanted: str) -> list[SpanRecord]:
    receiver.wait_for(lambda spans: set(wanted) <= {s.name for s in spans if s.trace_id == trace_id})
    return receiver.traces()[trace_id]


def one(spans: list[SpanRecord], name: str) -> SpanRecord:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name!r}: {sorted(s.name for s in spans)}"
    return found[0]


def events(encoder, room: int) -> list[dict]:
    response = httpx.get(f"{encoder.url}/rooms/{room}", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["events"]


def assert_spans(span: SpanRecord, start: float, end: float) -> None:
    assert abs(span.start_ns - start * 1e9) < TOLERANCE_NS and abs(span.end_ns - end * 1e9) < TOLERANCE_NS, \
        (span.name, span.start_ns / 1e9, span.end_ns / 1e9, start, end)


def test_an_encode_call_is_a_request_span_its_rooms_root_and_a_vision_tower_span(encoder, receiver):
    room = secrets.randbelow(1 << 40)
    response, trace_id, parent_id = traced_encode(encoder, room, [{"data": png(1)}, {"data": png(2)}])
    assert response.status_code == 200, response.text
    keys = [image["key"] for image in response.json()["images"]]
    spans = spans_of(receiver, trace_id, f"encoder {ENCODE}", "encode", "encoder.vision_tower")
    request, root = one(spans, f"encoder {ENCODE}"), one(spans, "encode")
    assert request.parent_span_id == parent_id and root.parent_span_id == request.span_id
    assert request.attributes["http.response.status_code"] == 200 and request.attributes["epd.room"] == room
    assert root.resource["service.name"] == "epd-encoder" and root.attributes["epd.room"] == room
    assert sorted(root.attributes["epd.encoded"]) == sorted(keys) and root.attributes["epd.images"] == 2
    towers = [s for s in spans if s.name == "encoder.vision_tower"]
    assert all(s.parent_span_id == root.span_id for s in towers)
    assert sorted(k for s in towers for k in s.attributes["epd.image_keys"]) == sorted(keys)
    timeline = events(encoder, room)
    batches = [e for e in timeline if e["event"] == "batch"]
    assert len(batches) == len(towers) >= 1
    for batch, tower in zip(batches, sorted(towers, key=lambda s: s.start_ns), strict=True):
        assert_spans(tower, batch["since"], batch["t"])
        assert tower.attributes["epd.batch_images"] == batch["batch_images"] >= len(batch["keys"])
    assert_spans(root, timeline[0]["t"], max(e["t"] for e in timeline))
    assert request.start_ns <= root.start_ns and root.end_ns <= request.end_ns
    assert not [s for s in receiver.orphans(outside={parent_id}) if s.trace_id == trace_id]


def test_a_cache_hit_runs_no_vision_tower(encoder, receiver):
    image = {"data": png(3)}
    first, _, _ = traced_encode(encoder, secrets.randbelow(1 << 40), [image])
    assert first.status_code == 200, first.text
    room = secrets.randbelow(1 << 40)
    again, trace_id, _ = traced_encode(encoder, room, [image])
    assert again.status_code == 200 and again.json()["images"][0]["status"] == "cached", again.text
    spans = spans_of(receiver, trace_id, f"encoder {ENCODE}", "encode")
    assert "encoder.vision_tower" not in {s.name for s in spans}
    assert one(spans, "encode").attributes["epd.cache_hits"] == [again.json()["images"][0]["key"]]


def test_a_failed_encode_has_an_error_root_with_the_reason(encoder, receiver):
    room = secrets.randbelow(1 << 40)
    response, trace_id, _ = traced_encode(encoder, room, [{"data": base64.b64encode(b"not an image").decode()}])
    assert response.status_code == 400, response.text
    spans = spans_of(receiver, trace_id, f"encoder {ENCODE}", "encode")
    root, request = one(spans, "encode"), one(spans, f"encoder {ENCODE}")
    assert root.is_error and root.status_message == response.json()["error"]["message"]
    assert not request.is_error and request.attributes["http.response.status_code"] == 400  # a 4xx: the client's
