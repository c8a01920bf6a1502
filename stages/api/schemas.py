"""The OpenAI chat-completions wire schema: the request model (validated by pydantic, unknown fields
ignored) and the response / stream-chunk bodies (plain dicts, built by the functions below)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 4


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Lenient):
    url: str
    detail: str | None = None


class ContentPart(_Lenient):
    """``{"type": "text", "text": ...}`` or ``{"type": "image_url", "image_url": {"url": ...} | "..."}``."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | str | None = None

    @model_validator(mode="after")
    def _field_for_type(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs a 'text' field")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("an image_url part needs an 'image_url' field")
        return self

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url  # type: ignore[union-attr]


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension; 0 or -1 disables
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # extension, for benchmarks
    # prefill/decode disaggregation: the fields SGLang's PD router injects (one room for both stages)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, le=2**63 - 1)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError(f"n must be 1 (this server returns one choice per request), got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(strings)}")
        if any(not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# --- responses -------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(request_id: str, created: int, model: str, text: str, finish_reason: str,
               prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chunk(request_id: str, created: int, model: str, delta: dict | None, finish_reason: str | None = None,
          *, with_usage: bool = False, usage_body: dict | None = None) -> dict:
    """One ``chat.completion.chunk``; ``delta=None`` is the usage chunk (``choices == []``). With
    ``include_usage`` every chunk carries a ``usage`` key, null except on the usage chunk."""
    body: dict = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                  "choices": [] if delta is None else
                  [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if with_usage:
        body["usage"] = usage_body
    return body


def model_card(model_id: str, created: int, owned_by: str) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}
