"""``telemetry.timeline_spans``: each role's room timeline (as ``stages.timeline`` records it) -> the
spans it makes, failed rooms and missing events included (pure)."""

from __future__ import annotations

import pytest

from telemetry.timeline_spans import SpanSpec, spans_of

pytestmark = pytest.mark.unit

T = 1_700_000_000.0


def ev(event: str, dt: float, **fields: object) -> dict:
    return {"event": event, "t": T + dt, **fields}


PREFILL_EPD = [ev("queued", 0.0), ev("paired", 0.010), ev("embeddings_ready", 0.050),
               ev("chunk", 0.080, since=T + 0.050, tokens=512), ev("chunk", 0.100, since=T + 0.080, tokens=100),
               ev("prefilled", 0.100, prompt_tokens=612, cached_tokens=64),
               ev("kv_written", 0.130, bytes=4096, seconds=0.025), ev("ready_sent", 0.131)]
DECODE = [ev("queued", 0.0), ev("blocks_reserved", 0.002, blocks=8, cached_blocks=0), ev("kv_requested", 0.003),
          ev("kv_ready", 0.140), ev("first_token", 0.141), ev("finished", 0.500, completion_tokens=32,
                                                                    finish_reason="length")]
ENCODER = [ev("queued", 0.0, images=3), ev("batch", 0.200, since=T + 0.010, keys=["k1", "k2"]),
           ev("video_decoded", 0.005, key="v1", frames=4, seconds=0.004),
           ev("encoded", 0.201, key="k1", num_tokens=64), ev("encoded", 0.202, key="k2", num_tokens=64),
           ev("cache_hit", 0.203, key="k3")]


def by_name(specs: list[SpanSpec]) -> dict[str, SpanSpec]:
    return {s.name: s for s in specs}


def approx(spec: SpanSpec, start: float, end: float) -> bool:
    return spec.start == pytest.approx(T + start, abs=1e-6) and spec.end == pytest.approx(T + end, abs=1e-6)


def test_a_prefill_room_in_epd():
    specs = spans_of("prefill", PREFILL_EPD, room=42)
    names = [s.name for s in specs]
    assert names == ["prefill", "prefill.handshake", "prefill.embeddings_wait", "prefill.compute", "prefill.chunk",
                     "prefill.chunk", "prefill.kv_write"]
    spans = by_name(specs)
    root = specs[0]
    assert root.parent is None and root.error is None and approx(root, 0.0, 0.131)
    assert root.attributes["epd.room"] == 42 and root.attributes["epd.cached_tokens"] == 64
    assert all(s.parent == 0 for s in specs[1:])
    assert approx(spans["prefill.handshake"], 0.0, 0.010)
    assert approx(spans["prefill.embeddings_wait"], 0.0, 0.050)  # read from the room's arrival
    assert approx(spans["prefill.compute"], 0.050, 0.100)  # without the overlap: after the embeddings
    assert spans["prefill.compute"].attributes == {"epd.prompt_tokens": 612, "epd.cached_tokens": 64}
    chunks = [s for s in specs if s.name == "prefill.chunk"]
    assert approx(chunks[0], 0.050, 0.080) and chunks[0].attributes == {"epd.tokens": 512}
    assert approx(spans["prefill.kv_write"], 0.105, 0.130) and spans["prefill.kv_write"].attributes == {"epd.bytes": 4096}


def test_a_prefill_room_in_pd_computes_from_its_arrival():
    """The forward pass starts when the HTTP half arrives, beside the pairing (issue 35)."""
    events = [e for e in PREFILL_EPD if e["event"] not in ("embeddings_ready", "chunk")]
    spans = by_name(spans_of("prefill", events))
    assert "prefill.embeddings_wait" not in spans and "epd.room" not in spans["prefill"].attributes
    assert approx(spans["prefill.compute"], 0.0, 0.100) and approx(spans["prefill.handshake"], 0.0, 0.010)


def test_a_room_prefilled_before_it_paired_still_has_its_compute_span():
    events = [ev("queued", 0.0), ev("prefilled", 0.03), ev("paired", 0.05), ev("ready_sent", 0.07)]
    spans = by_name(spans_of("prefill", events))
    assert approx(spans["prefill.compute"], 0.0, 0.03) and approx(spans["prefill.handshake"], 0.0, 0.05)


def test_embeddings_ready_after_prefilled_the_compute_span_starts_at_queued():
    """The overlapped prefill: embeddings may be marked ready after compute began; no span runs backwards."""
    events = [ev("queued", 0.0), ev("paired", 0.01), ev("prefilled", 0.05), ev("embeddings_ready", 0.06),
              ev("ready_sent", 0.07)]
    spans = by_name(spans_of("prefill", events))
    assert approx(spans["prefill.compute"], 0.0, 0.05)
    assert all(s.end >= s.start for s in spans.values())


