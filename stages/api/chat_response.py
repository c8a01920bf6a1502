"""The chat answer's wire shapes: the builders of a ``chat.completion`` and of its stream's
``chat.completion.chunk`` bodies (plain dicts), and the pydantic models that describe those dicts
for ``/openapi.json`` (a unit test holds them together). The shapes are OpenAI's (the ``openai``
client's ``types.chat.chat_completion*``): ``n`` choices by ``index``, a choice's ``logprobs`` as
``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``, ``tool_calls`` in the message and in
stream deltas. Which choices to build from the engine's outputs is ``stages.api.chat_choices``'s job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field

from stages.api.common_schemas import StrictModel
from stages.engine.logprobs import TokenLogprob

Finish = Literal["stop", "length", "tool_calls"]
# token id -> (its text, its UTF-8 bytes or None where unknown); stages.api.token_text.TokenText
TokenText = Callable[[int], tuple[str, list[int] | None]]
LOGPROB_FLOOR = -9999.0  # OpenAI's value for "very unlikely"; also keeps -inf out of the JSON


class PromptTokensDetails(StrictModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix cache (--prefix-caching), "
                               "computed by no forward pass; in PD and EPD, the prefill's.")


class Usage(StrictModel):
    prompt_tokens: int = Field(description="Counted once, however many choices (n) share the prompt.")
    completion_tokens: int = Field(description="Tokens generated, summed over the n choices.")
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(StrictModel):
    token: str = Field(description="The token's text, decoded alone (a piece of a multi-byte character decodes "
                       "to U+FFFD; its bytes are exact).")
    logprob: float = Field(description=f"log_softmax of the model's raw logits at this position (before penalties, "
                           f"logit_bias, a response_format's grammar and temperature); at least {LOGPROB_FLOOR}.")
    bytes: list[int] | None = Field(description="The token's bytes (UTF-8 pieces join into the text).")


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="The top_logprobs most likely tokens at this position, "
                                           "most likely first (empty when top_logprobs is 0 or absent).")


class ChoiceLogprobs(StrictModel):
    content: list[ChatCompletionTokenLogprob] | None = Field(
        description="One entry per generated token, in order, the end-of-sequence token included.")


class CalledFunction(StrictModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text, as the model wrote them.")


class ChatCompletionMessageToolCall(StrictModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatCompletionMessage(StrictModel):
    role: Literal["assistant"]
    content: str | None = Field(description="The generated text; null when the answer is tool calls only.")
    tool_calls: list[ChatCompletionMessageToolCall] | None = Field(
        None, description="The model's calls of the request's tools (present only when it made some).")


class Choice(StrictModel):
    index: int = Field(description="Which of the request's n choices: 0 to n - 1.")
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = Field(description="Null unless the request set logprobs.")
    finish_reason: Finish = Field(
        description="stop: an end-of-sequence token or a stop string; length: max_tokens or the context; "
        "tool_calls: it ended with tool calls. A prefill server's answer always ends with length: its content "
        "is the first token.")


class ChatCompletion(StrictModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice] = Field(description="n choices, in index order.")
    usage: Usage


class ChoiceDeltaToolCallFunction(StrictModel):
    name: str | None = None
    arguments: str | None = Field(None, description="The next piece of the arguments' JSON text.")


class ChoiceDeltaToolCall(StrictModel):
    index: int = Field(description="Which tool call of the choice this piece belongs to.")
    id: str | None = Field(None, description="On a call's first piece.")
    type: Literal["function"] | None = None
    function: ChoiceDeltaToolCallFunction | None = None


class ChoiceDelta(StrictModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ChoiceDeltaToolCall] | None = None


class ChunkChoice(StrictModel):
    index: int = Field(description="Which of the request's n choices this piece belongs to.")
    delta: ChoiceDelta = Field(description="Empty on a choice's finish chunk, and on a chunk that carries only the "
                         "logprobs of tokens whose text is held back (a stop string may begin there).")
    logprobs: ChoiceLogprobs | None = Field(description="The logprobs of the tokens this chunk stands for; null "
                                            "unless the request set logprobs and the chunk has some.")
    finish_reason: Finish | None


class ChatCompletionChunk(StrictModel):
    """One server-sent event's data: a role chunk per choice first, then each choice's pieces (one
    choice per chunk, by ``index``), a finish chunk per choice. With ``stream_options.include_usage``
    every chunk has ``usage`` (null except on the last chunk, which has no choices)."""

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


def logprobs_body(entries: list[TokenLogprob], token_text: TokenText) -> dict:
    """A choice's ``logprobs`` object for ``entries`` (the engine's, one per token)."""
    return {"content": [{**_token(entry.token_id, entry.logprob, token_text),
                         "top_logprobs": [_token(token_id, logprob, token_text) for token_id, logprob in entry.top]}
                        for entry in entries]}


def _token(token_id: int, logprob: float, token_text: TokenText) -> dict:
    text, raw = token_text(token_id)
    return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": raw}


def message(content: str | None, tool_calls: list[dict] | None = None) -> dict:
    """The assistant message of a choice; ``tool_calls`` only when there are some."""
    return {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}


def choice(index: int, message_body: dict, finish_reason: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": message_body, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(request_id: str, created: int, model: str, choices: list[dict], usage_body: dict) -> dict:
    """A ``chat.completion`` of ``choices`` (``choice``'s, in index order)."""
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_body}


def chunk_choice(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chunk(request_id: str, created: int, model: str, choices: list[dict] | None, *,
          with_usage: bool = False, usage_body: dict | None = None) -> dict:
    """One ``chat.completion.chunk`` of ``choices`` (``chunk_choice``'s); ``choices=None`` is the usage
    chunk (``choices == []``). With ``include_usage`` every chunk carries a ``usage`` key, null except
    on the usage chunk."""
    body: dict = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                  "choices": choices or []}
    if with_usage:
        body["usage"] = usage_body
    return body
