"""The OpenAI chat-completions wire schema.

The request model is validated by pydantic (after ``parse``'s bounded first pass); unknown fields
are ignored. Every limit and clamp is stated in its field's description, so it shows in
``/openapi.json``. The chat answer's and stream chunks' bodies and their models are in
``stages.api.chat_response``; the other answers' models (models list, health, errors) are at the end.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, field_validator,
                      model_validator)

MAX_MESSAGES = 2048  # as OpenAI's API
MAX_CONTENT_PARTS = 64  # per message
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # per stop string: the detokenizer holds back that many characters of a stream
MIN_TEMPERATURE = 0.01  # a sampled temperature below this is raised to it (smaller ones overflow the logits)
MIN_TOP_P = 1e-6  # a top_p below this is raised to it (both keep only the most likely token)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
ROOM_MAX = 2**63 - 1
MAX_HOST_CHARS = 255  # a DNS name's limit
MAX_IMAGE_SIDE = 2**31 - 1  # an image_ref's width or height (its pixel count is bounded by --max-image-pixels)


StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


def _integral(value: object) -> object:
    """JSON Schema's integers include 721.0; strict validation then takes it as 721, and still refuses
    ``true``, ``"721"`` and 721.5."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


AsInteger = BeforeValidator(_integral)  # after the bounds in Annotated, so that they show in the JSON schema
Integer = Annotated[int, AsInteger]
TokenCount = Annotated[int, Field(ge=1), AsInteger]


class _RequestModel(BaseModel):
    """Unknown fields are ignored; known ones take exactly their JSON type (``true`` is not 1, ``"0.5"``
    is not 0.5), as the JSON schema in /openapi.json says."""

    model_config = ConfigDict(extra="ignore", strict=True)


class ImageURL(_RequestModel):
    url: str = Field(description="A data: URL (data:image/...;base64,...). Stage servers fetch no remote URL.")
    detail: str | None = Field(None, description="Accepted and ignored.")


class ImageRef(_RequestModel):
    """An image already encoded into the embedding cache (EPD mode): its key and its size."""

    key: str = Field(pattern=r"^[0-9a-f]{64}$", description="The image's cache key: cache.keys.image_key(file bytes, "
                     "the encoder's vision_fingerprint from its /server_info), 64 lowercase hex digits.")
    width: Annotated[int, Field(ge=1, le=MAX_IMAGE_SIDE), AsInteger] = Field(
        description="The image's width in pixels, as in its file header (it sets the prompt's placeholder count).")
    height: Annotated[int, Field(ge=1, le=MAX_IMAGE_SIDE), AsInteger] = Field(
        description="The image's height in pixels. width x height counts against --max-image-pixels (413).")