def test_an_overlapped_embeddings_ready_does_not_start_the_compute_span():
    """With --prefill-overlap the compute runs from the room's arrival while the embeddings come
    (``embeddings_ready`` carries ``overlap_s``): the compute span is not cut at the last embedding."""
    events = [ev("queued", 0.0), ev("paired", 0.01), ev("embeddings_ready", 0.04, overlap_s=0.04, computed_tokens=9),
              ev("prefilled", 0.05), ev("ready_sent", 0.07)]
    spans = by_name(spans_of("prefill", events))
    assert approx(spans["prefill.compute"], 0.0, 0.05) and approx(spans["prefill.embeddings_wait"], 0.0, 0.04)
    assert spans["prefill.embeddings_wait"].attributes == {"epd.overlap_s": 0.04, "epd.computed_tokens": 9}


def test_a_failed_prefill_room_is_an_error_root_with_the_reason_and_its_code():
    events = [ev("queued", 0.0), ev("paired", 0.01), ev("failed", 0.02, reason="decode went away", code="peer_x")]
    specs = spans_of("prefill", events, room=1)
    root = specs[0]
    assert root.name == "prefill" and root.error == "decode went away" and approx(root, 0.0, 0.02)
    assert root.attributes["epd.error_code"] == "peer_x" and root.attributes["error.type"] == "peer_x"
    assert [s.name for s in specs] == ["prefill", "prefill.handshake"]


def test_a_decode_room():
    specs = spans_of("decode", DECODE, room=9)
    spans = by_name(specs)
    assert [s.name for s in specs] == ["decode", "decode.queue", "decode.kv_wait", "decode.first_token", "decode.stream"]
    assert approx(spans["decode"], 0.0, 0.5) and spans["decode"].error is None
    assert approx(spans["decode.queue"], 0.0, 0.002)
    assert approx(spans["decode.kv_wait"], 0.003, 0.140) and spans["decode.kv_wait"].attributes["epd.blocks"] == 8
    assert approx(spans["decode.first_token"], 0.140, 0.141)
    assert approx(spans["decode.stream"], 0.141, 0.5)
    assert spans["decode.stream"].attributes == {"epd.completion_tokens": 32, "epd.finish_reason": "length"}


def test_a_decode_room_that_failed_waiting_for_kv():
    events = DECODE[:3] + [ev("failed", 30.0, reason="kv timed out")]
    specs = spans_of("decode", events)
    assert [s.name for s in specs] == ["decode", "decode.queue"]
    assert specs[0].error == "kv timed out" and approx(specs[0], 0.0, 30.0)


def test_an_encoder_call():
    specs = spans_of("encoder", ENCODER, room=5)
    spans = by_name(specs)
    root = specs[0]
    assert root.name == "encode" and approx(root, 0.0, 0.203) and root.error is None
    assert root.attributes["epd.images"] == 3 and root.attributes["epd.room"] == 5
    assert root.attributes["epd.image_keys"] == ("k1", "k2", "k3")
    assert root.attributes["epd.cache_hits"] == ("k3",) and root.attributes["epd.encoded"] == ("k1", "k2")
    assert root.attributes["epd.pending_elsewhere"] == ()
    tower = spans["encoder.vision_tower"]
    assert approx(tower, 0.010, 0.200) and tower.parent == 0
    assert tower.attributes == {"epd.image_keys": ("k1", "k2"), "epd.images": 2}
    video = spans["encoder.video_decode"]
    assert approx(video, 0.001, 0.005) and video.attributes == {"epd.image_key": "v1", "epd.frames": 4}


def test_a_failed_encoder_call():
    specs = spans_of("encoder", [ev("queued", 0.0, images=1), ev("failed", 0.3, reason="bad image")])
    assert len(specs) == 1 and specs[0].error == "bad image" and approx(specs[0], 0.0, 0.3)


def test_missing_events_make_no_span_and_never_raise():
    assert spans_of("decode", []) == []
    assert spans_of("prefill", [ev("paired", 0.0)]) == []  # no queued, no end
    # no end yet: no root; the spans that exist hang under the incoming parent
    specs = spans_of("decode", DECODE[:4])
    assert [s.name for s in specs] == ["decode.queue", "decode.kv_wait"] and all(s.parent is None for s in specs)
    junk = [None, {"event": 3, "t": 1.0}, {"event": "queued"}, {"event": "queued", "t": "x"},
            {"event": "chunk", "t": T, "since": "x"}, {"event": "kv_written", "t": T, "seconds": -1},
            {"event": "x", "t": T, "since": T + 5}]
    assert spans_of("prefill", junk) == []  # type: ignore[arg-type]


def test_any_event_with_since_is_a_span_of_its_role():
    specs = spans_of("decode", [*DECODE, ev("sample", 0.3, since=T + 0.2, steps=3)])
    extra = by_name(specs)["decode.sample"]
    assert approx(extra, 0.2, 0.3) and extra.parent == 0 and extra.attributes == {"epd.steps": 3}
    other = spans_of("colocated", [ev("queued", 0.0), ev("step", 0.2, since=T + 0.1)])
    assert [(s.name, s.parent) for s in other] == [("colocated.step", None)]
