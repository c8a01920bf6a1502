"""The chat answer's shapes: n choices grouped by index, logprobs, tool calls, usage summed over the
choices; stream chunks carrying their choice's index and logprobs. In-process against scripted
outputs (the app with a fake engine and a fixed ``prepare``), then a real colocated server on a tiny
model with the official ``openai`` client: logprobs equal ``log_softmax`` of Hugging Face's logits,
``n`` seeded choices equal the single requests of seeds ``seed + i``."""

from __future__ import annotations

import json

import openai.types.chat as openai_chat
import pytest
from fastapi.testclient import TestClient

from stages.api.chat_choices import Choices
from stages.api.chat_response import (ChatCompletion, ChatCompletionChunk, chunk, chunk_choice, choice, completion,
                                      logprobs_body, message, usage)
from stages.api.errors import APIError
from stages.api.routes import create_app
from stages.api.schemas import ErrorBody, ModelList, model_card
from stages.api.token_text import TokenText, token_id_text
from stages.engine.engine import RequestOutput
from stages.engine.logprobs import TokenLogprob
from stages.engine.multimodal import Prompt
from stages.engine.request import FinishReason
from stages.engine.sampling_params import SamplingParams
from tests.test_api_units import FakeAsyncEngine, sse_events

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


def test_an_output_of_an_index_out_of_range_is_refused():
    with pytest.raises(ValueError, match="sequence 2 of a request of 2"):
        Choices(2, logprobs=False, token_text=token_id_text).add(out(2, "a", [1], STOP, 1))


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


def test_tool_calls_make_the_message_and_the_finish_reason():
    choices = Choices(3, logprobs=False, token_text=token_id_text, tools=FakeTools())
    for output in (out(0, "CALL f", [1], STOP, 1), out(1, "CALL g", [1], LENGTH, 1), out(2, "plain", [1], STOP, 1)):
        choices.add(output)
    call = lambda name: [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": "{}"}}]  # noqa: E731
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


def test_token_text_gives_a_byte_level_token_its_own_bytes():
    text = TokenText(_FakeTokenizer())
    text.byte_level = True  # the fake's decoder is not tokenizers' ByteLevel
    assert text(1) == (" a", [0x20, 0x61]) and text(2) == ("\ufffd", [0xC3]) and text(7) == ("", None)


# --- through the app: a fixed prepare, scripted outputs ---------------------------------------------
def app_client(outputs: list[RequestOutput], params: SamplingParams) -> TestClient:
    engine = FakeAsyncEngine(lambda request_id, prompt: iter(outputs))
    app = create_app(engine, model_name="m", prepare=lambda body: (Prompt(token_ids=[1] * PROMPT_TOKENS), params))
    return TestClient(app, raise_server_exceptions=False)


def test_the_app_answers_n_choices_with_usage_summed():
    body = app_client(INTERLEAVED, SamplingParams(n=2, logprobs=2)).post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert [c["message"]["content"] for c in body["choices"]] == ["ab", "xyz"]
    assert body["choices"][1]["logprobs"] == expected_logprobs([4, 5, 6])
    assert body["usage"] == usage(PROMPT_TOKENS, 6, 2)


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


def test_a_request_whose_outputs_end_before_every_choice_finished_is_an_engine_error():
    client = app_client(INTERLEAVED[:-1], SamplingParams(n=2))  # sequence 0 never finishes
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
    events = sse_events(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "stream": True}))
    assert json.loads(events[-2])["error"]["code"] == "engine_error" and events[-1] == "[DONE]"
