"""Issue 19's request fields through 1P1D (Mooncake) and 1E1P1D, with the official openai client against
the decode (the same body to the prefill at once, as a PD router sends it) and through the router: greedy
logprobs, the first token's included, equal colocated's and Hugging Face's ``log_softmax`` within 1e-4;
``n=3`` seeded equals colocated's ``n=3`` choice by choice (stream too, logprobs by index); penalties and
``logit_bias`` give colocated's tokens; ``response_format`` outputs and a forced tool call parse, validate
and equal colocated's; a forced call of a tool whose object leaves ``additionalProperties`` unsaid ends in
EPD (issue 31), and ``required`` cut by max_tokens is still tool calls; ``/v1/completions``
``echo`` with ``logprobs`` gets the prompt's logprobs from the prefill (``KVReady``) equal to colocated's; and
the KV blocks of both stages are back to their baseline after an ``n=3`` request and after an aborted one."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import jsonschema
import openai
import pytest
import torch

from stages.engine.models import load_adapter
from stages.engine.multimodal import Prompt
from process.ports import free_port
from stages.prompt import PromptBuilder
from tests.support.epd_helpers import start_epd
from tests.support.hf_reference import hf_greedy, hf_inputs, load_reference
from tests.support.redis_fixtures import flush, redis_server  # noqa: F401
from tests.support.router_helpers import arm

pytestmark = pytest.mark.timeout(300)
TOLERANCE = 1e-4
FAST = ["--kv-cache-mib", "16", "--transfer", "mooncake", "--pair-timeout-s", "5", "--transfer-timeout-s", "5"]
MESSAGES = [{"role": "user", "content": "Tell me about the sea, in detail."}]
SCHEMA = {  # bounded: a random-weight model ends it well within MAX_JSON_TOKENS (tests/stages/guided/test_guided.py)
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "name", "size"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
MAX_JSON_TOKENS = 200


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2_vl"))


@pytest.fixture(scope="module")
def colocated(start_server, model):
    return start_server("colocated", "--model", model, "--kv-cache-mib", "16")


def served_name(server) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]


class Stages:
    """A prefill and a decode taking one body each per request (``bootstrap_*`` added)."""

    def __init__(self, prefill, decode, bootstrap_port: int) -> None:
        self.prefill, self.decode, self.bootstrap_port = prefill, decode, bootstrap_port
        self.model = served_name(decode)

    def room(self) -> dict:
        return {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": random.getrandbits(63)}

    async def chat(self, **kwargs):
        """The decode's answer through the official client (a stream: its chunks), the prefill's JSON."""
        room = self.room()
        decode = openai.AsyncOpenAI(base_url=f"{self.decode.url}/v1", api_key="x", max_retries=0, timeout=120)
        async with decode, httpx.AsyncClient(timeout=120) as http:
            async def answer(kwargs: dict):
                extra = {**kwargs.pop("extra_body", {}), **room}
                reply = await decode.chat.completions.create(model=self.model, extra_body=extra, **kwargs)
                return [chunk async for chunk in reply] if kwargs.get("stream") else reply

            plain = {k: v for k, v in kwargs.items() if k not in ("extra_body", "stream", "stream_options")}
            prefill_body = {"model": self.model, **plain, **kwargs.get("extra_body", {}), **room}
            prefill = http.post(f"{self.prefill.url}/v1/chat/completions", json=prefill_body)
            d, p = await asyncio.gather(answer(dict(kwargs)), prefill)
        assert p.status_code == 200, p.text
        return d, p.json()

    def blocks_used(self) -> tuple[int, int]:
        return tuple(httpx.get(f"{s.url}/server_info", timeout=10).json()["kv_blocks"]["used"]
                     for s in (self.prefill, self.decode))

    def wait_blocks_free(self, within_s: float = 10.0) -> None:
        deadline = time.monotonic() + within_s
        while any(used := self.blocks_used()):
            assert time.monotonic() < deadline, f"blocks still in use (prefill, decode): {used}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def pd(start_server, model):
    port = free_port()
    prefill = start_server("prefill", "--model", model, *FAST, "--bootstrap-port", str(port), "--debug-faults")
    decode = start_server("decode", "--model", model, *FAST, "--kv-timeout-s", "20", "--abort-grace-s", "1")
    return Stages(prefill, decode, port)


@pytest.fixture(scope="module")
def epd(redis_server, tmp_path_factory):  # noqa: F811
    flush(redis_server.url)
    stack = start_epd("qwen2_vl", "mooncake", redis_server.url, tmp_path_factory.mktemp("epd-openai-surface"))
    yield Stages(stack.prefill, stack.decode, stack.bootstrap_port)
    stack.stop()


@pytest.fixture(scope="module")
def router(start_server, pd):
    return start_server("router", "--prefill", pd.prefill.url, "--decode", pd.decode.url,
                        "--upstream-timeout-s", "60", "--health-interval-s", "0.5")


@pytest.fixture(params=["pd", "epd"])
def stages(request):
    return request.getfixturevalue(request.param)


def colocated_chat(colocated, **kwargs):
    client = openai.OpenAI(base_url=f"{colocated.url}/v1", api_key="x", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=served_name(colocated), **kwargs)
    return [chunk for chunk in reply] if kwargs.get("stream") else reply


def _logprobs(choice) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs])
            for t in choice.logprobs.content]


def _close(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and abs(x[1] - y[1]) < TOLERANCE and [t for t, _ in x[2]] == [t for t, _ in y[2]]
        and all(abs(p - q) < TOLERANCE for (_, p), (_, q) in zip(x[2], y[2])) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference(model):
    adapter = load_adapter(model, torch.float32, "sdpa")
    prompts = PromptBuilder.load(model, adapter)
    return load_reference(model), prompts


# --- logprobs ------------------------------------------------------------------------------------


async def test_greedy_logprobs_equal_colocated_and_hugging_face(stages, colocated, reference):
    kwargs = dict(messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5,
                  extra_body={"ignore_eos": True})
    d, p = await stages.chat(**kwargs)
    c = colocated_chat(colocated, **kwargs)
    assert d.choices[0].message.content == c.choices[0].message.content
    assert _close(_logprobs(d.choices[0]), _logprobs(c.choices[0]))
    # the prefill's answer: the first token and its logprobs, the decode's first
    assert p["choices"][0]["logprobs"]["content"][0]["token"] == d.choices[0].logprobs.content[0].token
    assert abs(p["choices"][0]["logprobs"]["content"][0]["logprob"] - d.choices[0].logprobs.content[0].logprob) < 1e-6

    hf, prompts = reference
    prompt = prompts.build(MESSAGES, [])
    expected = hf_greedy(hf, prompt, hf.config.image_token_id, 8)
    every = prompt.token_ids + expected
    with torch.no_grad():
        logits = hf(**hf_inputs(Prompt(token_ids=every), hf.config.image_token_id)).logits[0].float()
    log_softmax = torch.log_softmax(logits, dim=-1)[len(prompt.token_ids) - 1:]
    content = d.choices[0].logprobs.content
    assert len(content) == len(expected) == 8
    for i, (token, entry) in enumerate(zip(expected, content)):
        assert abs(entry.logprob - log_softmax[i, token].item()) < TOLERANCE, i  # i == 0: the prefill's token
        best = log_softmax[i].topk(5)
        assert [abs(top.logprob - v) < TOLERANCE for top, v in zip(entry.top_logprobs, best.values.tolist())] == [True] * 5
    stages.wait_blocks_free()


# --- n ---------------------------------------------------------------------------------------------


async def test_n_seeded_equals_colocated_choice_by_choice(stages, colocated):
    kwargs = dict(messages=MESSAGES, max_tokens=10, temperature=1.0, seed=1234, n=3, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    d, p = await stages.chat(**kwargs)
    c = colocated_chat(colocated, **kwargs)
    assert [ch.index for ch in d.choices] == [0, 1, 2]
    assert [ch.message.content for ch in d.choices] == [ch.message.content for ch in c.choices]
    assert len({ch.message.content for ch in c.choices}) > 1  # three streams, not one thrice
    for dc, cc in zip(d.choices, c.choices):
        assert _close(_logprobs(dc), _logprobs(cc))
    assert d.usage.completion_tokens == c.usage.completion_tokens == 30
    assert d.usage.prompt_tokens == c.usage.prompt_tokens
    # the prefill answered every sequence's first token
    assert [ch["index"] for ch in p["choices"]] == [0, 1, 2]
    assert [ch["logprobs"]["content"][0]["token"] for ch in p["choices"]] == \
           [ch.logprobs.content[0].token for ch in d.choices]
    stages.wait_blocks_free()  # n sequences, one prompt: every block back on both sides


async def test_n_streamed_carries_each_index_and_its_logprobs(pd, colocated):
    kwargs = dict(messages=MESSAGES, max_tokens=6, temperature=0.8, seed=99, n=3, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    chunks, _ = await pd.chat(**kwargs, stream=True, stream_options={"include_usage": True})
    texts, logprobs = ["", "", ""], [[], [], []]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                logprobs[choice.index] += [(t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs])
                                           for t in choice.logprobs.content or []]
    c = colocated_chat(colocated, **kwargs)
    assert texts == [ch.message.content for ch in c.choices]
    assert all(_close(got, _logprobs(want)) for got, want in zip(logprobs, c.choices))
    assert chunks[-1].usage.completion_tokens == 18
    pd.wait_blocks_free()


# --- penalties and logit_bias -------------------------------------------------------------------------


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 5)])
async def test_penalties_and_logit_bias_give_colocated_tokens(pd, colocated, reference, temperature, seed):
    """The greedy first token banned by ``logit_bias`` (the prefill samples the first token: it must
    apply the bias), three penalties on: the decode's tokens are colocated's, and (greedy) the
    penalties changed them."""
    hf, prompts = reference
    banned = hf_greedy(hf, prompts.build(MESSAGES, []), hf.config.image_token_id, 1)[0]
    plain = dict(messages=MESSAGES, max_tokens=12, temperature=temperature, seed=seed,
                 logit_bias={str(banned): -100}, logprobs=True, extra_body={"ignore_eos": True})
    kwargs = {**plain, "presence_penalty": 2.0, "frequency_penalty": 2.0,
              "extra_body": {"ignore_eos": True, "repetition_penalty": 2.0}}
    d, p = await pd.chat(**kwargs)
    c = colocated_chat(colocated, **kwargs)
    tokens = [t.token for t in d.choices[0].logprobs.content]
    assert tokens == [t.token for t in c.choices[0].logprobs.content]
    assert d.choices[0].message.content == c.choices[0].message.content
    assert prompts.tokenizer.decode([banned]) not in tokens
    assert p["choices"][0]["logprobs"] is None or p["choices"][0]["logprobs"]["content"][0]["token"] == tokens[0]
    if temperature == 0:  # (seeded sampling keeps a token whose rivals were penalized: it won before)
        unpenalized, _ = await pd.chat(**plain)
        assert [t.token for t in unpenalized.choices[0].logprobs.content] != tokens
    pd.wait_blocks_free()


# --- structured output ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
async def test_json_schema_outputs_validate_and_equal_colocated(stages, colocated, seed):
    kwargs = dict(messages=[{"role": "user", "content": "Describe a thing as JSON."}], max_tokens=MAX_JSON_TOKENS,
                  temperature=1.0, seed=seed, n=2, response_format=JSON_SCHEMA)
    d, p = await stages.chat(**kwargs)
    c = colocated_chat(colocated, **kwargs)
    assert [ch.message.content for ch in d.choices] == [ch.message.content for ch in c.choices]
    for choice in d.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # the prefill's first tokens obeyed the grammar: each output starts with them
    assert all(ch.message.content.startswith(pc["message"]["content"]) for ch, pc in zip(d.choices, p["choices"]))
    stages.wait_blocks_free()


async def test_json_cut_by_max_tokens_says_length(pd):
    d, _ = await pd.chat(messages=MESSAGES, max_tokens=3, temperature=1.0, seed=1, response_format=JSON_SCHEMA)
    assert d.choices[0].finish_reason == "length"
    pd.wait_blocks_free()


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "maxLength": 8},
                                             "unit": {"enum": ["c", "f"]}},
                                             "required": ["city", "unit"], "additionalProperties": False}}}


async def test_a_forced_tool_call_through_pd_parses_and_equals_colocated(pd, colocated):
    """A named ``tool_choice`` is a grammar too: the prefill's first token and the decode's rest obey it."""
    kwargs = dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[TOOL], max_tokens=MAX_JSON_TOKENS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=2)
    d, _ = await pd.chat(**kwargs)
    c = colocated_chat(colocated, **kwargs)
    (call,) = d.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    assert call.function.arguments == c.choices[0].message.tool_calls[0].function.arguments
    pd.wait_blocks_free()


OPEN_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                              "parameters": {"type": "object", "properties": {  # additionalProperties unsaid
                                                  "city": {"type": "string", "maxLength": 8},
                                                  "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
FORCED = {"named": {"type": "function", "function": {"name": "get_weather"}}, "required": "required"}
# seeds where the open object wrote an extra key past 60 tokens (additionalProperties true: length); closed, the
# call ends (and required's array after it). CUT: required's array goes on to a second call, cut in its arguments.
FORCED_SEED = {"named": 0, "required": 4}
CUT_SEED, CUT_TOKENS = 2, 90


def _calls(answer, stream: bool) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of an answer's first choice, whole or streamed."""
    if not stream:
        ch = answer.choices[0]
        return ch.message.content, [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or ()], \
            ch.finish_reason
    pieces = [chunk.choices[0] for chunk in answer if chunk.choices]
    calls: dict[int, list[str]] = {}
    for delta in (call for piece in pieces for call in piece.delta.tool_calls or ()):
        name, arguments = calls.setdefault(delta.index, ["", ""])
        calls[delta.index] = [name + (delta.function.name or ""), arguments + (delta.function.arguments or "")]
    return "".join(p.delta.content or "" for p in pieces) or None, [(n, a) for n, a in calls.values()], \
        pieces[-1].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("forced", ["named", "required"])
