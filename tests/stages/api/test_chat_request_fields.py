"""The chat request's fields beyond the basics (issue 19): logprobs, n, penalties, logit_bias,
response_format, tools and tool_choice, tool messages, the no-op fields and the unsupported ones.

Bounds and 400 bodies through ``parse_request`` (the schema and the msgspec first pass); the mapping
to ``SamplingParams``, grammars and tool rendering through the ``Preparer`` with a tiny model's real
prompt builder and grammar compiler; and the 400s' exact bodies from a real colocated server.
"""

from __future__ import annotations

import json
import tracemalloc

import httpx
import msgspec
import pytest

from stages.api.chat import ImageMode, Preparer
from stages.api.errors import APIError
from stages.api.parse import _Request, parse_request
from stages.api.schema_types import (MAX_LOGIT_BIAS_TOKENS, MAX_METADATA, MAX_SCHEMA_BYTES, MIN_REPETITION_PENALTY,
                                     UNSUPPORTED)
from stages.api.schemas import ChatCompletionRequest
from stages.config import ImageLimits
from stages.engine.config import EngineConfig
from stages.loading import load_engine
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir

HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22C"}]
NO_OPS = {"user": "u-1", "safety_identifier": "s-1", "prompt_cache_key": "k", "metadata": {"team": "a"},
          "store": False, "service_tier": "auto", "parallel_tool_calls": False}
ASKING = {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
          "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
          "functions": [{"name": "f"}], "function_call": "auto", "reasoning_effort": "low", "verbosity": "low"}


def parse(**fields) -> ChatCompletionRequest:
    return parse_request(json.dumps({"messages": HI, **fields}).encode())


def refusal(**fields) -> dict:
    with pytest.raises(APIError) as refused:
        parse(**fields)
    assert refused.value.status == 400
    return refused.value.body()["error"]


def invalid(param: str, message: str, code: str = "invalid_value") -> dict:
    return {"message": message, "type": "invalid_request_error", "param": param, "code": code}


# --- the schema and the first pass -------------------------------------------------------------------
@pytest.mark.unit
def test_the_first_pass_knows_every_field_of_the_schema():
    names = {field.alias or name for name, field in ChatCompletionRequest.model_fields.items()}
    assert names == set(_Request.__struct_fields__)
    assert set(UNSUPPORTED) <= names


@pytest.mark.unit
def test_the_schema_lists_the_no_ops_and_the_unsupported_fields():
    schema = ChatCompletionRequest.model_json_schema()
    for name in UNSUPPORTED:
        assert name in schema["description"] and "unsupported_parameter" in schema["properties"][name]["description"]
    for name in NO_OPS:
        assert name in schema["description"] and "ignored" in schema["properties"][name]["description"]


