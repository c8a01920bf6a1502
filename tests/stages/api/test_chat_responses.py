"""The chat answer's shapes: n choices grouped by index, logprobs, tool calls, usage summed over the
choices; stream chunks carrying their choice's index and logprobs. In-process against scripted
outputs (the app with a fake engine and a fixed ``prepare``), then a real colocated server on a tiny
model with the official ``openai`` client: logprobs equal ``log_softmax`` of Hugging Face's logits,
``n`` seeded choices equal the single requests of seeds ``seed + i``."""

from __future__ import annotations

import json

import jsonschema

import openai.types.chat as openai_chat
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from stages.api.chat_choices import Choices
from stages.api.chat_response import (ChatCompletion, ChatCompletionChunk, chunk, chunk_choice, choice, completion,
                                      logprobs_body, message, usage)
from stages.api.errors import APIError
from stages.api.app_config import AppConfig, AppParts
from stages.api.routes import create_app
from stages.api.common_schemas import ErrorBody, ModelList, model_card
from stages.api.token_text import TokenText, token_id_text
from stages.engine.outputs import RequestOutput
from stages.engine.logprobs import TokenLogprob
from stages.engine.multimodal import Prompt
from stages.engine.request import FinishReason
from stages.engine.sampling_params import SamplingParams
from stages.metrics import Metrics
from tests.support.colocated_openai import MODEL, TOLERANCE, client, model_dir, server  # noqa: F401
from tests.support.hf_reference import hf_greedy, hf_inputs, load_reference
from tests.support.stage_api import FakeAsyncEngine, sse_events


STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH
PROMPT_TOKENS = 5


def out(index: int, text: str, tokens: list[int], finish: FinishReason | None, done: int,
        logprobs: bool = True, **fields) -> RequestOutput:
    """An output of sequence ``index``: ``done`` its completion tokens so far; logprobs ``-token/10``
    with the two tokens after it as the top 2."""
    entries = [TokenLogprob(t, -t / 10, [(t + 1, -0.1), (t + 2, -0.2)]) for t in tokens] if logprobs else None
    return RequestOutput("r", text, tokens, finish, PROMPT_TOKENS, done, index=index, logprobs=entries,
                         cached_tokens=2, **fields)


# two sequences interleaved: 0 says "ab" then stops (its EOS token 9 shows no text); 1 says "xyz", cut by length
INTERLEAVED = [out(0, "a", [1], None, 1), out(1, "x", [4], None, 1), out(1, "", [5], None, 2),  # 5: text held back
               out(0, "b", [2], None, 2), out(1, "yz", [6], LENGTH, 3), out(0, "", [9], STOP, 3)]


def expected_logprobs(tokens: list[int]) -> dict:
    return {"content": [{"token": f"token_id:{t}", "logprob": -t / 10, "bytes": None,
                         "top_logprobs": [{"token": f"token_id:{t + 1}", "logprob": -0.1, "bytes": None},
                                          {"token": f"token_id:{t + 2}", "logprob": -0.2, "bytes": None}]}
                        for t in tokens]}


# --- grouping and formatting, pure --------------------------------------------------------------
@pytest.mark.unit
def test_whole_answer_groups_outputs_by_index():
    choices = Choices(2, logprobs=True, token_text=token_id_text)
    for output in INTERLEAVED:
        choices.add(output)
    assert choices.finished and (choices.prompt_tokens, choices.completion_tokens, choices.cached_tokens) == (5, 6, 2)
    assert choices.choices() == [
        {"index": 0, "message": {"role": "assistant", "content": "ab"}, "logprobs": expected_logprobs([1, 2, 9]),
         "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": "xyz"}, "logprobs": expected_logprobs([4, 5, 6]),
         "finish_reason": "length"}]