async def test_a_forced_call_of_a_tool_whose_object_is_open_ends_within_60_tokens(epd, colocated, forced, stream):
    """Issue 31: a tool whose parameters leave ``additionalProperties`` unsaid, forced, ends its
    arguments after the declared keys (the compiler closes the object), in colocated and EPD, whole
    and streamed: tool calls, finish_reason tool_calls, no content, the same call both ways."""
    kwargs = dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[OPEN_TOOL], max_tokens=60,
                  tool_choice=FORCED[forced], temperature=1.0, seed=FORCED_SEED[forced], stream=stream)
    d, _ = await epd.chat(**kwargs)
    c = colocated_chat(colocated, **kwargs)
    content, calls, finish = _calls(d, stream)
    assert (content, finish) == (None, "tool_calls"), (content, calls)
    (name, arguments), = calls
    assert name == "get_weather" and json.loads(arguments).keys() == {"city", "unit"}, arguments
    jsonschema.validate(json.loads(arguments), OPEN_TOOL["function"]["parameters"])
    assert _calls(c, stream) == (content, calls, finish)
    epd.wait_blocks_free()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_required_call_cut_by_max_tokens_is_still_tool_calls(epd, colocated, stream):
    """Cut by max_tokens, ``required``'s output is tool calls as OpenAI answers it (finish_reason length,
    the last call's arguments unfinished), never content; EPD and colocated alike, whole and streamed."""
    kwargs = dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[OPEN_TOOL],
                  max_tokens=CUT_TOKENS, tool_choice="required", temperature=1.0, seed=CUT_SEED, stream=stream)
    d, _ = await epd.chat(**kwargs)
    content, calls, finish = _calls(d, stream)
    assert content is None and finish == "length" and len(calls) == 2, (content, calls)
    (first_name, first), (cut_name, cut) = calls
    assert first_name == cut_name == "get_weather" and json.loads(first).keys() == {"city", "unit"}
    assert cut and '{"city": "'.startswith(cut), cut  # the second call's arguments, unfinished
    assert _calls(colocated_chat(colocated, **kwargs), stream) == (content, calls, finish)
    epd.wait_blocks_free()


