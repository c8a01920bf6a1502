"""A stage's room timeline (``stages.timeline``: events ``{"event", "t", ...fields}``, wall-clock
seconds) -> the spans to record for it (pure; called by whoever records a room when it ends, on any
thread). A span is made only where both its ends are in the timeline: a missing event makes no span,
a malformed one is skipped, and nothing here raises.

A stage's spans of one request (``stages.tracing``): ``"{role} {path}"`` (SERVER, e.g.
``prefill /v1/chat/completions``, ``encoder /v1/encode``; from the request's arrival until its response
is sent whole; ``http.response.status_code``, ``epd.room``; ERROR on a 5xx or an in-band stream error;
a colocated server's adds ``epd.prompt_tokens``, ``epd.completion_tokens``, ``epd.finish_reason``), the
child of the caller's ``traceparent``; under it the room's spans below, recorded when the room ends
(a prefill whose request came untraced records them under the decode's ``KVRequest.traceparent``).

Spans (spec 0 is the stage's root when its ends exist; the others are its children, or the
incoming parent's when it does not):
    role     root                              children
    prefill  prefill: queued -> ready_sent     prefill.handshake: queued -> paired (the decode's half coming)
                  | failed                     prefill.embeddings_wait: queued -> embeddings_ready (EPD: the
                                               embeddings are read from the room's arrival, beside the pairing)
                                               prefill.compute: queued -> prefilled (the forward pass starts when
                                               the HTTP half arrives, paired or not; EPD without --prefill-overlap:
                                               from embeddings_ready; an embeddings_ready with overlap_s came
                                               during the compute and starts nothing)
                                               prefill.kv_write: kv_written's t - seconds -> t (epd.bytes)
    decode   decode: queued -> finished        decode.queue: queued -> blocks_reserved
                  | failed                     decode.kv_wait: kv_requested -> kv_ready (epd.blocks)
                                               decode.first_token: kv_ready -> first_token
                                               decode.stream: first_token -> finished (epd.completion_tokens,
                                               epd.finish_reason)
    encoder  encode: queued -> its last event  encoder.video_decode: video_decoded's t - seconds -> t
                                               encoder.vision_tower: batch's since -> t, one per vision-tower
                                               call that encoded the room's images (epd.image_keys: the
                                               room's in it, epd.images, epd.batch_images: all it took)
    any      -                                 <role>.<event> for every event carrying ``since``: since -> t
                                               (``batch`` is named ``vision_tower``, e.g. encoder.vision_tower;
                                               prefill's ``chunk`` is prefill.chunk)
So a stage adds a span by marking an event with ``since``. Attributes: an event's fields as
``epd.<field>`` (``key`` -> epd.image_key, ``keys`` -> epd.image_keys and epd.images, ``code`` ->
epd.error_code and error.type; ``t``, ``since``, ``seconds`` and ``reason`` are not attributes); a span
between two events carries the fields of the events its row names (``_BETWEEN``). The root carries
``epd.room``, its first event's fields, ``epd.cached_tokens`` when an event has them, and on an encoder
the keys by outcome (epd.image_keys: all; epd.cache_hits, epd.pending_elsewhere, epd.encoded). A
``failed`` event makes the root's error its ``reason``. Another role gets the generic spans only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeGuard

from telemetry.api import SpanSpec

__all__ = ["SpanSpec", "spans_of"]

_ROOTS = {  # role -> (root span, the events that end it, the last present; () = the room's last event)
    "prefill": ("prefill", ("ready_sent", "failed")),
    "decode": ("decode", ("finished", "failed")),
    "encoder": ("encode", ()),
}
_BETWEEN = {  # role -> (span, start events: the first present not after the end, end event, events it carries)
    "prefill": (("prefill.handshake", ("queued",), "paired", ()),
                ("prefill.embeddings_wait", ("queued",), "embeddings_ready", ("embeddings_ready",)),
                ("prefill.compute", ("embeddings_ready", "queued"), "prefilled", ("prefilled",))),
    "decode": (("decode.queue", ("queued",), "blocks_reserved", ()),
               ("decode.kv_wait", ("kv_requested",), "kv_ready", ("blocks_reserved",)),
               ("decode.first_token", ("kv_ready",), "first_token", ()),
               ("decode.stream", ("first_token",), "finished", ("finished",))),
}
_TIMED = {"kv_written": "kv_write", "video_decoded": "video_decode"}  # events whose ``seconds`` end at t
# an event carrying this field starts no span between two events: the overlapped prefill's embeddings_ready
# (with overlap_s) came while its compute ran, which began when the room was queued
_NOT_A_START = {"embeddings_ready": "overlap_s"}
_RENAMED = {"batch": "vision_tower", **_TIMED}  # event -> its span's name after ``<role>.``
_ENCODER_KEYS = {"encoded": "epd.encoded", "cache_hit": "epd.cache_hits", "pending_elsewhere": "epd.pending_elsewhere"}
_NOT_ATTRIBUTES = {"event", "t", "since", "seconds", "reason"}
_FIELD_NAMES = {"key": "image_key", "keys": "image_keys", "code": "error_code"}
FAILED = "failed"


def spans_of(role: str, events: Sequence[Mapping], room: int | None = None) -> list[SpanSpec]:
    """The spans of one room's timeline on a stage of ``role`` (the table above), root first."""
    kept = [e for e in events if _valid(e)]
    first: dict[str, Mapping] = {}
    for e in kept:
        first.setdefault(e["event"], e)
    specs: list[SpanSpec] = []
    root = _root(role, kept, first, room)
    if root is not None:
        specs.append(root)
    parent = 0 if root is not None else None
    for name, starts, end_event, carried in _BETWEEN.get(role, ()):
        end = first.get(end_event)
        start = None if end is None else next(
            (first[s] for s in starts if s in first and first[s]["t"] <= end["t"]
             and _NOT_A_START.get(s, "") not in first[s]), None)
        if start is not None and end is not None:
            attributes = {k: v for c in carried if c in first for k, v in _attributes(first[c]).items()}
            specs.append(SpanSpec(name, start["t"], end["t"], attributes, parent=parent))
    for e in kept:
        began = _began(e)
        if began is not None:
            name = f"{role}.{_RENAMED.get(e['event'], e['event'])}"
            specs.append(SpanSpec(name, began, e["t"], _attributes(e), parent=parent))
    return specs