@pytest.mark.unit
def test_stream_pieces_carry_their_index_and_their_tokens_logprobs():
    choices = Choices(2, logprobs=True, token_text=token_id_text, stream=True)
    assert choices.roles() == [chunk_choice(0, {"role": "assistant", "content": ""}),
                               chunk_choice(1, {"role": "assistant", "content": ""})]
    pieces = [piece for output in INTERLEAVED for piece in choices.pieces(output)]
    lp = lambda t: expected_logprobs([t])  # noqa: E731
    assert pieces == [chunk_choice(0, {"content": "a"}, logprobs=lp(1)),
                      chunk_choice(1, {"content": "x"}, logprobs=lp(4)),
                      chunk_choice(1, {}, logprobs=lp(5)),  # held-back text: the logprobs alone
                      chunk_choice(0, {"content": "b"}, logprobs=lp(2)),
                      chunk_choice(1, {"content": "yz"}, logprobs=lp(6)),
                      chunk_choice(1, {}, "length"),
                      chunk_choice(0, {}, "stop", logprobs=lp(9))]  # the EOS token's, on the finish chunk
    assert choices.finished and choices.completion_tokens == 6


@pytest.mark.unit
def test_without_logprobs_asked_no_chunk_stands_for_held_back_text_alone():
    choices = Choices(2, logprobs=False, token_text=token_id_text, stream=True)
    pieces = [piece for output in INTERLEAVED for piece in choices.pieces(output)]
    assert all(piece["logprobs"] is None for piece in pieces)
    assert [(p["index"], p["delta"], p["finish_reason"]) for p in pieces] == [
        (0, {"content": "a"}, None), (1, {"content": "x"}, None), (0, {"content": "b"}, None),
        (1, {"content": "yz"}, None), (1, {}, "length"), (0, {}, "stop")]
    whole = Choices(1, logprobs=False, token_text=token_id_text)
    whole.add(out(0, "hi", [1], STOP, 1, logprobs=False))
    assert whole.choices()[0]["logprobs"] is None


@pytest.mark.unit
def test_an_output_of_an_index_out_of_range_is_refused():
    with pytest.raises(ValueError, match="sequence 2 of a request of 2"):
        Choices(2, logprobs=False, token_text=token_id_text).add(out(2, "a", [1], STOP, 1))


@pytest.mark.unit
def test_logprobs_below_the_floor_and_infinite_ones_read_as_the_floor():
    body = logprobs_body([TokenLogprob(3, float("-inf"), [(3, -1e6)])], token_id_text)
    assert body["content"][0]["logprob"] == -9999.0 and body["content"][0]["top_logprobs"][0]["logprob"] == -9999.0
    json.dumps(body, allow_nan=False)


class FakeTools:
    """A stand-in parser: ``CALL name`` is a call of ``name`` with ``{}``; anything else is content."""

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        if text.startswith("CALL "):
            return None, [{"id": "call_1", "type": "function", "function": {"name": text[5:], "arguments": "{}"}}]
        return text, []

    def stream(self):
        tools = self

        class Stream:
            def __init__(self) -> None:
                self.text, self.called = "", False

            def feed(self, text: str) -> list[dict]:
                self.text += text
                return []

            def finish(self) -> list[dict]:
                content, calls = tools.parse(self.text)
                self.called = bool(calls)
                return [{"tool_calls": [{"index": 0, **calls[0]}]}] if calls else [{"content": content}]
        return Stream()