# --- blocks after an aborted request ----------------------------------------------------------------------


async def test_blocks_back_after_an_aborted_n_request(pd):
    room = pd.room()
    body = {"model": pd.model, "messages": MESSAGES, "max_tokens": 2000, "temperature": 1.0, "seed": 3, "n": 3,
            "ignore_eos": True, "logprobs": True, "stream": True, **room}
    async with httpx.AsyncClient(timeout=60) as http:
        prefill = asyncio.ensure_future(http.post(f"{pd.prefill.url}/v1/chat/completions", json={**body, "stream": False}))
        async with http.stream("POST", f"{pd.decode.url}/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            seen: set[int] = set()
            async for line in reply.aiter_lines():  # until every sequence is decoding, then leave
                if line.startswith("data: {"):
                    seen.update(ch["index"] for ch in json.loads(line[6:])["choices"] if ch["delta"].get("content"))
                    if len(seen) == 3:
                        break
        assert (await prefill).status_code == 200
    pd.wait_blocks_free()


async def test_blocks_back_after_an_n_request_aborted_before_its_kv(pd):
    """The decode's client leaves while the prefill holds the room after the write (its three first
    tokens sampled, the KV written once): the prefill fails the room, and both sides free every block."""
    arm(pd.prefill, "prefill.delay_ready", 1, delay_s=3.0)
    body = {"model": pd.model, "messages": MESSAGES, "max_tokens": 50, "temperature": 1.0, "seed": 4, "n": 3,
            "ignore_eos": True, **pd.room()}
    async with httpx.AsyncClient(timeout=60) as http:
        prefill = asyncio.ensure_future(http.post(f"{pd.prefill.url}/v1/chat/completions", json=body))
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{pd.decode.url}/v1/chat/completions", json=body, timeout=1.5)
        answer = await prefill
    assert answer.status_code == 502 and "decode aborted" in answer.json()["error"]["message"], answer.text
    pd.wait_blocks_free(within_s=15)


# --- through the router ---------------------------------------------------------------------------------


def test_through_the_router(router, colocated):
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=120)
    kwargs = dict(messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, n=3, logprobs=True, top_logprobs=3,
                  extra_body={"ignore_eos": True})
    name = served_name(colocated)
    r = client.chat.completions.create(model=name, **kwargs)
    c = colocated_chat(colocated, **kwargs)
    assert [ch.message.content for ch in r.choices] == [ch.message.content for ch in c.choices]
    for rc, cc in zip(r.choices, c.choices):
        assert _close(_logprobs(rc), _logprobs(cc))
    texts = ["", "", ""]
    for chunk in client.chat.completions.create(model=name, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [ch.message.content for ch in c.choices]
    schema = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=MAX_JSON_TOKENS, seed=11,
                                            response_format=JSON_SCHEMA)
    jsonschema.validate(json.loads(schema.choices[0].message.content), SCHEMA)


