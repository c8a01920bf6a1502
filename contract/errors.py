"""Every error code on the router <-> stage wire, its HTTP status and whom it blames; the typed error fields. Pure.

An error answer is an OpenAI error body, ``{"error": {"message", "type", "param", "code", ...}}``,
then the typed fields a stage knows (``TYPED_FIELDS``, absent when unknown, never null). The router
decides on the ``code`` and the typed fields only, never on the message (prose for people):

1. ``Code.X.status``: the HTTP status a stage answers with ``X``, and, when a 5xx, what an in-band
   error event (``data: {"error": ...}`` on a 200 stream) with ``X`` stands for (any other: 502).
2. ``Code.X.blame``: whom the router charges when a stage answers ``X`` (``Blame``): its breaker
   counts it, a retry avoids it, the client's error names it (``router.dispatch.verdict``).

A code appears as a literal here only; the router and the stages name ``Code.X`` (a ``str``: it is
written and compared as its value). Codes that one side alone answers (the router's admin API, a
stage's schema checks) stay with that side.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Final

# the typed fields of an error body besides the OpenAI four, in this order: the stage a failure is charged
# to, its bootstrap room, the image it is about (a cache key) and, for a decode reporting its prefill's
# failure (``peer_failed``), the prefill's own code
TYPED_FIELDS: Final = ("stage", "room", "image_key", "peer_code")


class Blame(Enum):
    """Whom a stage's error code charges (``router.dispatch.verdict``)."""

    CLIENT = "client"  # the request is wrong (4xx): answered as the stage wrote it, no retry, no charge
    STAGE = "stage"  # the answering stage itself: its breaker counts it, a retry avoids it
    PEER = "peer"  # its partner stage (a decode's prefill) failed or never came, if that one has not answered
    DECODE = "decode"  # a prefill's write into its decode failed: the decode, if its own call is silent
    ENCODER = "encoder"  # the encoder the router sent the image (``image_key``) to; none if it was not sent
    ROUTER = "router"  # the router's own choice (room, pair): retried elsewhere, no charge
    SHARED = "shared"  # a dependency every worker shares (epd's Redis): not retried, no charge
    BUSY = "busy"  # back-pressure (with Retry-After): another worker may take it, no charge
    LEAVING = "leaving"  # the stage is shutting down: out of rotation at once, retried if nothing was sent


class Code(StrEnum):
    # a request the client got wrong (both sides check it, with the same code)
    INVALID_JSON = "invalid_json"
    INVALID_VALUE = "invalid_value"
    REQUEST_TOO_LARGE = "request_too_large"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MODEL_NOT_FOUND = "model_not_found"
    ROOM_NOT_FOUND = "room_not_found"
    # an image (``cache.image_bytes`` reads the bytes; the router fetches http(s) URLs, the stages never do)
    INVALID_IMAGE_URL = "invalid_image_url"  # not a data: URL (nor http(s) where fetched), not base64
    REMOTE_IMAGE_URL = "remote_image_url"  # an http(s) URL sent to a stage (only the router fetches)
    INVALID_BASE64 = "invalid_base64"
    INVALID_IMAGE = "invalid_image"  # not an image, truncated, empty, or a size the processor refuses
    IMAGE_TOO_LARGE = "image_too_large"  # over --max-image-bytes or --max-image-pixels, or a bomb
    TOO_MANY_IMAGES = "too_many_images"  # over --max-images-per-request
    IMAGE_HOST_NOT_ALLOWED = "image_host_not_allowed"  # the router's --allowed-image-hosts
    IMAGE_FETCH_FAILED = "image_fetch_failed"  # the router's fetch of an allowed URL failed
    # a video (``cache.video_bytes`` reads the bytes and the frames; ``contract.video`` plans the sampling)
    INVALID_VIDEO_URL = "invalid_video_url"  # not a data: URL of a video (nor http(s) where fetched)
    INVALID_VIDEO = "invalid_video"  # corrupt, no video stream, no frames, an undecodable codec, unsampleable
    VIDEO_TOO_LARGE = "video_too_large"  # over --max-video-mb, --max-video-pixels or --max-video-seconds
    TOO_MANY_VIDEOS = "too_many_videos"  # over --max-videos-per-request
    VIDEO_NOT_SUPPORTED = "video_not_supported"  # the model takes no video (LLaVA-1.5)
    # a room of a disaggregated request (``stages.disagg.errors``)
    PEER_FAILED = "peer_failed"  # the other stage failed, refused or went away
    ROOM_TIMEOUT = "room_timeout"  # a room's deadline passed before the other stage came
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # a prefill's KV write into its decode failed
    ROOM_CONFLICT = "room_conflict"  # the room is already in flight, answered or aborted
    BOOTSTRAP_NOT_ALLOWED = "bootstrap_not_allowed"  # the prefill named is not in the decode's --allowed-bootstrap
    KV_POOL_FULL = "kv_pool_full"  # no KV blocks for the request now (with Retry-After)
    ROOM_ABORTED = "room_aborted"  # the encoder was told to give the room up (``/v1/abort``)
    # an image's embedding (epd: the encoder, and a prefill reading the embedding cache)
    ENCODE_FAILED = "encode_failed"  # the encoder failed on the image (a prefill's 502; the encoder's own is 500)
    ENCODE_ABANDONED = "encode_abandoned"  # the encode waited for ended unfinished; nothing is wrong with the image
    EMBEDDING_TIMEOUT = "embedding_timeout"  # the image was still being encoded at --embedding-timeout-s
    IMAGE_NOT_CACHED = "image_not_cached"  # neither cached nor being encoded
    EMBEDDING_MISMATCH = "embedding_mismatch"  # the cached entry does not fit the reference or the model
    ENCODE_TIMEOUT = "encode_timeout"  # the encoder's --encode-timeout-s
    CACHE_ENTRY_TOO_LARGE = "cache_entry_too_large"
    CACHE_UNAVAILABLE = "cache_unavailable"  # the embedding cache's Redis is down or slow
    # the stage itself
    ENGINE_ERROR = "engine_error"
    INTERNAL_ERROR = "internal_error"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    UNHEALTHY = "unhealthy"
    SERVER_OVERLOADED = "server_overloaded"  # at its limits (with Retry-After)
    DRAINING = "draining"  # shutting down (SIGTERM): took none of the request
    DRAIN_TIMEOUT = "drain_timeout"  # shutting down: aborted the request at its --shutdown-grace-s
    # the router's own verdict on a call to a stage
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"  # no connection, or it was lost
    UPSTREAM_TIMEOUT = "upstream_timeout"  # no answer within the router's deadline
    UPSTREAM_IDLE_TIMEOUT = "upstream_idle_timeout"  # an open stream sent nothing for --stream-idle-timeout-s

    @property
    def status(self) -> int:
        return RULES[self].status

    @property
    def blame(self) -> Blame:
        return RULES[self].blame