def _root(role: str, kept: list[Mapping], first: Mapping[str, Mapping], room: int | None) -> SpanSpec | None:
    if role not in _ROOTS or "queued" not in first:
        return None
    name, enders = _ROOTS[role]
    ends = [e for e in kept if e["event"] in enders] if enders else kept
    if not ends:
        return None
    start, end = first["queued"]["t"], max(e["t"] for e in ends)
    if end < start:
        return None
    attributes: dict[str, object] = {} if room is None else {"epd.room": room}
    attributes.update(_attributes(first["queued"]))
    cached = [e["cached_tokens"] for e in kept if "cached_tokens" in e]
    if cached:
        attributes["epd.cached_tokens"] = cached[-1]
    if role == "encoder":
        keyed = [e for e in kept if e["event"] in _ENCODER_KEYS and "key" in e]
        attributes["epd.image_keys"] = tuple(str(e["key"]) for e in keyed)
        for event, attribute in _ENCODER_KEYS.items():
            attributes[attribute] = tuple(str(e["key"]) for e in keyed if e["event"] == event)
    failed = first.get(FAILED)
    if failed is not None:
        attributes.update(_attributes(failed))
    error = None if failed is None else str(failed.get("reason") or FAILED)
    return SpanSpec(name, start, end, attributes, error=error)


def _valid(event: object) -> bool:
    return (isinstance(event, Mapping) and isinstance(event.get("event"), str) and _number(event.get("t")))


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _began(event: Mapping) -> float | None:
    """When an event that closes a span began: its ``since``, or for a timed event ``t - seconds``."""
    since, seconds, t = event.get("since"), event.get("seconds"), event["t"]
    if _number(since) and since <= t:
        return since
    if event["event"] in _TIMED and _number(seconds) and seconds >= 0:
        return t - seconds
    return None


def _attributes(event: Mapping) -> dict[str, object]:
    """An event's fields as span attributes (the module's docstring)."""
    out: dict[str, object] = {}
    for name, value in event.items():
        if name in _NOT_ATTRIBUTES or value is None:
            continue
        out[f"epd.{_FIELD_NAMES.get(name, name)}"] = tuple(value) if isinstance(value, list) else value
    keys = event.get("keys")
    if isinstance(keys, (list, tuple)) and "images" not in event:
        out["epd.images"] = len(keys)
    if "code" in event:
        out["error.type"] = str(event["code"])
    return out