class ContentPart(_RequestModel):
    """``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url": ...} | "..."}``, or
    (prefill and decode servers started with --redis-url only) ``{"type": "image_ref", "image_ref":
    {"key", "width", "height"}}``."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [  # the model validator below, for /openapi.json
        {"properties": {"type": {"const": "text"}, "text": {"type": "string"}}, "required": ["text"]},
        {"properties": {"type": {"const": "image_url"}, "image_url": {"not": {"type": "null"}}},
         "required": ["image_url"]},
        {"properties": {"type": {"const": "image_ref"}, "image_ref": {"not": {"type": "null"}}},
         "required": ["image_ref"]}]})
    type: Literal["text", "image_url", "image_ref"]
    text: str | None = Field(None, description="Required when type is text.")
    image_url: ImageURL | str | None = Field(None, description="Required when type is image_url: an object with "
                                             "a data: URL, or the URL itself. Colocated servers, and prefill and "
                                             "decode servers without --redis-url (PD mode).")
    image_ref: ImageRef | None = Field(None, description="Required when type is image_ref: EPD mode (prefill and "
                                       "decode servers started with --redis-url), which take images only this way. "
                                       "The prefill reads the embedding from the cache (waiting for an encode in "
                                       "flight); a key neither cached nor being encoded is refused at once.")

    @model_validator(mode="after")
    def _field_for_type(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs a 'text' field")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("an image_url part needs an 'image_url' field")
        if self.type == "image_ref" and self.image_ref is None:
            raise ValueError("an image_ref part needs an 'image_ref' field")
        return self

    @property
    def url(self) -> str:
        image_url = self.image_url
        if image_url is None:
            raise ValueError(f"a {self.type} part has no image_url")
        return image_url if isinstance(image_url, str) else image_url.url


class ChatMessage(_RequestModel):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="developer (OpenAI's current name for the system role) is taken as system.")
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = Field(
        None, description=f"Text, or at most {MAX_CONTENT_PARTS} text and image parts. Images count against the "
        "server's --max-images-per-request (400 too_many_images) and --max-image-bytes / --max-image-pixels (413). "
        "A server takes one kind of image part: image_url (colocated, PD mode) or image_ref (EPD mode); the "
        "other kind gets 400 image_url_not_supported / image_ref_not_supported.")

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        return "system" if role == "developer" else role


class StreamOptions(_RequestModel):
    include_usage: bool = Field(False, description="Send a last chunk with usage and no choices.")


class ChatCompletionRequest(_RequestModel):
    """An OpenAI chat completion request. Unknown fields are ignored, including those that would change
    the logits or the answer's shape (``logit_bias``, ``frequency_penalty``, ``presence_penalty``,
    ``logprobs``, ``tools``, ``response_format``): this server implements none of them."""

    messages: list[ChatMessage] = Field(
        min_length=1, max_length=MAX_MESSAGES,
        description=f"The conversation: 1 to {MAX_MESSAGES} messages. A prompt longer than the model's context "
        "(the server's --max-model-len) gets 400 context_length_exceeded.")
    model: str | None = Field(None, max_length=256, description="If given, the served model's id (GET /v1/models); "
                              "any other gets 404 model_not_found.")
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, allow_inf_nan=False,
        description=f"In [0, 2]; 0 is greedy decoding. Default 1. A value between 0 and {MIN_TEMPERATURE} is raised "
        f"to {MIN_TEMPERATURE} (smaller ones would scale the logits out of float range). NaN and infinities get 400.")
    top_p: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False,
        description=f"Nucleus sampling, in [0, 1]. Default 1. A value below {MIN_TOP_P} (0 included, as OpenAI "
        f"takes it) is raised to {MIN_TOP_P}: either keeps only the most likely token. NaN gets 400.")
    top_k: Annotated[int, Field(ge=-1), AsInteger] | None = Field(
        None, description="Extension: sample among the k most likely tokens. 0 or -1 disables it, and so "
        "does a k at or above the vocabulary size (it would keep every token).")
    max_tokens: TokenCount | None = Field(
        None, description="Tokens to generate at most. The prompt plus this must fit the model's context "
        "(--max-model-len), else 400 context_length_exceeded. Default: what is left of the context.")
    max_completion_tokens: TokenCount | None = Field(None, description="As max_tokens, which it overrides.")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters "
        "each. Generation stops before the first one found, which is not returned.")
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), AsInteger] | None = Field(
        None, description="A signed 64-bit integer seeding this request's own sampler: a "
        "seeded request draws the same tokens whatever shares its batch.")
    n: Integer | None = Field(1, json_schema_extra={"enum": [1, None]},
                          description="Must be 1: one choice per request.")
    stream: bool | None = Field(False, description="Answer as server-sent events (text/event-stream): "
                                "chat.completion.chunk objects, then `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(False, description="Extension, for benchmarks: generate past end-of-sequence "
                                    "tokens until max_tokens or a stop string.")
    # prefill/decode disaggregation: the fields SGLang's PD router injects (one room for both stages)
    bootstrap_host: str | None = Field(
        None, max_length=MAX_HOST_CHARS,
        description="Prefill and decode servers (required there, with bootstrap_port and "
        "bootstrap_room; 400 without): the prefill's bootstrap address, the same in both halves of a request. "
        "A decode dials only prefills its --allowed-bootstrap allows (403 otherwise). Colocated servers ignore it.")
    bootstrap_port: Annotated[int, Field(ge=1, le=65535), AsInteger] | None = Field(
        None, description="The prefill's bootstrap port.")
    bootstrap_room: Annotated[int, Field(ge=0, le=ROOM_MAX), AsInteger] | None = Field(
        None, description="The room pairing the prefill half and the decode half of one request; unique among "
        "requests in flight.")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError(f"n must be 1 (this server returns one choice per request), got {n}")
        return n

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# --- responses other than chat's (those are in stages.api.chat_response) ------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelCard(_Strict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Strict):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Strict):
    status: Literal["ok"]


class ErrorDetail(_Strict):
    message: str
    type: str = Field(description="invalid_request_error (4xx) or server_error (5xx).")
    param: str | None = Field(description="The request parameter at fault, as a path: messages[0].content[1].")
    code: str | None = Field(description="A stable machine-readable reason, e.g. context_length_exceeded, "
                             "request_too_large, server_overloaded.")
    # the typed fields (``stages.api.errors.TYPED_FIELDS``): present where known, absent otherwise
    stage: str | None = Field(None, description="The role that answers: colocated, prefill, decode or encoder.")
    room: int | None = Field(None, description="The bootstrap room the error is about.")
    image_key: str | None = Field(None, description="The content key of the image the error is about.")
    peer_code: str | None = Field(None, description="A decode reporting its prefill's failure (peer_failed): "
                                  "the prefill's own code for it.")


class ErrorBody(_Strict):
    """Every non-2xx answer, and the in-band event that ends a stream whose request failed."""

    error: ErrorDetail


def model_card(model_id: str, created: int, owned_by: str) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}
