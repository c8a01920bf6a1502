"""What ``/openapi.json`` says of ``POST /v1/completions`` (``stages.api.openapi``'s way: the route
reads its body itself, so its request schema is a reference that ``install`` resolves)."""

from __future__ import annotations

from stages.api.completion_schema import Completion
from stages.api.openapi import CHAT_ROUTE, REF

SSE_EVENT = {
    "type": "object", "required": ["data"],
    "description": "With `stream: true`: one event per text_completion chunk (a choice's new text, its logprobs, its "
                   "finish_reason), the usage chunk (stream_options.include_usage), then `data: [DONE]`. A failure "
                   "after the stream started is sent as one event whose data is an error body, before [DONE]. A "
                   "stream that has sent nothing for --stream-keepalive-s sends the SSE comment `: keep-alive`.",
    "properties": {"event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
                   "data": {"anyOf": [{"const": "[DONE]"}, {
                       "type": "string", "contentMediaType": "application/json",
                       "contentSchema": {"anyOf": [{"$ref": REF.format(model="Completion")},
                                                   {"$ref": REF.format(model="ErrorBody")}]}}]}},
}

COMPLETIONS_ROUTE: dict = {
    "summary": "Create a completion (OpenAI's legacy completions API; text prompts or token ids)",
    "response_model": None,
    "openapi_extra": {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF.format(model="CompletionRequest")}}}}},
    "responses": {
        **CHAT_ROUTE["responses"],
        200: {"model": Completion, "description": "The completion; with `stream: true`, a server-sent event stream "
              "instead. A prefill server answers with each choice's first token only (finish_reason length).",
              "content": {"text/event-stream": {"schema": SSE_EVENT}}},
    },
}
