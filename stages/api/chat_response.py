"""The chat answer's wire shapes: the builders of a ``chat.completion`` and of its stream's
``chat.completion.chunk`` bodies (plain dicts), and the pydantic models that describe those dicts
for ``/openapi.json`` (a unit test holds them together).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Strict):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix cache (--prefix-caching), "
                               "computed by no forward pass; in PD and EPD, the prefill's.")


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str


class Choice(_Strict):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: Literal["stop", "length"] = Field(description="A prefill server's answer always ends with "
                                                     "length: its content is the first token.")


class ChatCompletion(_Strict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(_Strict):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(_Strict):
    index: int
    delta: Delta
    logprobs: None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(_Strict):
    """One server-sent event's data. With ``stream_options.include_usage`` every chunk has ``usage``
    (null except on the last chunk, which has no choices)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object, ``prompt_tokens_details.cached_tokens`` included (as OpenAI sends it)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(request_id: str, created: int, model: str, text: str, finish_reason: str,
               prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
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
