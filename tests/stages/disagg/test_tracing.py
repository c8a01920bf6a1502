"""OpenTelemetry traces of the stages (issue 36) on real servers: a prefill and a decode over Mooncake
on loopback and a colocated server, all exporting with ``--otlp-traces-endpoint`` to the real OTLP
receiver (``tests.support.otlp_receiver``). A request's spans continue the client's ``traceparent``
on each stage (the middleware span its child, the room's timeline root the middleware span's), carry
the room timeline's own times (``GET /rooms/{room}``), a failed room's root is ERROR with its reason,
a prefill traced by nobody joins the decode's trace through the ``KVRequest``, and a server without
the flag exports nothing."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import httpx
import pytest

from telemetry.config import ENDPOINT_ENV
from tests.support.otlp_receiver import OTLPReceiver, SpanRecord
from tests.support.pd_pair import FAST, Pair, chat, start_prefill, wait_blocks_free

pytestmark = pytest.mark.timeout(300)
TOLERANCE_NS = 2_000_000  # a span's ends and its timeline events' t: within 2 ms
CHAT = "/v1/chat/completions"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # the SDK's batch exporter: every 50 ms, not every 5 s


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen2_vl")


@pytest.fixture(scope="module")
def pair(start_server, model, receiver) -> Pair:
    traced = ("--otlp-traces-endpoint", receiver.endpoint)
    prefill, port = start_prefill(start_server, model, "mooncake", *traced, env=FAST_EXPORT)
    decode = start_server("decode", "--model", str(model), "--transfer", "mooncake", *FAST[:2], *traced,
                          env=FAST_EXPORT)
    return Pair(prefill, decode, port)


def client_parent() -> tuple[str, str, str]:
    """A client's trace id, span id and the ``traceparent`` naming them (sampled)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def events_of(server, room: int) -> dict[str, float]:
    response = httpx.get(f"{server.url}/rooms/{room}", timeout=10)
    assert response.status_code == 200, response.text
    return {e["event"]: e["t"] for e in response.json()["events"]}


def one(spans: list[SpanRecord], name: str) -> SpanRecord:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name!r}: {sorted(s.name for s in spans)}"
    return found[0]


def names_under(receiver: OTLPReceiver, trace_id: str, *wanted: str) -> list[SpanRecord]:
    """The trace's spans once every name in ``wanted`` has come."""
    receiver.wait_for(lambda spans: set(wanted) <= {s.name for s in spans if s.trace_id == trace_id})
    return receiver.traces()[trace_id]


def orphans(receiver: OTLPReceiver, trace_id: str, client_span: str) -> list[SpanRecord]:
    """The trace's spans whose parent is neither among them nor the client's span."""
    return [s for s in receiver.orphans(outside={client_span}) if s.trace_id == trace_id]


def assert_spans(span: SpanRecord, start: float, end: float) -> None:
    assert abs(span.start_ns - start * 1e9) < TOLERANCE_NS, (span.name, span.start_ns, start)
    assert abs(span.end_ns - end * 1e9) < TOLERANCE_NS, (span.name, span.end_ns, end)