@pytest.mark.unit
def test_tool_calls_make_the_message_and_the_finish_reason():
    choices = Choices(3, logprobs=False, token_text=token_id_text, tools=FakeTools())
    for output in (out(0, "CALL f", [1], STOP, 1), out(1, "CALL g", [1], LENGTH, 1), out(2, "plain", [1], STOP, 1)):
        choices.add(output)
    def call(name: str) -> list[dict]:
        return [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": "{}"}}]
    assert [(c["message"], c["finish_reason"]) for c in choices.choices()] == [
        ({"role": "assistant", "content": None, "tool_calls": call("f")}, "tool_calls"),
        ({"role": "assistant", "content": None, "tool_calls": call("g")}, "length"),  # cut: not a finished call
        ({"role": "assistant", "content": "plain"}, "stop")]
    streamed = Choices(1, logprobs=False, token_text=token_id_text, tools=FakeTools(), stream=True)
    pieces = streamed.pieces(out(0, "CALL ", [1], None, 1)) + streamed.pieces(out(0, "f", [2], STOP, 2))
    assert pieces == [chunk_choice(0, {"tool_calls": [{"index": 0, **call("f")[0]}]}),
                      chunk_choice(0, {}, "tool_calls")]


# --- the response models describe what the builders build, and the openai client reads it ----------
def built_bodies() -> tuple[list[dict], list[dict]]:
    lp = logprobs_body([TokenLogprob(1, -0.5, [(1, -0.5), (2, -1.0)])], TokenText(_FakeTokenizer()))
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]
    whole = [completion("chatcmpl-1", 1, "m", [choice(0, message("hi"), "stop")], usage(3, 1)),
             completion("chatcmpl-1", 1, "m", [choice(0, message("", None), "length", lp),
                                               choice(1, message(None, calls), "tool_calls", {"content": []})],
                        usage(3, 2, 1))]
    chunks = [chunk("c", 1, "m", [chunk_choice(0, {"role": "assistant", "content": ""})]),
              chunk("c", 1, "m", [chunk_choice(1, {"content": "x"}, logprobs=lp)], with_usage=True),
              chunk("c", 1, "m", [chunk_choice(0, {}, logprobs=lp)]),
              chunk("c", 1, "m", [chunk_choice(0, {"tool_calls": [{"index": 0, **calls[0]}]})]),
              chunk("c", 1, "m", [chunk_choice(0, {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]})]),
              chunk("c", 1, "m", [chunk_choice(0, {}, "stop")]),
              chunk("c", 1, "m", [chunk_choice(2, {}, "tool_calls")]),
              chunk("c", 1, "m", None, with_usage=True, usage_body=usage(3, 1))]
    return whole, chunks


class _FakeTokenizer:
    """Byte-level enough for ``TokenText``: id 1 is 'Ġa' (" a"), 2 is 'Ã' (half of a 2-byte character)."""

    class backend_tokenizer:  # noqa: N801  # the attribute's name in transformers
        class decoder:  # noqa: N801
            pass

    added_tokens_decoder: dict = {}

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return {1: "Ġa", 2: "Ã"}.get(token_id)

    def decode(self, ids: list[int]) -> str:
        return {1: " a", 2: "\ufffd"}[ids[0]]


@pytest.mark.unit
def test_response_models_and_the_openai_types_read_the_built_bodies():
    whole, chunks = built_bodies()
    for body in whole:
        ChatCompletion.model_validate(body, strict=True)
        assert openai_chat.ChatCompletion.model_validate(body).model_dump(exclude_unset=True) == body
    for body in chunks:
        ChatCompletionChunk.model_validate(body, strict=True)
        assert openai_chat.ChatCompletionChunk.model_validate(body).model_dump(exclude_unset=True) == body
    ModelList.model_validate({"object": "list", "data": [model_card("m", 1, "epd-stage")]}, strict=True)
    ErrorBody.model_validate(APIError(503, "busy", code="server_overloaded").body(), strict=True)


@pytest.mark.unit
def test_token_text_gives_a_byte_level_token_its_own_bytes():
    text = TokenText(_FakeTokenizer())
    text.byte_level = True  # the fake's decoder is not tokenizers' ByteLevel
    assert text(1) == (" a", [0x20, 0x61]) and text(2) == ("\ufffd", [0xC3]) and text(7) == ("", None)


