"""A chat message as a client sends it: its text, image and video parts (``image_url`` / ``video_url``, or
an EPD stage's ``image_ref`` / ``video_ref``), its tool calls, and the rules between them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from contract.video import VideoPlan, VideoProbe, VideoSampling, plan

from stages.api.schema_types import (MAX_CONTENT_PARTS, MAX_ID_CHARS, MAX_IMAGE_SIDE, MAX_NAME_CHARS, MAX_TOOL_CALLS,
                                     AsInteger, RequestModel)


class ImageURL(RequestModel):
    url: str = Field(description="A data: URL (data:image/...;base64,...). Stage servers fetch no remote URL.")
    detail: str | None = Field(None, description="Accepted and ignored.")


class ImageRef(RequestModel):
    """An image already encoded into the embedding cache (EPD mode): its key and its size."""

    key: str = Field(pattern=r"^[0-9a-f]{64}$", description="The image's cache key: cache.keys.image_key(file bytes, "
                     "the encoder's vision_fingerprint from its /server_info), 64 lowercase hex digits.")
    width: Annotated[int, Field(ge=1, le=MAX_IMAGE_SIDE), AsInteger] = Field(
        description="The image's width in pixels, as in its file header (it sets the prompt's placeholder count).")
    height: Annotated[int, Field(ge=1, le=MAX_IMAGE_SIDE), AsInteger] = Field(
        description="The image's height in pixels. width x height counts against --max-image-pixels (413).")


VideoField = bool | int | float | str | None  # a VideoProbe's or VideoSampling's field: scalars only


class VideoURL(RequestModel):
    url: str = Field(description="A data: URL (data:video/mp4|webm|quicktime;base64,...). Stage servers fetch no "
                     "remote URL (the router fetches those from its allow-list).")


class VideoRef(RequestModel):
    """A video already sent to an encoder (EPD mode): its cache key, what its file says (``probe``) and
    the sampling that makes its frames, resolved by the router (``contract.video``)."""

    key: str = Field(pattern=r"^[0-9a-f]{64}$", description="The video's cache key: cache.keys.video_key(file bytes, "
                     "sampling, the encoder's vision_fingerprint).")
    probe: Annotated[dict[str, VideoField], Field(max_length=16)] = Field(
        description="contract.video.VideoProbe as JSON: width, height, frames, fps, codec.")
    sampling: Annotated[dict[str, VideoField], Field(max_length=16)] = Field(
        description="contract.video.VideoSampling as JSON: the request's sampling.")

    def plan(self) -> VideoPlan:
        """The video's plan; ValueError (VideoPlanError) for a probe or sampling that does not make one."""
        return plan(VideoProbe.from_json(self.probe), VideoSampling.from_json(self.sampling))


