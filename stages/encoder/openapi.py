"""What the encoder's ``/openapi.json`` says of each route (the encoder reads its bodies itself, after
admission and within the byte cap, so FastAPI cannot see them). The ``*_ROUTE`` dicts are the keyword
arguments of each route's decorator; the request models they name (``EncodeRequest``,
``AbortRequest``, in ``stages.encoder.routes``) are added to the document by
``stages.api.openapi.install``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from contract.encode import ImageStatus
from stages.api.openapi import INTERNAL_ERROR, REF, RETRY_AFTER, error


class EncodedImage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str
    status: ImageStatus
    num_tokens: int | None
    seconds: float


class EncodeAnswer(BaseModel):
    """Every image of the request, in order, once its embedding is in the cache."""

    model_config = ConfigDict(extra="forbid")
    room: int
    images: list[EncodedImage]


class AbortAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    room: int
    cancelled: int


def _body(model: str) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "$ref": REF.format(model=model)}}}}}


ENCODE_ROUTE: dict = {
    "summary": "Encode images into the embedding cache (one room's images; each cached image is skipped)",
    "response_model": None,
    "openapi_extra": _body("EncodeRequest"),
    "responses": {
        200: {"model": EncodeAnswer, "description": "Every image is in the cache."},
        400: error("A bad body, image or video (the error's param names images[i]; codes invalid_json, "
                   "invalid_value, too_many_images, too_many_videos, invalid_base64, invalid_image, invalid_video, "
                   "invalid_video_url, video_not_supported, invalid_key, key_mismatch, ...)."),
        409: error("The room was aborted on this encoder while its images waited (code room_aborted)."),
        413: error("The body is over --max-body-mb (request_too_large), or an image is over --max-image-bytes "
                   "or --max-image-pixels (image_too_large, naming images[i]), or a video over --max-video-mb, "
                   "--max-video-pixels or --max-video-seconds (video_too_large)."),
        500: error(INTERNAL_ERROR + " Or an image could not be encoded or cached (encode_failed, "
                   "cache_entry_too_large)."),
        503: error("At --max-num-seqs + --max-waiting requests (server_overloaded, with Retry-After), or the "
                   "embedding cache's Redis is down or slow (cache_unavailable).", RETRY_AFTER),
        504: error("The images were not encoded within --encode-timeout-s (encode_timeout)."),
    },
}
ABORT_ROUTE: dict = {
    "summary": "Cancel a room's images that wait in this encoder's queue",
    "response_model": None,
    "openapi_extra": _body("AbortRequest"),
    "responses": {
        200: {"model": AbortAnswer, "description": "How many queued images of the room were cancelled."},
        400: error("A bad body (codes invalid_json, invalid_value, missing_required_parameter)."),
        413: error("The body is over --max-body-mb (code request_too_large)."),
    },
}
SERVER_INFO_ROUTE: dict = {
    "summary": "What this encoder is: model, encoder id, vision fingerprint, limits, resident memory",
    "responses": {200: {"description": "The encoder's info.", "content": {"application/json": {"schema": {
        "type": "object", "required": ["role", "model", "encoder_id", "vision_fingerprint", "limits"]}}}}},
}