def test_token_text_bytes_join_into_the_text_of_a_real_byte_level_tokenizer(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "héllo wörld, 日本語 ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    token_text = TokenText(tokenizer)
    assert token_text.byte_level
    assert bytes(byte for token_id in ids for byte in token_text(token_id)[1]) == text.encode()
    assert "".join(token_text(token_id)[0] for token_id in ids) != text  # pieces of characters decode to U+FFFD
    assert token_text(tokenizer.convert_tokens_to_ids("<|im_end|>")) == ("<|im_end|>", list(b"<|im_end|>"))


# --- through the app: a fixed prepare, scripted outputs ---------------------------------------------
def app_client(outputs: list[RequestOutput], params: SamplingParams) -> TestClient:
    engine = FakeAsyncEngine(lambda request_id, prompt: iter(outputs))
    app = create_app(AppParts(engine, lambda body: (Prompt(token_ids=[1] * PROMPT_TOKENS), params)), AppConfig("m"))
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.unit
def test_the_app_answers_n_choices_with_usage_summed():
    body = app_client(INTERLEAVED, SamplingParams(n=2, logprobs=2)).post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert [c["message"]["content"] for c in body["choices"]] == ["ab", "xyz"]
    assert body["choices"][1]["logprobs"] == expected_logprobs([4, 5, 6])
    assert body["usage"] == usage(PROMPT_TOKENS, 6, 2)


@pytest.mark.unit
def test_the_app_streams_each_choice_by_index():
    response = app_client(INTERLEAVED, SamplingParams(n=2, logprobs=2)).post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                      "stream_options": {"include_usage": True}})
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(len(c["choices"]) == 1 for c in chunks[:-1]) and chunks[-1]["usage"] == usage(PROMPT_TOKENS, 6, 2)
    by_index = {0: "", 1: ""}
    for c in chunks[:-1]:
        by_index[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert by_index == {0: "ab", 1: "xyz"}
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks[:2]] == [(0, None), (1, None)]
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks[-3:-1]] == [(1, "length"),
                                                                                                  (0, "stop")]


@pytest.mark.unit
def test_metrics_count_every_sequence_and_time_tokens_per_sequence():
    metrics = Metrics()
    engine = FakeAsyncEngine(lambda request_id, prompt: iter(INTERLEAVED))
    app = create_app(AppParts(engine, lambda body: (Prompt(token_ids=[1] * PROMPT_TOKENS), SamplingParams(n=2)),
                              metrics=metrics), AppConfig("m"))
    TestClient(app).post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    sample = metrics.registry.get_sample_value
    assert sample("epd_generation_tokens_total") == 6 and sample("epd_prompt_tokens_total") == PROMPT_TOKENS
    after_first = sample("epd_e2e_request_latency_seconds_sum") - sample("epd_time_to_first_token_seconds_sum")
    assert sample("epd_time_per_output_token_seconds_sum") == pytest.approx(after_first / (3 - 1))  # per sequence


@pytest.mark.unit
def test_a_request_whose_outputs_end_before_every_choice_finished_is_an_engine_error():
    client = app_client(INTERLEAVED[:-1], SamplingParams(n=2))  # sequence 0 never finishes
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
    events = sse_events(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "stream": True}))
    assert json.loads(events[-2])["error"]["code"] == "engine_error" and events[-1] == "[DONE]"


# --- a real colocated server, the official client -----------------------------------------------------
HI = [{"role": "user", "content": "Tell me about logprobs"}]