@dataclass(frozen=True)
class Rule:
    status: int
    blame: Blame


_C, _S = Blame.CLIENT, Blame.STAGE
RULES: Final[dict[Code, Rule]] = {
    Code.INVALID_JSON: Rule(400, _C), Code.INVALID_VALUE: Rule(400, _C), Code.REQUEST_TOO_LARGE: Rule(413, _C),
    Code.CONTEXT_LENGTH_EXCEEDED: Rule(400, _C), Code.MODEL_NOT_FOUND: Rule(404, _C),
    Code.ROOM_NOT_FOUND: Rule(404, _C),
    Code.INVALID_IMAGE_URL: Rule(400, _C), Code.REMOTE_IMAGE_URL: Rule(400, _C), Code.INVALID_BASE64: Rule(400, _C),
    Code.INVALID_IMAGE: Rule(400, _C), Code.IMAGE_TOO_LARGE: Rule(413, _C), Code.TOO_MANY_IMAGES: Rule(400, _C),
    Code.IMAGE_HOST_NOT_ALLOWED: Rule(400, _C), Code.IMAGE_FETCH_FAILED: Rule(400, _C),
    Code.INVALID_VIDEO_URL: Rule(400, _C), Code.INVALID_VIDEO: Rule(400, _C), Code.VIDEO_TOO_LARGE: Rule(413, _C),
    Code.TOO_MANY_VIDEOS: Rule(400, _C), Code.VIDEO_NOT_SUPPORTED: Rule(400, _C),
    Code.PEER_FAILED: Rule(502, Blame.PEER), Code.ROOM_TIMEOUT: Rule(504, Blame.PEER),
    Code.KV_TRANSFER_FAILED: Rule(502, Blame.DECODE), Code.ROOM_CONFLICT: Rule(409, Blame.ROUTER),
    Code.BOOTSTRAP_NOT_ALLOWED: Rule(403, Blame.ROUTER), Code.KV_POOL_FULL: Rule(503, Blame.BUSY),
    Code.ROOM_ABORTED: Rule(409, _C),
    Code.ENCODE_FAILED: Rule(502, Blame.ENCODER), Code.ENCODE_ABANDONED: Rule(503, Blame.ENCODER),
    Code.EMBEDDING_TIMEOUT: Rule(504, Blame.ENCODER), Code.IMAGE_NOT_CACHED: Rule(400, Blame.ENCODER),
    Code.EMBEDDING_MISMATCH: Rule(502, _S), Code.ENCODE_TIMEOUT: Rule(504, _S),
    Code.CACHE_ENTRY_TOO_LARGE: Rule(500, _S), Code.CACHE_UNAVAILABLE: Rule(503, Blame.SHARED),
    Code.ENGINE_ERROR: Rule(500, _S), Code.INTERNAL_ERROR: Rule(500, _S), Code.ENGINE_UNAVAILABLE: Rule(503, _S),
    Code.UNHEALTHY: Rule(503, _S), Code.SERVER_OVERLOADED: Rule(503, Blame.BUSY),
    Code.DRAINING: Rule(503, Blame.LEAVING), Code.DRAIN_TIMEOUT: Rule(503, Blame.LEAVING),
    Code.UPSTREAM_UNAVAILABLE: Rule(502, _S), Code.UPSTREAM_TIMEOUT: Rule(504, _S),
    Code.UPSTREAM_IDLE_TIMEOUT: Rule(504, _S),
}


def blaming(*blames: Blame) -> frozenset[Code]:
    """The codes that charge one of ``blames``."""
    return frozenset(code for code, rule in RULES.items() if rule.blame in blames)


def rule_of(code: str | None) -> Rule | None:
    """The rule of ``code`` as read off the wire, or None for a code not in ``Code`` (or none)."""
    return _BY_VALUE.get(code or "")


_BY_VALUE: Final = {code.value: rule for code, rule in RULES.items()}
