"""The OpenAI legacy completions wire schema (``POST /v1/completions``), and its bounded first pass.

As for chat (``stages.api.parse``): msgspec first decodes the body into a shape that bounds every list
(prompts, token ids, stop strings; logit_bias's entries are counted before the map is built) and takes scalars where the schema takes
scalars, so a hostile body costs no more than its size; what passes is validated by pydantic
(``CompletionRequest``), whose errors are the API's usual 400s. Given the server's ``TextBound``, a
text prompt that cannot fit the context is refused (400 ``context_length_exceeded``) before it is
tokenized.

Text only: a prompt is a string (tokenized without any chat template) or token ids; several prompts
(a list of strings or of token-id lists) each get their own ``n`` choices, choice ``index`` =
prompt index * n + sequence (vLLM's numbering). The response models at the end describe the dicts
``stages.api.completion_bodies`` builds, for ``/openapi.json``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Raw, Struct, UnsetType
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from contract.bootstrap import ROOM_MAX
from contract.errors import Code
from stages.api.chat_response import Usage
from stages.api.errors import APIError, bad_request, validation_error
from stages.api.bounded_json import Scalar, check_map, decode_shape, more_items, shape_error
from stages.api.parse import STOP_LIST_BOUND
from stages.api.common_schemas import StrictModel
from stages.api.schema_types import (GEN, MAX_HOST_CHARS, MAX_LOGIT_BIAS_TOKENS, MAX_STOP_STRINGS, MIN_TEMPERATURE,
                                     MIN_TOP_P, SEED_MAX, SEED_MIN, AsInteger, RequestModel, StopString, TokenCount)
from stages.api.schemas import ChatCompletionRequest, StopAndStreamFields, StreamOptions
from stages.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N
from stages.text_bound import TextBound

MAX_PROMPTS = 128  # prompts per request (each gets n choices)
MAX_PROMPT_TOKENS = 1 << 20  # token ids per prompt (the context bounds them far lower; this bounds the parse)
DEFAULT_MAX_TOKENS = 16  # as OpenAI's completions API

TokenId = Annotated[int, Field(ge=0), AsInteger]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class _StreamOptions(Struct, gc=False):
    include_usage: Scalar | UnsetType = UNSET


_TokenList = Annotated[list[Scalar], Meta(max_length=MAX_PROMPT_TOKENS)]
_Prompt = _TokenList | Scalar  # a prompt: one string or token-id list, or a list of strings
_Prompts = Annotated[list[_TokenList | Scalar], Meta(max_length=MAX_PROMPTS)]  # token-id lists
_WHITESPACE = b" \t\r\n"


class _Request(Struct, gc=False):
    """Every field of ``CompletionRequest``, each as loose as the schema allows but no looser in size."""

    prompt: Raw | UnsetType = UNSET  # its bytes: a list of lists is counted before it is built (``_prompt``)
    stop: Annotated[list[Scalar], Meta(max_length=STOP_LIST_BOUND)] | Scalar | UnsetType = UNSET
    logit_bias: Raw | UnsetType = UNSET  # a map: its entries counted before it is built (``bounded_json.check_map``)
    stream_options: _StreamOptions | Scalar | UnsetType = UNSET
    model: Scalar | UnsetType = UNSET
    suffix: Scalar | UnsetType = UNSET
    max_tokens: Scalar | UnsetType = UNSET
    temperature: Scalar | UnsetType = UNSET
    top_p: Scalar | UnsetType = UNSET
    top_k: Scalar | UnsetType = UNSET
    n: Scalar | UnsetType = UNSET
    best_of: Scalar | UnsetType = UNSET
    stream: Scalar | UnsetType = UNSET
    logprobs: Scalar | UnsetType = UNSET
    echo: Scalar | UnsetType = UNSET
    presence_penalty: Scalar | UnsetType = UNSET
    frequency_penalty: Scalar | UnsetType = UNSET
    repetition_penalty: Scalar | UnsetType = UNSET
    seed: Scalar | UnsetType = UNSET
    user: Scalar | UnsetType = UNSET
    ignore_eos: Scalar | UnsetType = UNSET
    bootstrap_host: Scalar | UnsetType = UNSET
    bootstrap_port: Scalar | UnsetType = UNSET
    bootstrap_room: Scalar | UnsetType = UNSET


# best_of <= n (n is 1 when absent or null), the model validator below, for /openapi.json: one branch per n
BEST_OF_WITHIN_N: list[Any] = [{"properties": {"best_of": {"anyOf": [{"type": "null"}, {"maximum": 1}]}}}] + [
    {"properties": {"n": {"type": "number", "minimum": n}, "best_of": {"anyOf": [{"type": "null"}, {"maximum": n}]}},
     "required": ["n"]} for n in range(2, MAX_N + 1)]


class CompletionRequest(StopAndStreamFields, RequestModel):
    """An OpenAI (legacy) completion request, text only. Unknown fields are ignored; ``suffix`` and a
    ``best_of`` above ``n`` would change the answer and are refused (400 naming them)."""

    model_config = ConfigDict(json_schema_extra={"anyOf": BEST_OF_WITHIN_N})

    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        description=f"A string, a list of at most {MAX_PROMPTS} strings, token ids, or a list of token-id lists; "
        "each prompt gets its own n choices (choice index = prompt index * n + i). Text is tokenized without a "
        "chat template; token ids must be in the model's vocabulary and no image placeholder. Prefill and "
        "decode servers take one prompt per request (one bootstrap room).")
    model: str | None = Field(None, max_length=256, description="If given, the served model's id (GET /v1/models); "
                              "any other gets 404 model_not_found.")
    suffix: str | None = Field(None, description="Not supported: any value but null or \"\" gets 400.")
    max_tokens: Annotated[int, Field(ge=1), AsInteger] | None = Field(
        DEFAULT_MAX_TOKENS, description=f"Tokens to generate per choice at most; default {DEFAULT_MAX_TOKENS} "
        f"(as OpenAI), or the checkpoint's max_new_tokens within the context ({GEN}). Each prompt plus this must "
        "fit the context (400 context_length_exceeded).")
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, allow_inf_nan=False,
        description=f"In [0, 2]; 0 is greedy. Default: the checkpoint's ({GEN}), else 1. Between 0 and "
        f"{MIN_TEMPERATURE}: raised to it.")
    top_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False,
                                description=f"Nucleus sampling in [0, 1], default the checkpoint's ({GEN}), "
                                f"else 1; below {MIN_TOP_P}: raised to it.")
    top_k: Annotated[int, Field(ge=-1), AsInteger] | None = Field(
        None, description="Extension: sample among the k most likely tokens; 0 or -1 (or k >= vocabulary) disables it.")
    n: Annotated[int, Field(ge=1, le=MAX_N), AsInteger] | None = Field(
        1, description=f"Choices per prompt, 1 to {MAX_N}; a seeded request's choice i draws from seed + i.")
    best_of: TokenCount | None = Field(None, description="Only null or a value <= n (best_of > n: 400).")
    stream: bool | None = Field(False, description="Answer as server-sent events: text_completion chunks, then "
                                "`data: [DONE]`.")
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), AsInteger] | None = Field(
        None, description=f"0 to {MAX_LOGPROBS}: each token's logprob and (top_logprobs) the k most likely with the "
        "chosen one; values are the model's raw log_softmax (before penalties, bias and temperature).")
    echo: bool | None = Field(False, description="Prepend the prompt's text to each choice; with logprobs, the "
                              "prompt tokens' logprobs too (the first token's is null).")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} non-empty strings; generation stops before the first one found.")
    presence_penalty: Penalty | None = Field(None, description="In [-2, 2] (vLLM's semantics).")
    frequency_penalty: Penalty | None = Field(None, description="In [-2, 2] (vLLM's semantics).")
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0, allow_inf_nan=False)] | None = Field(
        None, description="Extension, in (0, 2]; 1 is none (vLLM's semantics).")
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]] | None \
        = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS, description="Token id (as a string) -> a bias in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] added to its logit.")
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), AsInteger] | None = Field(
        None, description="A signed 64-bit integer seeding this request's own samplers.")
    user: str | None = Field(None, max_length=256, description="Accepted and ignored.")
    ignore_eos: bool | None = Field(False, description="Extension: generate past end-of-sequence tokens.")
    bootstrap_host: str | None = Field(None, max_length=MAX_HOST_CHARS, description="Prefill and decode servers "
                                       "(required there, as for chat): the prefill's bootstrap address.")
    bootstrap_port: Annotated[int, Field(ge=1, le=65535), AsInteger] | None = Field(
        None, description="The prefill's bootstrap port.")
    bootstrap_room: Annotated[int, Field(ge=0, le=ROOM_MAX), AsInteger] | None = Field(
        None, description="The room pairing the prefill half and the decode half of one request.")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported by this server")
        return suffix

    @model_validator(mode="after")
    def _best_of_within_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of > (self.n or 1):
            raise APIError(400, f"Invalid value for 'best_of': best_of ({self.best_of}) above n ({self.n or 1}) is "
                           "not supported by this server.", param="best_of", code=Code.INVALID_VALUE)
        return self

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts, each a string or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]  # one token-id prompt
        return prompt  # type: ignore[return-value]  # a list of strings or of token-id lists


# a body a server's ``generate`` may get (``stages.api.routes.Generate``): both carry the bootstrap fields
AnyRequest = ChatCompletionRequest | CompletionRequest


def parse_completion_request(raw: bytes | bytearray, bound: TextBound | None = None) -> CompletionRequest:
    """JSON whatever the Content-Type says, validated by the schema; nested too deep: 400 before any
    parser recurses. With ``bound``, a text prompt that cannot fit the context: 400 before pydantic."""
    shape = decode_shape(raw, _Request)
    if shape.logit_bias is not UNSET:
        check_map(shape.logit_bias, "logit_bias", MAX_LOGIT_BIAS_TOKENS)
    prompt = _prompt(shape.prompt)
    if bound is not None:
        _check_text_fits(prompt, bound)
    try:
        return CompletionRequest.model_validate_json(msgspec.json.encode(msgspec.structs.replace(shape, prompt=prompt)))
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _prompt(raw: Raw | UnsetType) -> object:
    """The prompt field, built within its bounds: msgspec builds a whole array before it checks its
    length, and a million small arrays cost seconds, so a list of lists (its first item an array) has
    its items counted on its bytes first. UNSET: the field is absent (pydantic names it)."""
    if raw is UNSET:
        return UNSET
    view = memoryview(raw)
    start = bytes(view[:64]).lstrip(_WHITESPACE)
    nested = start[:1] == b"[" and start[1:].lstrip(_WHITESPACE)[:1] == b"["
    if nested and more_items(view, MAX_PROMPTS):
        raise bad_request(f"Invalid value for 'prompt': Expected `array` of length <= {MAX_PROMPTS}", "prompt",
                          Code.INVALID_VALUE)
    try:
        return msgspec.json.decode(view, type=_Prompts if nested else _Prompt)
    except msgspec.ValidationError as exc:
        raise shape_error(str(exc), prefix="prompt") from None


def _check_text_fits(prompt: object, bound: TextBound) -> None:
    """400 ``context_length_exceeded`` if a text prompt makes more tokens than the context holds."""
    texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)] \
        if isinstance(prompt, list) else []
    for i, text in enumerate(texts):
        if len(text) > bound.max_chars:
            raise bad_request(f"This model's maximum context length is {bound.max_model_len} tokens. However, "
                              f"prompt {i} holds {len(text)} characters, at least {bound.min_tokens(len(text))} "
                              f"tokens (a token covers at most {bound.chars_per_token} characters). Please reduce "
                              "the length of the prompt.", "prompt", Code.CONTEXT_LENGTH_EXCEEDED)


# --- responses: what ``stages.api.completion_bodies`` builds, for /openapi.json -----------------------
class LegacyLogprobs(StrictModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for the prompt's first token (echo).")
    top_logprobs: list[dict[str, float] | None] = Field(
        description="Per token, the k most likely tokens and the chosen one -> logprob (up to k + 1 entries).")
    text_offset: list[int] = Field(description="Each token's offset in the choice's text (as vLLM: the lengths of "
                                   "the tokens' own texts, summed).")


class CompletionChoice(StrictModel):
    index: int = Field(description="prompt index * n + the prompt's choice.")
    text: str
    logprobs: LegacyLogprobs | None
    finish_reason: Literal["stop", "length"] | None = Field(
        description="null only in a stream chunk before the choice ends; a prefill's answer ends with length.")


class Completion(StrictModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="On the answer; in a stream, only on the last chunk "
                                "(stream_options.include_usage), whose choices are empty.")