@pytest.fixture(scope="module")
def reference(model_dir):
    """The greedy continuation of ``HI`` by Hugging Face and ``log_softmax`` of its logits at each
    generated position: (prompt ids, generated ids, [position, vocab] logprobs)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    model = load_reference(model_dir)
    generated = hf_greedy(model, Prompt(token_ids=prompt), model.config.image_token_id, GREEDY_TOKENS)
    with torch.no_grad():
        logits = model(**hf_inputs(Prompt(token_ids=prompt + generated), model.config.image_token_id)).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:-1]
    return prompt, generated, logprobs, TokenText(tokenizer)


GREEDY_TOKENS, TOP = 6, 5


def assert_matches_reference(content, reference) -> None:
    """``content`` (a choice's logprobs.content) is the greedy continuation, with Hugging Face's values."""
    _, generated, logprobs, token_text = reference
    assert len(content) == len(generated)
    for position, (entry, token_id) in enumerate(zip(content, generated)):
        assert (entry.token, entry.bytes) == token_text(token_id), position
        assert abs(entry.logprob - logprobs[position, token_id].item()) < TOLERANCE, position
        best = logprobs[position].topk(TOP)
        assert len(entry.top_logprobs) == TOP
        assert [top.token for top in entry.top_logprobs] == [token_text(i)[0] for i in best.indices.tolist()]
        assert all(abs(top.logprob - value) < TOLERANCE for top, value in zip(entry.top_logprobs, best.values.tolist()))
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely token was taken


def greedy(client, **fields):
    return client.chat.completions.create(model=MODEL, messages=HI, max_tokens=GREEDY_TOKENS, temperature=0,
                                          logprobs=True, top_logprobs=TOP, **fields)


def test_greedy_logprobs_equal_hugging_face(client, reference):
    answer = greedy(client)
    (choice,) = answer.choices
    assert answer.usage.prompt_tokens == len(reference[0])
    assert answer.usage.completion_tokens == len(choice.logprobs.content)
    assert_matches_reference(choice.logprobs.content, reference)


def test_streamed_greedy_logprobs_equal_hugging_face(client, reference):
    chunks = list(greedy(client, stream=True))
    content = [entry for chunk in chunks for choice in chunk.choices if choice.logprobs
               for entry in choice.logprobs.content]
    assert_matches_reference(content, reference)
    text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
    assert text == greedy(client).choices[0].message.content


def test_top_logprobs_zero_gives_the_token_alone(client):
    (choice,) = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0,
                                               logprobs=True).choices
    assert choice.logprobs.content and all(entry.top_logprobs == [] for entry in choice.logprobs.content)
    (plain,) = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0).choices
    assert plain.logprobs is None


def sampled(client, n: int, seed: int, **fields):
    return client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10, temperature=1.0, seed=seed, n=n,
                                          **fields)


def test_n_seeded_choices_equal_the_single_requests_of_seed_plus_i(client):
    together = sampled(client, 3, seed=11)
    singles = [sampled(client, 1, seed=11 + i) for i in range(3)]
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [(c.message.content, c.finish_reason) for c in together.choices] == \
        [(s.choices[0].message.content, s.choices[0].finish_reason) for s in singles]
    assert together.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert together.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert together.usage.total_tokens == together.usage.prompt_tokens + together.usage.completion_tokens
    assert len({c.message.content for c in together.choices}) > 1  # the sequences drew differently


def test_n_streamed_chunks_name_their_choice(client):
    chunks = list(sampled(client, 2, seed=5, stream=True, stream_options={"include_usage": True}))
    whole = sampled(client, 2, seed=5)
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    texts, roles, finishes = {0: "", 1: ""}, {0: 0, 1: 0}, {0: [], 1: []}
    for chunk_ in chunks[:-1]:
        (piece,) = chunk_.choices
        texts[piece.index] += piece.delta.content or ""
        roles[piece.index] += piece.delta.role == "assistant"
        if piece.finish_reason is not None:
            finishes[piece.index].append(piece.finish_reason)
    assert roles == {0: 1, 1: 1}
    assert [texts[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
    assert [finishes[i] for i in (0, 1)] == [[c.finish_reason] for c in whole.choices]


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "weather"}}


def test_a_named_tool_call_comes_back_as_tool_calls(client):
    answer = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=64, temperature=1.0, seed=3,
                                            tools=[WEATHER], tool_choice=NAMED, n=2)
    for choice_ in answer.choices:
        assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
        (call,) = choice_.message.tool_calls
        assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_required_tool_calls_come_back_as_tool_calls_ended_or_cut_by_length(client):
    """A required call is an array of calls: random weights may go on adding calls past max_tokens.
    Cut, it is still tool calls (OpenAI's answer): the whole ones, then the cut one, its arguments a
    prefix of a call's; never content."""
    fields = dict(model=MODEL, messages=HI, max_tokens=64, temperature=1.0, seed=0, tools=[WEATHER],
                  tool_choice="required", n=8)
    answer = client.chat.completions.create(**fields)
    for choice_ in answer.choices:
        calls = choice_.message.tool_calls
        assert choice_.message.content is None and calls and choice_.finish_reason in ("tool_calls", "length")
        assert all(call.function.name == "weather" for call in calls)
        whole = calls if choice_.finish_reason == "tool_calls" else calls[:-1]
        assert all(json.loads(call.function.arguments)["city"] in ("Paris", "Rome") for call in whole)
        assert any(f'{{"city": "{city}"}}'.startswith(calls[-1].function.arguments) for city in ("Paris", "Rome"))
    assert {c.finish_reason for c in answer.choices} == {"tool_calls", "length"}  # both kinds, for the stream below
    streamed: dict[int, list] = {i: [] for i in range(8)}
    for chunk_ in client.chat.completions.create(**fields, stream=True):
        for piece in chunk_.choices:
            streamed[piece.index].append(piece)
    for choice_ in answer.choices:
        pieces = streamed[choice_.index]
        assert pieces[-1].finish_reason == choice_.finish_reason
        calls = [call for piece in pieces for call in piece.delta.tool_calls or ()]
        assert [(c.function.name, c.function.arguments) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in choice_.message.tool_calls or ()]
        assert "".join(piece.delta.content or "" for piece in pieces) == (choice_.message.content or "")


def test_a_forced_tool_call_streams_as_tool_call_deltas(client):
    fields = dict(model=MODEL, messages=HI, max_tokens=64, temperature=1.0, seed=3, tools=[WEATHER], tool_choice=NAMED)
    whole = client.chat.completions.create(**fields).choices[0]
    pieces = [chunk_.choices[0] for chunk_ in client.chat.completions.create(**fields, stream=True) if chunk_.choices]
    deltas = [call for piece in pieces for call in piece.delta.tool_calls or ()]
    assert deltas[0].function.name == "weather" and deltas[0].id.startswith("call_") and deltas[0].index == 0
    assert "".join(d.function.arguments or "" for d in deltas) == whole.message.tool_calls[0].function.arguments
    assert all(not piece.delta.content for piece in pieces) and pieces[-1].finish_reason == "tool_calls"


def test_the_openai_clients_tool_loop(client):
    """The loop an agent runs with the official client: a forced call comes back as tool_calls; the
    assistant message (as the client returns it) and the tool's result go back into the history; the
    next turn (tool_choice none: answer now; the tools block is not rendered, which keeps this tiny
    model's prompt within its 512 tokens) is served and ends by itself or at max_tokens."""
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice=NAMED,
                                           max_tokens=64, temperature=0)
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 22C"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None
    alone = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1, temperature=0)
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + first.usage.completion_tokens  # the call rendered
    again = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert again.choices[0].message == second.choices[0].message  # greedy: the history renders the same way


THING = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "name": {"type": "string", "maxLength": 6},
                                          "size": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["color", "name", "size"], "additionalProperties": False}


def test_structured_output_parses_and_validates_for_20_seeds(client):
    """Random weights under a bounded schema (enums, maxLength, a range) with room to finish: every
    output of 20 seeded sequences (5 requests of n=4, sequence i seeded seed + i) parses and validates;
    json_object gives objects; a cut one says length."""
    schema = {"type": "json_schema", "json_schema": {"name": "thing", "schema": THING, "strict": True}}
    for seed in range(0, 20, 4):
        answer = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=200, temperature=1.0, seed=seed,
                                                n=4, response_format=schema)
        for choice_ in answer.choices:
            assert choice_.finish_reason == "stop"
            jsonschema.validate(json.loads(choice_.message.content), THING)
    objects = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=200, temperature=1.0, seed=0, n=4,
                                             response_format={"type": "json_object"})
    assert all(isinstance(json.loads(c.message.content), dict) for c in objects.choices if c.finish_reason == "stop")
    cut = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=1.0, seed=0,
                                         response_format=schema)
    assert cut.choices[0].finish_reason == "length"
