"""The encoder's ``POST /v1/encode`` and ``POST /v1/abort``: what the router sends, what it gets back. Pure.

1. The router sends a room's images not cached yet, each once: ``EncodeRequest`` (an image as a
   ``data:`` URL, ``url``, or as base64, ``data``; with its cache key, checked against the bytes).
   A video is an item with ``video`` set: the sampling the router resolved for it
   (``contract.video.VideoSampling.to_json()``, within the encoder's ``/server_info`` ``video``); its key
   is ``cache.keys.video_key(bytes, video, fingerprint)`` and its entry holds the whole video's embedding.
2. The encoder answers once every image's embedding is in the cache: ``EncodeAnswer``, one
   ``EncodedImage`` per image in order, its ``status`` one of ``IMAGE_STATUSES``.
3. A client gone, or the attempt given up: the router sends ``AbortRequest``; the room's waiting
   requests are answered 409 ``room_aborted`` and queued work nobody else waits for is cancelled
   (``AbortAnswer.cancelled`` counts it).

The encoder checks a body with its own models (``stages.encoder.routes``: the same fields, the
messages of its 400s); tests/contract holds the two equal.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec


ENCODED: Final = "encoded"  # encoded here by this request (or one it joined): ``num_tokens`` and ``seconds`` set
CACHED: Final = "cached"  # in the cache already: nothing done
PENDING_ELSEWHERE: Final = "pending_elsewhere"  # another encoder holds its claim: a prefill waits for it in the cache
IMAGE_STATUSES: Final = (ENCODED, CACHED, PENDING_ELSEWHERE)
ImageStatus = Literal["encoded", "cached", "pending_elsewhere"]


class EncodeImage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One image or video: exactly one of ``url`` (a ``data:`` URL) and ``data`` (base64); ``key``: its
    cache key, computed by the encoder when absent; ``video``: set for a video, its resolved sampling
    (``VideoSampling.to_json()``)."""

    key: str | None = None
    url: str | None = None
    data: str | None = None
    video: dict | None = None


class EncodeRequest(msgspec.Struct, forbid_unknown_fields=True):
    room: int
    images: list[EncodeImage]


class EncodedImage(msgspec.Struct, forbid_unknown_fields=True):
    key: str
    status: ImageStatus
    num_tokens: int | None  # the embedding's rows, for ``encoded``
    seconds: float  # the request's arrival -> the embedding in the cache, for ``encoded`` (else 0)


class EncodeAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """Every image of the request, in order, once its embedding is in the cache."""

    room: int
    images: list[EncodedImage]


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True):
    room: int


class AbortAnswer(msgspec.Struct, forbid_unknown_fields=True):
    room: int
    cancelled: int  # queued encodes cancelled (no other request waited for them)