async def test_one_room_on_both_stages_is_one_trace_under_the_clients_span(pair, receiver):
    trace_id, parent_id, traceparent = client_parent()
    body = pair.room(chat("trace me", max_tokens=4))
    room = body["bootstrap_room"]
    async with httpx.AsyncClient(timeout=60, headers={"traceparent": traceparent}) as client:
        p, d = await asyncio.gather(client.post(f"{pair.prefill.url}{CHAT}", json=body),
                                    client.post(f"{pair.decode.url}{CHAT}", json=body))
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    spans = names_under(receiver, trace_id, f"prefill {CHAT}", f"decode {CHAT}", "prefill", "prefill.handshake",
                        "prefill.compute", "prefill.kv_write", "decode", "decode.queue", "decode.kv_wait",
                        "decode.first_token", "decode.stream")
    assert not orphans(receiver, trace_id, parent_id) and not receiver.bad_requests
    for role in ("prefill", "decode"):
        request, root = one(spans, f"{role} {CHAT}"), one(spans, role)
        assert request.parent_span_id == parent_id and request.kind == "SERVER"
        assert root.parent_span_id == request.span_id and not root.is_error and not request.is_error
        assert request.attributes["http.response.status_code"] == 200 and request.attributes["epd.room"] == room
        assert root.attributes["epd.room"] == room and root.resource["service.name"] == f"epd-{role}"
        assert request.start_ns <= root.start_ns and root.end_ns <= request.end_ns
        children = [s for s in spans if s.name.startswith(f"{role}.")]
        assert children and all(s.parent_span_id == root.span_id for s in children)
    prefill, decode = events_of(pair.prefill, room), events_of(pair.decode, room)
    assert_spans(one(spans, "prefill"), prefill["queued"], prefill["ready_sent"])
    assert_spans(one(spans, "prefill.handshake"), prefill["queued"], prefill["paired"])
    kv_write = one(spans, "prefill.kv_write")
    assert_spans(kv_write, prefill["kv_written"] - kv_write.seconds, prefill["kv_written"])
    assert kv_write.attributes["epd.bytes"] > 0
    assert_spans(one(spans, "decode"), decode["queued"], decode["finished"])
    assert_spans(one(spans, "decode.kv_wait"), decode["kv_requested"], decode["kv_ready"])
    assert_spans(one(spans, "decode.first_token"), decode["kv_ready"], decode["first_token"])
    assert_spans(one(spans, "decode.stream"), decode["first_token"], decode["finished"])
    assert one(spans, "decode.stream").attributes["epd.completion_tokens"] == 4
    wait_blocks_free(pair.prefill, pair.decode)


async def test_a_streamed_room_is_traced_until_its_stream_ends(pair, receiver):
    trace_id, parent_id, traceparent = client_parent()
    body = pair.room(chat("stream me", max_tokens=4, stream=True))
    async with httpx.AsyncClient(timeout=60, headers={"traceparent": traceparent}) as client:
        p, d = await asyncio.gather(client.post(f"{pair.prefill.url}{CHAT}", json=body),
                                    client.post(f"{pair.decode.url}{CHAT}", json=body))
    assert p.status_code == d.status_code == 200 and d.text.rstrip().endswith("data: [DONE]"), d.text
    spans = names_under(receiver, trace_id, f"decode {CHAT}", "decode", "decode.stream")
    request, root = one(spans, f"decode {CHAT}"), one(spans, "decode")
    assert root.parent_span_id == request.span_id and root.end_ns <= request.end_ns and not request.is_error
    wait_blocks_free(pair.prefill, pair.decode)


async def test_a_prefill_whose_partner_never_comes_has_an_error_root_with_the_reason(pair, receiver):
    trace_id, _, traceparent = client_parent()
    body = pair.room(chat("alone"))
    async with httpx.AsyncClient(timeout=60, headers={"traceparent": traceparent}) as client:
        p = await client.post(f"{pair.prefill.url}{CHAT}", json=body)
    assert p.status_code == 504, p.text
    spans = names_under(receiver, trace_id, f"prefill {CHAT}", "prefill")
    request, root = one(spans, f"prefill {CHAT}"), one(spans, "prefill")
    reason = "partner never arrived within 3 s (decode's KV request missing)"
    assert root.is_error and root.status_message == reason, (root.status_code, root.status_message)
    assert request.is_error and request.attributes["http.response.status_code"] == 504
    assert root.parent_span_id == request.span_id
    wait_blocks_free(pair.prefill, pair.decode)


