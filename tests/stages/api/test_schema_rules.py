"""The request schemas state the rules that tie one field to another (``json_schema_extra``), so
``/openapi.json`` (the stage's, and the router's copy of it) allows a body exactly when the model
takes it: best_of at most n, top_logprobs only with logprobs, tool_choice "required" only with tools,
no response_format with a forced tool call. No model."""

from __future__ import annotations

import jsonschema
import pydantic
import pytest

from stages.api.completion_schema import CompletionRequest
from stages.api.errors import APIError
from stages.api.schemas import ChatCompletionRequest

pytestmark = pytest.mark.unit
HI = [{"role": "user", "content": "hi"}]
TOOL = [{"type": "function", "function": {"name": "f"}}]


def taken(model: type[pydantic.BaseModel], body: dict) -> bool:
    try:
        model.model_validate(body)
    except (pydantic.ValidationError, APIError):
        return False
    return True


def allowed(model: type[pydantic.BaseModel], body: dict) -> bool:
    schema = model.model_json_schema(ref_template="#/$defs/{model}")
    return jsonschema.Draft202012Validator(schema).is_valid(body)


@pytest.mark.parametrize("fields, ok", [
    ({}, True), ({"best_of": 1}, True), ({"best_of": None, "n": None}, True), ({"best_of": 2}, False),
    ({"best_of": 2, "n": 2}, True), ({"best_of": 3, "n": 2}, False), ({"best_of": 2, "n": None}, False),
    ({"best_of": 8, "n": 8}, True), ({"n": 5}, True), ({"best_of": 1, "n": 8}, True),
])
def test_best_of_at_most_n(fields, ok):
    body = {"prompt": "a", **fields}
    assert taken(CompletionRequest, body) is ok and allowed(CompletionRequest, body) is ok


@pytest.mark.parametrize("fields, ok", [
    ({}, True), ({"top_logprobs": 0}, False), ({"top_logprobs": 2, "logprobs": True}, True),
    ({"top_logprobs": 2, "logprobs": False}, False), ({"top_logprobs": None}, True),
    ({"tool_choice": "required"}, False), ({"tool_choice": "required", "tools": []}, False),
    ({"tool_choice": "required", "tools": TOOL}, True), ({"tool_choice": "auto"}, True),
    ({"response_format": {"type": "json_object"}}, True),
    ({"response_format": {"type": "json_object"}, "tool_choice": "required", "tools": TOOL}, False),
    ({"response_format": {"type": "json_object"}, "tool_choice": {"type": "function", "function": {"name": "f"}},
      "tools": TOOL}, False),
    ({"response_format": {"type": "text"}, "tool_choice": "required", "tools": TOOL}, True),
    ({"response_format": {"type": "json_object"}, "tool_choice": "auto", "tools": TOOL}, True),
])
def test_the_chat_rules_between_fields(fields, ok):
    body = {"messages": HI, **fields}
    assert taken(ChatCompletionRequest, body) is ok and allowed(ChatCompletionRequest, body) is ok


@pytest.mark.parametrize("message, ok", [
    ({"role": "tool", "tool_call_id": "c", "content": "x"}, True),
    ({"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "x"}]}, True),
    ({"role": "tool", "tool_call_id": "c", "content": [{"type": "image_url", "image_url": "data:,"}]}, False),
    ({"role": "tool", "content": "x"}, False), ({"role": "user", "tool_call_id": "c", "content": "x"}, False),
    ({"role": "user", "content": [{"type": "image_url", "image_url": "data:,"}]}, True),
])
def test_a_messages_fields_for_its_role(message, ok):
    body = {"messages": [message]}
    assert taken(ChatCompletionRequest, body) is ok and allowed(ChatCompletionRequest, body) is ok
