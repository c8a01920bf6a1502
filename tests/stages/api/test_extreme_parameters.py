"""Parameters legal by JSON but extreme stop at the API edge: 400 naming the parameter, or the clamp the
schema documents, before anything reaches the engine. Bodies of enormous counts cost a bounded amount
to refuse. In-process against the scripted engine of ``tests/support/stage_api.py``, plus the real sampler."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from stages.api.chat import sampling_params
from stages.api.errors import APIError
from stages.api.parse import parse_request
from stages.api.schema_types import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP_CHARS, MIN_TEMPERATURE, MIN_TOP_P
from stages.api.schemas import ChatCompletionRequest
from stages.engine.sampler import make_generator, sample
from stages.engine.sampling_params import SamplingParams
from tests.support.stage_api import FakeAsyncEngine, FakeEngine, client_for, error_of

HI = [{"role": "user", "content": "hi"}]
VOCAB = FakeEngine.vocab_size


def post_raw(raw: str | bytes, engine: FakeAsyncEngine | None = None):
    client = client_for(engine or FakeAsyncEngine())
    return client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})


def with_hi(fragment: str) -> str:
    """A body with one message and ``fragment`` (raw JSON, e.g. ``"seed": 1e400``) as more fields."""
    return '{"messages": [{"role": "user", "content": "hi"}], ' + fragment + "}"


# --- 400 naming the parameter ---------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("fragment, param, code, says", [
    ('"temperature": NaN', None, "invalid_json", "not valid JSON"),  # Python's json writes NaN; JSON has none
    ('"temperature": Infinity', None, "invalid_json", "not valid JSON"),
    ('"top_p": NaN', None, "invalid_json", "not valid JSON"),
    ('"temperature": 1e400', "temperature", "invalid_value", "Number out of range"),
    ('"temperature": 2.0000001', "temperature", "invalid_value", "less than or equal to 2"),
    ('"temperature": [1]', "temperature", "invalid_value", "got `array`"),
    ('"top_p": -0.5', "top_p", "invalid_value", "greater than or equal to 0"),
    ('"top_p": 1.5', "top_p", "invalid_value", "less than or equal to 1"),
    ('"top_k": -2', "top_k", "invalid_value", "greater than or equal to -1"),
    ('"seed": 9223372036854775808', "seed", "invalid_value", "less than or equal to 9223372036854775807"),
    ('"seed": -9223372036854775809', "seed", "invalid_value", "greater than or equal to -9223372036854775808"),
    ('"seed": 1e300', "seed", "invalid_value", "seed"),
    ('"n": 9', "n", "invalid_value", "less than or equal to 8"),
    ('"stop": ["' + "x" * (MAX_STOP_CHARS + 1) + '"]', "stop[0]", "invalid_value",
     f"at most {MAX_STOP_CHARS} characters"),
    ('"stop": ""', "stop", "invalid_value", "at least 1 character"),
    ('"stop": ["a", "b", "c", "d", "e"]', "stop", "invalid_value", "at most 4 items"),
    ('"stop": [' + ",".join(['"a"'] * 65) + "]", "stop", "invalid_value", "length <= 64"),
    ('"bootstrap_room": 9223372036854775808', "bootstrap_room", "invalid_value", "less than or equal to"),
    ('"bootstrap_port": 0', "bootstrap_port", "invalid_value", "greater than or equal to 1"),
    ('"model": "' + "m" * 257 + '"', "model", "invalid_value", "at most 256 characters"),
    ('"stream_options": {"include_usage": [true]}', "stream_options.include_usage", "invalid_value", "got `array`"),
])
def test_extreme_values_are_400_naming_the_parameter(fragment, param, code, says):
    engine = FakeAsyncEngine()
    error = error_of(post_raw(with_hi(fragment), engine), 400)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert says in error["message"], error["message"]
    assert engine.params == []  # nothing reached the engine


def test_too_many_messages_and_parts_are_400_naming_them():
    error = error_of(post_raw(json.dumps({"messages": HI * (MAX_MESSAGES + 1)})), 400)
    assert (error["param"], error["code"]) == ("messages", "invalid_value")
    assert error["message"] == f"Invalid value for 'messages': Expected `array` of length <= {MAX_MESSAGES}"
    parts = [{"type": "text", "text": "x"}] * (MAX_CONTENT_PARTS + 1)
    error = error_of(post_raw(json.dumps({"messages": HI + [{"role": "user", "content": parts}]})), 400)
    assert error["param"] == "messages[1].content"
    assert f"length <= {MAX_CONTENT_PARTS}" in error["message"]
    assert post_raw(json.dumps({"messages": HI * MAX_MESSAGES})).status_code == 200


@pytest.mark.unit
def test_context_overflow_from_a_huge_max_tokens_names_the_lengths():
    for field in ("max_tokens", "max_completion_tokens"):
        error = error_of(post_raw(with_hi(f'"{field}": {10**30}')), 400)
        assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
        assert "maximum context length is 64 tokens" in error["message"]


@pytest.mark.unit
def test_unknown_fields_are_ignored_and_known_ones_reach_the_engine():
    """Fields no OpenAI API defines (vLLM's min_p here) are ignored; the sampling fields this server
    implements reach the engine (tests/stages/api/test_chat_request_fields.py has each one)."""
    plain, extra = FakeAsyncEngine(), FakeAsyncEngine()
    assert post_raw(with_hi('"seed": 5'), plain).status_code == 200
    assert post_raw(with_hi('"seed": 5, "min_p": 0.5, "mirostat": [[]]'), extra).status_code == 200
    assert extra.params == plain.params
    fields = '"seed": 5, "logit_bias": {"7": -100}, "frequency_penalty": 2, "logprobs": true, "top_logprobs": 20'
    assert post_raw(with_hi(fields), extra).status_code == 200
    params = extra.params[-1]
    assert (params.logit_bias, params.frequency_penalty, params.logprobs) == (((7, -100.0),), 2.0, 20)


# --- documented clamps ------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("fragment, field, value", [
    ('"temperature": 5e-324', "temperature", MIN_TEMPERATURE),  # a denormal: the scaled logits overflow
    ('"temperature": 1e-30', "temperature", MIN_TEMPERATURE),
    ('"temperature": 0.01', "temperature", 0.01),
    ('"temperature": 0', "temperature", 0.0),
    ('"temperature": -0.0', "temperature", 0.0),
    ('"top_p": 1e-320', "top_p", MIN_TOP_P),  # rounds to 0 in float32: every token would be dropped
    ('"top_p": 0', "top_p", MIN_TOP_P),  # OpenAI takes 0: only the most likely token
    ('"top_p": 1e-400', "top_p", MIN_TOP_P),  # parses as 0.0
    ('"top_p": 0.5', "top_p", 0.5),
    (f'"top_k": {10**30}', "top_k", 0),  # more than 64 bits: disabled, as any k >= the vocabulary
    (f'"top_k": {VOCAB}', "top_k", 0),
    (f'"top_k": {VOCAB - 1}', "top_k", VOCAB - 1),
    ('"top_k": -1', "top_k", 0),
    ('"seed": 9223372036854775807', "seed", 2**63 - 1),
    ('"seed": -9223372036854775808', "seed", -(2**63)),
])
def test_documented_clamps_reach_the_engine(fragment, field, value):
    engine = FakeAsyncEngine()
    assert post_raw(with_hi(fragment), engine).status_code == 200
    assert getattr(engine.params[0], field) == value


@pytest.mark.unit
@pytest.mark.parametrize("fields", [
    {"temperature": 5e-324}, {"temperature": 1e-300, "top_p": 1e-320}, {"top_p": 1e-320}, {"top_p": 0},
    {"temperature": MIN_TEMPERATURE, "top_k": 1}, {"top_k": 10**30, "seed": -(2**63)}, {"seed": 2**63 - 1},
])
def test_what_the_api_lets_through_the_real_sampler_can_draw(fields):
    request = ChatCompletionRequest.model_validate({"messages": HI, **fields})
    params = sampling_params(request, prompt_len=4, max_model_len=64, vocab_size=VOCAB)
    logits = torch.randn(1, VOCAB) * 30
    token = sample(logits, [params], [make_generator(params.seed)])[0]
    assert isinstance(token, int) and 0 <= token < VOCAB


@pytest.mark.unit
def test_unclamped_a_denormal_temperature_fails_the_sampler():
    """The negative control of the clamp: the engine cannot draw with temperature 5e-324."""
    params = SamplingParams(temperature=5e-324)
    try:
        token = sample(torch.randn(1, VOCAB), [params], [make_generator(0)])[0]
    except RuntimeError:  # a sampler that fails the whole batch
        return
    assert not isinstance(token, int)  # a sampler that fails only this row


# --- bounded cost ------------------------------------------------------------------------------------
def test_a_body_of_millions_of_values_is_refused_at_a_bounded_cost():
    """4 million list items (8 MiB): pydantic alone builds every one before checking (2.6 GB, 4M errors)."""
    code = """
import resource, time
from stages.api.errors import APIError
from stages.api.parse import parse_request
bodies = [b'{"messages": [' + b"1," * 4_000_000 + b"1]}",
          b'{"messages": [{"role": "user", "content": [' + b"{}," * 2_000_000 + b"{}]}]}",
          b'{"messages": [{"role": "user"}], "stop": [' + b"1," * 4_000_000 + b"1]}"]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for body in bodies:
    try:
        parse_request(body)
    except APIError as exc:
        print(exc.status, exc.param)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    *refusals, grown_mib = out.stdout.split("\n")[:-1]
    assert refusals == ["400 messages", "400 messages[0].content", "400 stop"]
    assert int(grown_mib) < 200, out.stdout


@pytest.mark.unit
def test_parse_request_refuses_what_is_not_a_request_object():
    for raw, param in ((b"[1, 2]", None), (b'"messages"', None), (b'{"messages": {"role": "user"}}', "messages"),
                       (b'{"messages": [[{"role": "user"}]]}', "messages[0]")):
        with pytest.raises(APIError) as info:
            parse_request(raw)
        assert (info.value.status, info.value.param, info.value.code) == (400, param, "invalid_value"), raw


@pytest.mark.unit
def test_the_first_pass_knows_every_field_of_the_schema():
    """``parse`` drops what its shapes do not name: a field added to the schema alone would vanish."""
    from stages.api import message_schemas, parse, schemas

    pairs = ((schemas.ChatCompletionRequest, parse._Request), (message_schemas.ChatMessage, parse._Message),
             (message_schemas.ContentPart, parse._Part), (message_schemas.ImageURL, parse._ImageURL),
             (message_schemas.ImageRef, parse._ImageRef), (schemas.StreamOptions, parse._StreamOptions))
    for model, shape in pairs:
        assert set(model.model_fields) == set(shape.__struct_fields__), model.__name__