class ContentPart(RequestModel):
    """``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url": ...} | "..."}``, or
    (prefill and decode servers started with --redis-url only) ``{"type": "image_ref", "image_ref":
    {"key", "width", "height"}}``."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [  # the model validator below, for /openapi.json
        {"properties": {"type": {"const": "text"}, "text": {"type": "string"}}, "required": ["text"]},
        {"properties": {"type": {"const": "image_url"}, "image_url": {"not": {"type": "null"}}},
         "required": ["image_url"]},
        {"properties": {"type": {"const": "image_ref"}, "image_ref": {"not": {"type": "null"}}},
         "required": ["image_ref"]},
        {"properties": {"type": {"const": "video_url"}, "video_url": {"not": {"type": "null"}}},
         "required": ["video_url"]},
        {"properties": {"type": {"const": "video_ref"}, "video_ref": {"not": {"type": "null"}}},
         "required": ["video_ref"]}]})
    type: Literal["text", "image_url", "image_ref", "video_url", "video_ref"]
    text: str | None = Field(None, description="Required when type is text.")
    image_url: ImageURL | str | None = Field(None, description="Required when type is image_url: an object with "
                                             "a data: URL, or the URL itself. Colocated servers, and prefill and "
                                             "decode servers without --redis-url (PD mode).")
    image_ref: ImageRef | None = Field(None, description="Required when type is image_ref: EPD mode (prefill and "
                                       "decode servers started with --redis-url), which take images only this way. "
                                       "The prefill reads the embedding from the cache (waiting for an encode in "
                                       "flight); a key neither cached nor being encoded is refused at once.")
    video_url: VideoURL | str | None = Field(None, description="Required when type is video_url: an object with a "
                                             "data: URL of a video (mp4, webm, mov), or the URL itself. Sampled as "
                                             "the model's video processor does; mm_processor_kwargs overrides.")
    video_ref: VideoRef | None = Field(None, description="Required when type is video_ref: EPD mode, as image_ref.")

    @model_validator(mode="after")
    def _field_for_type(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs a 'text' field")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("an image_url part needs an 'image_url' field")
        if self.type == "image_ref" and self.image_ref is None:
            raise ValueError("an image_ref part needs an 'image_ref' field")
        if self.type == "video_url" and self.video_url is None:
            raise ValueError("a video_url part needs a 'video_url' field")
        if self.type == "video_ref" and self.video_ref is None:
            raise ValueError("a video_ref part needs a 'video_ref' field")
        return self

    @property
    def is_video(self) -> bool:
        return self.type in ("video_url", "video_ref")

    @property
    def url(self) -> str:
        url = self.video_url if self.type == "video_url" else self.image_url
        if url is None:
            raise ValueError(f"a {self.type} part has no URL")
        return url if isinstance(url, str) else url.url


class FunctionCall(RequestModel):
    name: str = Field(max_length=MAX_NAME_CHARS, description="The function the assistant called.")
    arguments: str = Field(description="Its arguments, as the JSON text the assistant wrote.")


class ToolCall(RequestModel):
    """A tool call of an earlier assistant turn, as the server answered it."""

    id: str = Field(max_length=MAX_ID_CHARS, description="The call's id; a later tool message answers it by "
                    "tool_call_id.")
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    model_config = ConfigDict(json_schema_extra={"anyOf": [  # the model validator below, for /openapi.json
        {"properties": {"role": {"const": "tool"}, "tool_call_id": {"type": "string"}, "tool_calls": {"type": "null"},
                        "content": {"anyOf": [{"not": {"type": "array"}},
                                              {"items": {"properties": {"type": {"const": "text"}}}}]}},
         "required": ["tool_call_id"]},
        {"properties": {"role": {"enum": ["system", "developer", "user"]}, "tool_call_id": {"type": "null"},
                        "tool_calls": {"type": "null"}}},
        {"properties": {"role": {"const": "assistant"}, "tool_call_id": {"type": "null"}}}]})
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer (OpenAI's current name for the system role) is taken as system. A tool message "
        "answers an assistant's tool call: it needs tool_call_id, and its content is text (a string or text parts).")
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = Field(
        None, description=f"Text, or at most {MAX_CONTENT_PARTS} text and image parts. Images count against the "
        "server's --max-images-per-request (400 too_many_images) and --max-image-bytes / --max-image-pixels (413). "
        "A server takes one kind of image part: image_url (colocated, PD mode) or image_ref (EPD mode); the "
        "other kind gets 400 image_url_not_supported / image_ref_not_supported. An assistant message with "
        "tool_calls may have none (null).")
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = Field(
        None, description=f"Assistant messages only: the tool calls that turn made (at most {MAX_TOOL_CALLS}), "
        "rendered back into the prompt by the model's chat template.")
    tool_call_id: str | None = Field(None, max_length=MAX_ID_CHARS, description="Tool messages only, and "
                                     "required there: the id of the tool call this message answers.")

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        return "system" if role == "developer" else role

    @model_validator(mode="after")
    def _fields_for_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message may have 'tool_calls'")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs a 'tool_call_id'")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("only a tool message may have a 'tool_call_id'")
        if self.role == "tool" and isinstance(self.content, list) and any(p.type != "text" for p in self.content):
            raise ValueError("a tool message's content is text only")
        return self
