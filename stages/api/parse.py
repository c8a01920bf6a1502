"""A chat request body -> ``ChatCompletionRequest``, at a cost bounded by the body's size.

pydantic builds every value of a JSON body before it checks a list's length or a value's type: a
7 MiB body of ``"messages": [1, 1, ...]`` costs it 2.6 GB and four million error objects. So a first
pass with msgspec decodes the body into a shape that bounds every list the schema knows (the
schema's own ``MAX_MESSAGES`` and ``MAX_CONTENT_PARTS``; stop strings loosely, so that pydantic's
clearer message answers the usual mistake), takes only scalars where the schema takes scalars,
and skips unknown fields without building them. What passes is re-encoded, without the unknown
fields, and validated by pydantic, whose errors are the API's usual ones.

Given the server's ``TextBound`` (its context and its tokenizer's most characters per token), the
first pass also refuses messages whose text cannot fit the context (400 ``context_length_exceeded``)
from their length alone, before pydantic copies them and long before the tokenizer sees them: a
64 MiB text costs its own size once more, not the tokenizer's ~200 bytes per character.

Runs on a worker thread (a 64 MiB body takes ~0.3 s); raises ``APIError`` 400.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, Raw, Struct, UnsetType
from pydantic import ValidationError

from contract.errors import Code
from stages.api.bounded_json import Scalar, check_map, decode_shape
from stages.api.errors import bad_request, validation_error
from stages.api.schema_types import (MAX_CONTENT_PARTS, MAX_LOGIT_BIAS_TOKENS, MAX_MESSAGES, MAX_METADATA,
                                     MAX_SCHEMA_BYTES, MAX_TOOL_CALLS, MAX_TOOLS, UNSUPPORTED)
from stages.api.schemas import ChatCompletionRequest
from stages.text_bound import TextBound, prompt_chars

_MAPS = {"logit_bias": MAX_LOGIT_BIAS_TOKENS, "metadata": MAX_METADATA, "mm_processor_kwargs": MAX_METADATA}  # the maps of the schema, and their bounds
STOP_LIST_BOUND = 64  # the schema allows 4; between the two, pydantic says so in its own words


class _ImageURL(Struct, gc=False):
    url: Scalar | UnsetType = UNSET
    detail: Scalar | UnsetType = UNSET


class _ImageRef(Struct, gc=False):
    key: Scalar | UnsetType = UNSET
    width: Scalar | UnsetType = UNSET
    height: Scalar | UnsetType = UNSET


class _VideoRef(Struct, gc=False):
    key: Scalar | UnsetType = UNSET
    probe: Annotated[dict[str, Scalar], Meta(max_length=16)] | Scalar | UnsetType = UNSET
    sampling: Annotated[dict[str, Scalar], Meta(max_length=16)] | Scalar | UnsetType = UNSET


class _Part(Struct, gc=False):
    type: Scalar | UnsetType = UNSET
    text: Scalar | UnsetType = UNSET
    image_url: _ImageURL | Scalar | UnsetType = UNSET
    image_ref: _ImageRef | Scalar | UnsetType = UNSET
    video_url: _ImageURL | Scalar | UnsetType = UNSET
    video_ref: _VideoRef | Scalar | UnsetType = UNSET


class _FunctionCall(Struct, gc=False):
    name: Scalar | UnsetType = UNSET
    arguments: Scalar | UnsetType = UNSET


class _ToolCall(Struct, gc=False):
    id: Scalar | UnsetType = UNSET
    type: Scalar | UnsetType = UNSET
    function: _FunctionCall | Scalar | UnsetType = UNSET


class _Message(Struct, gc=False):
    role: Scalar | UnsetType = UNSET
    content: Annotated[list[_Part | Scalar], Meta(max_length=MAX_CONTENT_PARTS)] | Scalar | UnsetType = UNSET
    tool_calls: Annotated[list[_ToolCall | Scalar], Meta(max_length=MAX_TOOL_CALLS)] | Scalar | UnsetType = UNSET
    tool_call_id: Scalar | UnsetType = UNSET


class _StreamOptions(Struct, gc=False):
    include_usage: Scalar | UnsetType = UNSET


class _Function(Struct, gc=False):
    name: Scalar | UnsetType = UNSET
    description: Scalar | UnsetType = UNSET
    parameters: Raw | UnsetType = UNSET  # a JSON Schema: any JSON, kept as its bytes (pydantic takes an object)
    strict: Scalar | UnsetType = UNSET


class _Tool(Struct, gc=False):
    type: Scalar | UnsetType = UNSET
    function: _Function | Scalar | UnsetType = UNSET


class _Named(Struct, gc=False):
    name: Scalar | UnsetType = UNSET


class _ToolChoice(Struct, gc=False):
    type: Scalar | UnsetType = UNSET
    function: _Named | Scalar | UnsetType = UNSET


class _JSONSchema(Struct, gc=False):
    name: Scalar | UnsetType = UNSET
    description: Scalar | UnsetType = UNSET
    schema: Raw | UnsetType = UNSET  # any JSON, kept as its bytes
    strict: Scalar | UnsetType = UNSET


class _ResponseFormat(Struct, gc=False):
    type: Scalar | UnsetType = UNSET
    json_schema: _JSONSchema | Scalar | UnsetType = UNSET


class _Request(Struct, gc=False):
    """Every field of ``ChatCompletionRequest``, each as loose as the schema allows but no looser in size.
    A JSON Schema inside (a tool's parameters, a response format's schema) is any JSON: kept as its
    bytes (``Raw``), never built here, and all of them together at most ``MAX_SCHEMA_BYTES``. The
    ``UNSUPPORTED`` fields too: only looked at for being null. A map (``_MAPS``) is kept as its bytes
    until its entries are counted: building a JSON object costs far more per byte than skipping it,
    and a bound checked after building it (msgspec's ``max_length`` on a dict) comes too late."""

    messages: Annotated[list[_Message | Scalar], Meta(max_length=MAX_MESSAGES)] | Scalar | UnsetType = UNSET
    stop: Annotated[list[Scalar], Meta(max_length=STOP_LIST_BOUND)] | Scalar | UnsetType = UNSET
    stream_options: _StreamOptions | Scalar | UnsetType = UNSET
    model: Scalar | UnsetType = UNSET
    temperature: Scalar | UnsetType = UNSET
    top_p: Scalar | UnsetType = UNSET
    top_k: Scalar | UnsetType = UNSET
    max_tokens: Scalar | UnsetType = UNSET
    max_completion_tokens: Scalar | UnsetType = UNSET
    seed: Scalar | UnsetType = UNSET
    n: Scalar | UnsetType = UNSET
    stream: Scalar | UnsetType = UNSET
    ignore_eos: Scalar | UnsetType = UNSET
    bootstrap_host: Scalar | UnsetType = UNSET
    bootstrap_port: Scalar | UnsetType = UNSET
    bootstrap_room: Scalar | UnsetType = UNSET
    presence_penalty: Scalar | UnsetType = UNSET
    frequency_penalty: Scalar | UnsetType = UNSET
    repetition_penalty: Scalar | UnsetType = UNSET
    logit_bias: Raw | UnsetType = UNSET  # a map: its entries counted before it is built (``_MAPS``)
    logprobs: Scalar | UnsetType = UNSET
    top_logprobs: Scalar | UnsetType = UNSET
    response_format: _ResponseFormat | Scalar | UnsetType = UNSET
    tools: Annotated[list[_Tool | Scalar], Meta(max_length=MAX_TOOLS)] | Scalar | UnsetType = UNSET
    tool_choice: _ToolChoice | Scalar | UnsetType = UNSET
    user: Scalar | UnsetType = UNSET
    safety_identifier: Scalar | UnsetType = UNSET
    prompt_cache_key: Scalar | UnsetType = UNSET
    metadata: Raw | UnsetType = UNSET  # a map, as logit_bias
    mm_processor_kwargs: Raw | UnsetType = UNSET  # a map, as logit_bias
    store: Scalar | UnsetType = UNSET
    service_tier: Scalar | UnsetType = UNSET
    parallel_tool_calls: Scalar | UnsetType = UNSET
    audio: Raw | UnsetType = UNSET
    modalities: Raw | UnsetType = UNSET
    prediction: Raw | UnsetType = UNSET
    web_search_options: Raw | UnsetType = UNSET
    functions: Raw | UnsetType = UNSET
    function_call: Raw | UnsetType = UNSET
    reasoning_effort: Raw | UnsetType = UNSET
    verbosity: Raw | UnsetType = UNSET


def parse_request(raw: bytes | bytearray, bound: TextBound | None = None) -> ChatCompletionRequest:
    """JSON whatever the Content-Type says (``curl -d`` sends form-encoded), validated by the schema;
    nested deeper than ``MAX_JSON_DEPTH`` anywhere: 400 before any parser recurses. With ``bound``,
    messages whose text cannot fit the context: 400 before pydantic builds them."""
    shape = decode_shape(raw, _Request)
    _check_unsupported(shape)
    _check_maps(shape)
    _check_schemas(shape)
    if bound is not None:
        _check_text_fits(shape, bound)
    try:
        return ChatCompletionRequest.model_validate_json(msgspec.json.encode(shape))
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _check_maps(shape: _Request) -> None:
    """Each ``_MAPS`` field: more entries than its bound, or not a map of scalars: 400 naming it
    (``bounded_json.check_map``: counted without building the map)."""
    for name, bound in _MAPS.items():
        raw = getattr(shape, name)
        if raw is not UNSET:
            check_map(raw, name, bound)


def _check_schemas(shape: _Request) -> None:
    """400 naming the JSON schema (a tool's parameters, the response format's) that brings the
    request's schemas together over ``MAX_SCHEMA_BYTES`` of JSON."""
    schemas = [(f"tools[{i}].function.parameters", tool.function.parameters)
               for i, tool in enumerate(shape.tools if isinstance(shape.tools, list) else ())
               if isinstance(tool, _Tool) and isinstance(tool.function, _Function)]
    response_format = shape.response_format
    if isinstance(response_format, _ResponseFormat) and isinstance(response_format.json_schema, _JSONSchema):
        schemas.append(("response_format.json_schema.schema", response_format.json_schema.schema))
    total = 0
    for param, raw in schemas:
        total += 0 if raw is UNSET else len(memoryview(raw))
        if total > MAX_SCHEMA_BYTES:
            raise bad_request(f"Invalid value for '{param}': the request's JSON schemas (tools' parameters and "
                              f"response_format's schema) hold more than {MAX_SCHEMA_BYTES} bytes of JSON together.",
                              param, Code.INVALID_VALUE)


def _check_unsupported(shape: _Request) -> None:
    """400 ``unsupported_parameter`` naming the first ``UNSUPPORTED`` field that asks for something:
    any value but null (``modalities``: but null or ``["text"]``)."""
    for name in UNSUPPORTED:
        raw = getattr(shape, name)
        if raw is UNSET or msgspec.json.decode(raw) in (None, ["text"] if name == "modalities" else None):
            continue
        accepted = 'null or ["text"]' if name == "modalities" else "null"
        raise bad_request(f"Unsupported parameter: '{name}' is not supported by this server (only {accepted} is "
                          "accepted).", name, "unsupported_parameter")


def _check_text_fits(shape: _Request, bound: TextBound) -> None:
    """400 ``context_length_exceeded`` if the messages' text makes more tokens than the context holds."""
    if not isinstance(shape.messages, list):
        return
    chars = prompt_chars((m.role, _texts(m)) for m in shape.messages if isinstance(m, _Message))
    if chars > bound.max_chars:
        raise bad_request(f"This model's maximum context length is {bound.max_model_len} tokens. However, your "
                          f"messages hold {chars} characters of text, at least {bound.min_tokens(chars)} tokens "
                          f"(a token covers at most {bound.chars_per_token} characters). Please reduce the length "
                          "of the messages.", "messages", Code.CONTEXT_LENGTH_EXCEEDED)


def _texts(message: _Message) -> list:
    content = message.content
    return [part.text for part in content if isinstance(part, _Part)] if isinstance(content, list) else [content]