@pytest.mark.unit
@pytest.mark.parametrize("fields, error", [
    ({"top_logprobs": 2}, invalid("top_logprobs", "Invalid value for 'top_logprobs': top_logprobs needs logprobs "
                                                  "set to true")),
    ({"logprobs": False, "top_logprobs": 0}, invalid("top_logprobs", "Invalid value for 'top_logprobs': "
                                                                     "top_logprobs needs logprobs set to true")),
    ({"logprobs": True, "top_logprobs": 21}, invalid("top_logprobs", "Invalid value for 'top_logprobs': Input "
                                                                     "should be less than or equal to 20")),
    ({"logprobs": True, "top_logprobs": -1}, invalid("top_logprobs", "Invalid value for 'top_logprobs': Input "
                                                                     "should be greater than or equal to 0")),
    ({"logprobs": 1}, invalid("logprobs", "Invalid value for 'logprobs': Input should be a valid boolean")),
    ({"n": 9}, invalid("n", "Invalid value for 'n': Input should be less than or equal to 8")),
    ({"n": 0}, invalid("n", "Invalid value for 'n': Input should be greater than or equal to 1")),
    ({"presence_penalty": 2.5}, invalid("presence_penalty", "Invalid value for 'presence_penalty': Input should "
                                                            "be less than or equal to 2")),
    ({"frequency_penalty": -2.01}, invalid("frequency_penalty", "Invalid value for 'frequency_penalty': Input "
                                                                "should be greater than or equal to -2")),
    ({"repetition_penalty": 0}, invalid("repetition_penalty", "Invalid value for 'repetition_penalty': Input "
                                                              "should be greater than 0")),
    ({"repetition_penalty": 2.1}, invalid("repetition_penalty", "Invalid value for 'repetition_penalty': Input "
                                                                "should be less than or equal to 2")),
    ({"logit_bias": {"5": 100.5}}, invalid("logit_bias", "Invalid value for 'logit_bias': Input should be less "
                                                         "than or equal to 100")),
    ({"logit_bias": {"07": 1}}, invalid("logit_bias", "Invalid value for 'logit_bias': String should match "
                                                      "pattern '^(0|[1-9][0-9]{0,9})$'")),
    ({"logit_bias": {"-1": 1}}, invalid("logit_bias", "Invalid value for 'logit_bias': String should match "
                                                      "pattern '^(0|[1-9][0-9]{0,9})$'")),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}},
     invalid("logit_bias", f"Invalid value for 'logit_bias': Expected `object` of length <= {MAX_LOGIT_BIAS_TOKENS}")),
    ({"response_format": {"type": "json_schema"}},
     invalid("response_format", "Invalid value for 'response_format': a json_schema response format needs a "
                                "'json_schema' field")),
    ({"response_format": {"type": "xml"}},
     invalid("response_format.type", "Invalid value for 'response_format.type': Input should be 'text', "
                                     "'json_object' or 'json_schema'")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     invalid("response_format.json_schema.name", "Invalid value for 'response_format.json_schema.name': String "
                                                 "should match pattern '^[a-zA-Z0-9_-]{1,64}$'")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}},
     invalid("response_format.json_schema.schema", "Invalid value for 'response_format.json_schema.schema': "
                                                   "Input should be an object")),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]},
     invalid("tools[0].type", "Invalid value for 'tools[0].type': Input should be 'function'")),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     invalid("tool_choice", "Invalid value for 'tool_choice': tool_choice names the function 'get_time', which "
                            "is not among the tools")),
    ({"tool_choice": "required"}, invalid("tool_choice", "Invalid value for 'tool_choice': tool_choice 'required' "
                                                         "needs tools")),
    ({"tools": [], "tool_choice": "required"},
     invalid("tool_choice", "Invalid value for 'tool_choice': tool_choice 'required' needs tools")),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     invalid("response_format", "Invalid value for 'response_format': response_format cannot be combined with a "
                                "forced tool call (tool_choice required or a named function)")),
    ({"messages": [{"role": "tool", "content": "x"}]},
     invalid("messages[0]", "Invalid value for 'messages[0]': a tool message needs a 'tool_call_id'")),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
     invalid("messages[0]", "Invalid value for 'messages[0]': only a tool message may have a 'tool_call_id'")),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     invalid("messages[0]", "Invalid value for 'messages[0]': only an assistant message may have 'tool_calls'")),
    ({"messages": [{"role": "tool", "tool_call_id": "c", "content": [
        {"type": "image_url", "image_url": "data:image/png;base64,"}]}]},
     invalid("messages[0]", "Invalid value for 'messages[0]': a tool message's content is text only")),
    ({"metadata": {"k": 1}}, invalid("metadata.k", "Invalid value for 'metadata.k': Input should be a valid string")),
    ({"service_tier": "fastest"}, invalid("service_tier", "Invalid value for 'service_tier': Input should be "
                                                          "'auto', 'default', 'flex', 'scale' or 'priority'")),
], ids=lambda value: None if isinstance(value, dict) and "param" in value else json.dumps(value)[:60])
def test_out_of_bounds_is_400_naming_the_field(fields, error):
    assert refusal(**fields) == error


@pytest.mark.unit
@pytest.mark.parametrize("name", UNSUPPORTED)
def test_an_unsupported_field_is_refused_by_name_unless_null(name):
    accepted = 'null or ["text"]' if name == "modalities" else "null"
    assert refusal(**{name: ASKING[name]}) == invalid(
        name, f"Unsupported parameter: '{name}' is not supported by this server (only {accepted} is accepted).",
        "unsupported_parameter")
    assert getattr(parse(**{name: None}), name) is None


@pytest.mark.unit
def test_the_first_unsupported_field_is_refused_before_any_other_mistake():
    assert refusal(audio=1, n=100)["param"] == "audio"
    assert parse(modalities=["text"]).modalities == ["text"]


@pytest.mark.unit
def test_in_bounds_fields_and_no_ops_are_accepted():
    request = parse(logprobs=True, top_logprobs=20, n=8, presence_penalty=-2, frequency_penalty=2,
                    repetition_penalty=2, logit_bias={"0": -100, "4294967295": 100}, tools=[WEATHER, CLOCK],
                    tool_choice={"type": "function", "function": {"name": "get_time"}},
                    response_format={"type": "text"}, **NO_OPS)
    assert request.n == 8 and request.logit_bias == {"0": -100.0, "4294967295": 100.0} and request.forces_tool
    assert parse(tools=[], tool_choice="none").offered_tools is None
    assert parse(tool_choice="auto").offered_tools is None  # auto without tools: nothing to offer