async def test_a_prefill_traced_by_nobody_records_its_room_in_the_decodes_trace(pair, receiver):
    """Only the decode's request carries a traceparent: the prefill's room spans follow the one the
    decode sent in its ``KVRequest`` (the decode's request span), not the prefill's own new trace."""
    trace_id, parent_id, traceparent = client_parent()
    body = pair.room(chat("only the decode is traced", max_tokens=3))
    room = body["bootstrap_room"]
    async with httpx.AsyncClient(timeout=60) as client:
        p, d = await asyncio.gather(client.post(f"{pair.prefill.url}{CHAT}", json=body),
                                    client.post(f"{pair.decode.url}{CHAT}", json=body,
                                                headers={"traceparent": traceparent}))
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    spans = names_under(receiver, trace_id, f"decode {CHAT}", "decode", "prefill", "prefill.kv_write")
    decode_request = one(spans, f"decode {CHAT}")
    assert one(spans, "prefill").parent_span_id == decode_request.span_id
    assert f"prefill {CHAT}" not in {s.name for s in spans}  # the prefill's own request: a trace of its own
    assert not orphans(receiver, trace_id, parent_id)
    prefill_requests = [s for s in receiver.spans(f"prefill {CHAT}") if s.attributes.get("epd.room") == room]
    assert len(prefill_requests) == 1 and prefill_requests[0].parent_span_id is None
    wait_blocks_free(pair.prefill, pair.decode)


@pytest.fixture(scope="module")
def colocated(start_server, model, receiver):
    return start_server("colocated", "--model", str(model), "--kv-cache-mib", "16",
                        "--otlp-traces-endpoint", receiver.endpoint, env=FAST_EXPORT)


def test_a_colocated_request_is_one_span_with_its_token_counts(colocated, receiver):
    trace_id, parent_id, traceparent = client_parent()
    response = httpx.post(f"{colocated.url}{CHAT}", json=chat("colocated", max_tokens=3),
                          headers={"traceparent": traceparent}, timeout=60)
    assert response.status_code == 200, response.text
    [span] = names_under(receiver, trace_id, f"colocated {CHAT}")
    usage = response.json()["usage"]
    assert span.parent_span_id == parent_id and span.resource["service.name"] == "epd-colocated"
    assert span.attributes["epd.prompt_tokens"] == usage["prompt_tokens"]
    assert span.attributes["epd.completion_tokens"] == 3 and span.attributes["epd.finish_reason"] == "length"


def test_a_server_without_the_flag_exports_nothing(start_server, model, receiver):
    server = start_server("colocated", "--model", str(model), "--kv-cache-mib", "16", env={ENDPOINT_ENV: ""})
    trace_id, _, traceparent = client_parent()
    response = httpx.post(f"{server.url}{CHAT}", json=chat("untraced", max_tokens=2),
                          headers={"traceparent": traceparent}, timeout=60)
    assert response.status_code == 200, response.text
    with pytest.raises(AssertionError, match="waited"):
        receiver.wait_for(lambda spans: any(s.trace_id == trace_id for s in spans), timeout=1.0)


async def test_a_decode_whose_prefill_half_never_comes_has_an_error_root(pair, receiver):
    """The decode's room fails (the prefill never got its own half: its pair timeout): the decode's
    root span is ERROR with the room's reason, its request span ERROR with the status."""
    trace_id, _, traceparent = client_parent()
    body = pair.room(chat("no prefill half"))
    room = body["bootstrap_room"]
    async with httpx.AsyncClient(timeout=60, headers={"traceparent": traceparent}) as client:
        d = await client.post(f"{pair.decode.url}{CHAT}", json=body)
    assert d.status_code >= 500, d.text
    spans = names_under(receiver, trace_id, f"decode {CHAT}", "decode")
    request, root = one(spans, f"decode {CHAT}"), one(spans, "decode")
    response = httpx.get(f"{pair.decode.url}/rooms/{room}", timeout=10).json()
    failed = [e for e in response["events"] if e["event"] == "failed"]
    assert root.is_error and failed and root.status_message == failed[0]["reason"], (root, failed)
    assert request.is_error and root.parent_span_id == request.span_id
    wait_blocks_free(pair.prefill, pair.decode)