# --- /v1/completions: the prompt's logprobs cross in KVReady ---------------------------------------------


async def test_completions_echo_prompt_logprobs_cross_from_the_prefill(pd, colocated):
    """``echo`` with ``logprobs``: the prefill computed the prompt, so its logprobs come from there
    (KVReady's ``prompt_logprobs``); the decode's answer equals colocated's, prompt and completion."""
    kwargs = dict(prompt="The sea is deep and the sky is", max_tokens=5, temperature=0, echo=True, logprobs=3)
    room = pd.room()
    decode = openai.AsyncOpenAI(base_url=f"{pd.decode.url}/v1", api_key="x", max_retries=0, timeout=120)
    async with decode, httpx.AsyncClient(timeout=120) as http:
        d, p = await asyncio.gather(
            decode.completions.create(model=pd.model, extra_body={"ignore_eos": True, **room}, **kwargs),
            http.post(f"{pd.prefill.url}/v1/completions",
                      json={"model": pd.model, **kwargs, "ignore_eos": True, **room}))
    assert p.status_code == 200, p.text
    client = openai.OpenAI(base_url=f"{colocated.url}/v1", api_key="x", max_retries=0, timeout=120)
    c = client.completions.create(model=pd.model, extra_body={"ignore_eos": True}, **kwargs)
    got, want = d.choices[0], c.choices[0]
    assert got.text == want.text and got.logprobs.tokens == want.logprobs.tokens
    assert got.logprobs.token_logprobs[0] is None
    assert all(abs(a - b) < TOLERANCE for a, b in zip(got.logprobs.token_logprobs[1:], want.logprobs.token_logprobs[1:]))
    assert [sorted(t) for t in got.logprobs.top_logprobs[1:]] == [sorted(t) for t in want.logprobs.top_logprobs[1:]]
    pd.wait_blocks_free()