@pytest.mark.unit
def test_tool_messages_and_assistant_tool_calls_are_accepted():
    request = parse(messages=HISTORY)
    assert request.messages[1].content is None and request.messages[1].tool_calls[0].function.name == "get_weather"
    assert request.messages[2].tool_call_id == "call_1"


def many_entries(count: int) -> bytes:
    return b"{" + b",".join(b'"%d": 1' % i for i in range(count)) + b"}"


@pytest.mark.unit
@pytest.mark.parametrize("field, body", [
    ("logit_bias", b'"logit_bias": ' + many_entries(1_000_000)),
    ("metadata", b'"metadata": ' + many_entries(1_000_000)),
    ("response_format.json_schema.schema", b'"response_format": {"type": "json_schema", "json_schema": {"name": "a", '
                                           b'"schema": ' + many_entries(1_000_000) + b"}}"),
    ("tools[4].function.parameters", b'"tools": [' + b", ".join(
        [b'{"type": "function", "function": {"name": "f", "parameters": {"d": "' + b"x" * 250_000 + b'"}}}'] * 6)
     + b"]"),
])
def test_a_huge_map_or_schema_is_refused_before_it_is_built(field, body):
    """A JSON object costs far more to build than its bytes: a map's entries are counted and the
    schemas' bytes summed (MAX_SCHEMA_BYTES) before anything is built, so the refusal costs ~nothing."""
    raw = b'{"messages": [{"role": "user", "content": "hi"}], ' + body + b"}"
    tracemalloc.start()
    try:
        with pytest.raises(APIError) as refused:
            parse_request(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused.value.param == field and peak < len(raw) / 10
    bound = {"logit_bias": MAX_LOGIT_BIAS_TOKENS, "metadata": MAX_METADATA}.get(field)
    assert refused.value.message == (f"Invalid value for '{field}': Expected `object` of length <= {bound}" if bound
                                     else f"Invalid value for '{field}': the request's JSON schemas (tools' "
                                     f"parameters and response_format's schema) hold more than {MAX_SCHEMA_BYTES} "
                                     "bytes of JSON together.")


@pytest.mark.unit
def test_map_entries_are_counted_outside_strings_and_nested_values():
    text = {str(i): ",{[}]\"" for i in range(MAX_METADATA)}
    assert parse(metadata=text).metadata == text
    assert refusal(metadata={**text, "x": "y"})["message"] == (f"Invalid value for 'metadata': Expected `object` of "
                                                               f"length <= {MAX_METADATA}")
    assert refusal(logit_bias={"1": [1, 2, 3]})["param"] == "logit_bias"


@pytest.mark.unit
def test_a_json_schema_is_not_built_by_the_first_pass():
    """A tool's parameters and a response format's schema cross the first pass as their bytes."""
    shape = msgspec.json.decode(json.dumps({"tools": [WEATHER]}).encode(), type=_Request)
    assert isinstance(shape.tools[0].function.parameters, msgspec.Raw)


# --- the Preparer: SamplingParams, grammars, tools in the prompt ----------------------------------------
@pytest.fixture(scope="module")
def prepare():
    engine, prompts = load_engine(EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=4, device=DEVICE),
                                  pixels=True)
    return Preparer(prompts, engine, ImageLimits(max_images=2, max_pixels=512 * 512), ImageMode.PIXELS)


def prepared(prepare, **fields):
    return prepare(parse(max_tokens=8, **fields))


def test_sampling_fields_reach_the_sampling_params(prepare):
    _, plain = prepared(prepare)
    assert (plain.n, plain.logprobs, plain.logit_bias, plain.guide, plain.processes_logits) == (1, None, (), None,
                                                                                                False)
    _, params = prepared(prepare, n=3, seed=4, logprobs=True, top_logprobs=5, presence_penalty=0.5,
                         frequency_penalty=-1, repetition_penalty=1.3, logit_bias={"3": -100, "11": 2.5})
    assert (params.n, params.seed_of(2), params.logprobs) == (3, 6, 5)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.0, 1.3)
    assert params.logit_bias == ((3, -100.0), (11, 2.5))
    assert prepared(prepare, logprobs=True)[1].logprobs == 0  # the sampled token's only
    assert prepared(prepare, repetition_penalty=5e-324)[1].repetition_penalty == MIN_REPETITION_PENALTY
    assert prepared(prepare, **NO_OPS)[1] == plain


def test_a_logit_bias_outside_the_vocabulary_is_400_naming_it(prepare):
    vocab = prepare.engine.vocab_size
    assert prepared(prepare, logit_bias={str(vocab - 1): 1})[1].logit_bias == ((vocab - 1, 1.0),)
    with pytest.raises(APIError) as refused:
        prepared(prepare, logit_bias={"1": 1, str(vocab): -5})
    assert refused.value.body()["error"] == invalid(
        "logit_bias", f"Invalid key in 'logit_bias': {vocab}. This model's token ids are 0 to {vocab - 1}.")


