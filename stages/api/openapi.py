"""What ``/openapi.json`` says about each route, where FastAPI cannot see it from the handler.

The chat route reads its body itself (admission and the byte cap come before the body is read), so
its request schema comes from ``openapi_extra`` plus ``install``, which adds the schemas it refers to;
its answers are JSON or a server-sent event stream, and its errors are OpenAI error bodies. The
``*_ROUTE`` dicts are the keyword arguments of each route's decorator; ``install(app)`` finishes the
document when it is first built (so routes added after ``create_app``, like ``/server_info``, are in it).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from stages.api.chat_response import ChatCompletion, ChatCompletionChunk
from stages.api.common_schemas import ErrorBody, Health, ModelList
from stages.api.schemas import ChatCompletionRequest

REF = "#/components/schemas/{model}"
PD = "Prefill and decode servers only: "


def error(description: str, headers: dict | None = None) -> dict:
    """A documented error answer: an OpenAI error body (``ErrorBody``)."""
    return {"model": ErrorBody, "description": description, **({"headers": headers} if headers else {})}


RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying; sent with code server_overloaded.",
                               "schema": {"type": "integer", "minimum": 0}}}
INTERNAL_ERROR = "A failure of this server (code internal_error or engine_error); the request is not retried."
SSE_EVENT = {  # one server-sent event, as OpenAPI 3.2's itemSchema (and schemathesis) read a text/event-stream schema
    "type": "object", "required": ["data"],
    "description": "With `stream: true`: one event per chat.completion.chunk, then `data: [DONE]`. Each chunk has one "
                   "choice, named by its `index` (0 to n - 1): first a role chunk per choice, then each choice's text "
                   "or tool-call deltas (with logprobs: the logprobs of the tokens they stand for; a chunk whose delta "
                   "is empty carries the logprobs of tokens whose text is held back), then a finish chunk per choice; "
                   "with `stream_options.include_usage`, a last chunk with usage and no choices. A failure after "
                   "the stream started is sent as one event whose data is an error body, before [DONE]. A stream that "
                   "has sent nothing for --stream-keepalive-s sends the SSE comment `: keep-alive` (not an event: "
                   "SSE clients skip it).",
    "properties": {"event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
                   "data": {"anyOf": [{"const": "[DONE]"}, {
                       "type": "string", "contentMediaType": "application/json",
                       "contentSchema": {"anyOf": [{"$ref": REF.format(model="ChatCompletionChunk")},
                                                   {"$ref": REF.format(model="ErrorBody")}]}}]}},
}

CHAT_ROUTE: dict = {
    "summary": "Create a chat completion (OpenAI-compatible; text and data: URL images)",
    "response_model": None,
    "openapi_extra": {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF.format(model="ChatCompletionRequest")}}}}},
    "responses": {
        200: {"model": ChatCompletion, "description": "The completion: n choices, each with its message (its text, "
              "or tool_calls with finish_reason tool_calls), its finish_reason and, with logprobs, each generated "
              "token's logprob and top_logprobs; usage counts the prompt once and every choice's tokens. With "
              "`stream: true`, a server-sent event stream instead. A prefill server answers with its first token "
              "only (a choice per index, finish_reason length).",
              "content": {"text/event-stream": {"schema": SSE_EVENT}}},
        400: error("The request is invalid: the error's param names the parameter, its code says why "
                    "(invalid_json, invalid_value, missing_required_parameter, context_length_exceeded, "
                    "image_url_not_supported / image_ref_not_supported: the other kind of image part than this "
                    "server takes, unsupported_parameter: a field OpenAI defines that would change the answer and "
                    "this server does not implement (the request schema's description lists them), "
                    "invalid_response_format / invalid_tool_schema: a schema the grammar compiler cannot take, "
                    "tools_not_supported: the model's chat template has no tool format, ...). EPD prefill: "
                    "image_not_cached, an image_ref key neither cached nor being encoded (at once)."),
        403: error(PD + "the request names a prefill that the decode's --allowed-bootstrap does not allow "
                    "(nothing is dialed)."),
        404: error("`model` is not the served model (code model_not_found)."),
        409: error(PD + "the bootstrap_room is already in flight, answered or aborted (code room_conflict)."),
        413: error("The body is over --max-body-mb (code request_too_large, answered before the body is read when "
                    "Content-Length says so), or an image is over --max-image-bytes / --max-image-pixels."),
        499: {"description": "The client went away before the answer was ready; nobody reads this."},
        500: error(INTERNAL_ERROR),
        502: error(PD + "the other stage failed, refused the request or went away (code peer_failed or "
                    "kv_transfer_failed). EPD prefill: the encoder failed or died (encode_failed), or the cached "
                    "embedding does not fit the image_ref or the model (embedding_mismatch; the entry is dropped)."),
        503: error("The server is at --max-num-seqs + --max-waiting requests (code server_overloaded, with "
                    "Retry-After), its engine is not running (engine_unavailable), or a decode's KV pool is full "
                    "(kv_pool_full). EPD prefill: the embedding cache's Redis is down or slow (cache_unavailable, "
                    "naming Redis).", RETRY_AFTER),
        504: error(PD + "a room's deadline passed: the other half never arrived (--pair-timeout-s), or the KV "
                    "did not (code room_timeout); EPD prefill: an image was still being encoded at "
                    "--embedding-timeout-s (embedding_timeout)."),
    },
}
HEALTH_ROUTE: dict = {
    "summary": "Liveness: 200 while the engine thread and every supervised task run",
    "responses": {200: {"model": Health, "description": "Serving."},
                  503: error("A part of the server died (code unhealthy, the message names it): restart it.")},
}
MODELS_ROUTE: dict = {"summary": "The one model this server serves",
                      "responses": {200: {"model": ModelList, "description": "The served model."}}}
METRICS_ROUTE: dict = {
    "summary": "Prometheus metrics (epd_* names)",
    "response_class": PlainTextResponse,
    "responses": {200: {"description": f"Prometheus text exposition format, served as `{CONTENT_TYPE_LATEST}`.",
                        "content": {"text/plain": {"schema": {"type": "string"}}}}},
}


def install(app: FastAPI, models: tuple[type[BaseModel], ...] = (ChatCompletionRequest, ChatCompletionChunk)) -> None:
    """Make ``app.openapi()`` add the schemas of ``models`` (those a route refers to by ``REF`` but
    FastAPI cannot see: by default the chat request's and the stream chunk's) to the document's
    components, and a documented 500 to every operation that lacks one."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()  # FastAPI's; cached in app.openapi_schema, which we finish in place
        components = document.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            _add_schemas(components, model)
        for operation in _operations(document):
            operation["responses"].setdefault("500", {
                "description": INTERNAL_ERROR,
                "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorBody")}}}})
        return document

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customize the document


def _add_schemas(components: dict, model: type[BaseModel]) -> None:
    """``model``'s JSON schema and its definitions as components, refs pointing at components."""
    schema = model.model_json_schema(ref_template=REF)
    definitions = {**schema.pop("$defs", {}), model.__name__: schema}
    for name, definition in definitions.items():
        if components.setdefault(name, definition) != definition:
            raise RuntimeError(f"two different schemas are named {name} in the OpenAPI document")


def _operations(document: dict) -> list[dict]:
    return [operation for item in document.get("paths", {}).values() for operation in item.values()
            if isinstance(operation, dict) and "responses" in operation]