def test_a_response_format_or_a_forced_tool_compiles_a_guide(prepare):
    assert prepared(prepare, response_format={"type": "text"})[1].guide is None
    assert prepared(prepare, response_format={"type": "json_object"})[1].guide is not None
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    strict = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    assert prepared(prepare, response_format=strict)[1].guide is not None
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        assert prepared(prepare, tools=[WEATHER, CLOCK], tool_choice=choice)[1].guide is not None
    assert prepared(prepare, tools=[WEATHER], tool_choice="auto")[1].guide is None


def test_a_schema_the_compiler_refuses_is_400(prepare):
    bad = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "$ref": "#/nowhere"}}}
    with pytest.raises(APIError) as refused:
        prepared(prepare, response_format=bad)
    error = refused.value.body()["error"]
    assert (error["param"], error["code"]) == ("response_format", "invalid_response_format")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$ref": "#/nowhere"}}}
    with pytest.raises(APIError) as refused:
        prepared(prepare, tools=[tool], tool_choice="required")
    error = refused.value.body()["error"]
    assert (error["param"], error["code"]) == ("tools", "invalid_tool_schema")


def test_tools_are_rendered_by_the_template_unless_tool_choice_is_none(prepare):
    tokenizer = prepare.prompts.tokenizer
    plain, _ = prepared(prepare)
    offered, _ = prepared(prepare, tools=[WEATHER])
    assert "get_weather" in tokenizer.decode(offered.token_ids) and "get_weather" not in tokenizer.decode(
        plain.token_ids)
    assert prepared(prepare, tools=[WEATHER], tool_choice="none")[0].token_ids == plain.token_ids


def test_a_tool_loop_history_renders_its_calls_and_results(prepare):
    prompt, _ = prepared(prepare, messages=HISTORY, tools=[WEATHER])
    text = prepare.prompts.tokenizer.decode(prompt.token_ids)
    assert '"city": "Paris"' in text and "sunny, 22C" in text
    broken = [HISTORY[0], {**HISTORY[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    with pytest.raises(APIError) as refused:
        prepared(prepare, messages=broken)
    error = refused.value.body()["error"]
    assert (error["param"], error["code"]) == ("messages[1].tool_calls", "invalid_value")
    assert "tool_calls[0].function.arguments is not JSON" in error["message"]


def test_a_template_without_a_tool_format_refuses_tools(tiny_model):
    """The generated LLaVA template renders no tools: offering any is 400 tools_not_supported, while
    tool_choice none (nothing offered) and no tools are served."""
    engine, prompts = load_engine(EngineConfig(model=str(tiny_model("llava")), kv_cache_mib=4, device=DEVICE),
                                  pixels=True)
    llava = Preparer(prompts, engine, ImageLimits(max_images=2, max_pixels=512 * 512), ImageMode.PIXELS)
    with pytest.raises(APIError) as refused:
        prepared(llava, tools=[WEATHER])
    assert refused.value.body()["error"] == invalid(
        "tools", "This model's chat template has no tool format, so it cannot be given tools (tool_choice none "
        "gives it none).", "tools_not_supported")
    assert prepared(llava, tools=[WEATHER], tool_choice="none")[0].token_ids == prepared(llava)[0].token_ids


# --- a real server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server("colocated", "--model", str(tiny_model("qwen2_vl")), "--kv-cache-mib", "16",
                        "--max-model-len", "2048", "--served-model-name", "tiny")


def post(server, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 4, **fields},
                      timeout=60)


@pytest.mark.parametrize("fields, param, code", [
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"n": 9}, "n", "invalid_value"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "invalid_value"),
    ({"function_call": "auto"}, "function_call", "unsupported_parameter"),
    ({"stream": True, "audio": {"voice": "alloy"}}, "audio", "unsupported_parameter"),
])
def test_a_real_server_answers_the_400s(server, fields, param, code):
    response = post(server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"], error["stage"]) == (param, code, "invalid_request_error",
                                                                              "colocated")


def test_a_real_server_takes_the_no_ops_a_tool_history_and_the_openai_client(server):
    import openai

    plain = post(server, seed=3, temperature=0)
    assert plain.status_code == 200
    extra = post(server, seed=3, temperature=0, modalities=["text"], audio=None, **NO_OPS)
    assert extra.status_code == 200, extra.text
    assert extra.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    answer = client.chat.completions.create(model="tiny", messages=HISTORY, tools=[WEATHER], max_tokens=4,
                                            user="u-1", metadata={"a": "b"}, store=False, parallel_tool_calls=True)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, reasoning_effort="high")
    assert refused.value.body["param"] == "reasoning_effort" and refused.value.body["code"] == "unsupported_parameter"
