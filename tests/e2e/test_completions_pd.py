"""``/v1/completions`` through a pd router (1 prefill, 1 decode over Mooncake) and a colocated router,
driven by the official openai client: greedy parity with a colocated server (text and token-id
prompts, stream and not, n), echo with logprobs equal to the colocated server's, the router's
metrics counting the streamed answers; a multi-prompt request on a pd pair is the stage's 400."""

from __future__ import annotations

import httpx
import openai
import pytest

from process.ports import free_port
from tests.support.router_helpers import metric

pytestmark = pytest.mark.timeout(240)
MODEL = "tiny-vl"
SERVE = ["--served-model-name", MODEL, "--kv-cache-mib", "16"]
FAST = ["--transfer", "mooncake", "--pair-timeout-s", "5", "--transfer-timeout-s", "5"]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2_vl"))


@pytest.fixture(scope="module")
def colocated(start_server, model):
    return start_server("colocated", "--model", model, *SERVE)


@pytest.fixture(scope="module")
def pd_router(start_server, model):
    prefill = start_server("prefill", "--model", model, *SERVE, *FAST, "--bootstrap-port", str(free_port()))
    decode = start_server("decode", "--model", model, *SERVE, *FAST, "--kv-timeout-s", "10")
    return start_server("router", "--prefill", prefill.url, "--decode", decode.url, "--upstream-timeout-s", "30")


@pytest.fixture(scope="module")
def colocated_router(start_server, colocated):
    return start_server("router", "--colocated", colocated.url)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def streamed(server, **kwargs) -> tuple[dict[int, str], object]:
    texts: dict[int, str] = {}
    usage = None
    for piece in client(server).completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = piece.usage or usage
        for c in piece.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    return texts, usage


@pytest.mark.parametrize("prompt", ["A prompt in plain text", [97, 11, 187, 0, 355]])
def test_greedy_parity_with_colocated(pd_router, colocated, prompt):
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=IGNORE_EOS)
    expected = client(colocated).completions.create(**kwargs)
    routed = client(pd_router).completions.create(**kwargs)
    assert [c.text for c in routed.choices] == [c.text for c in expected.choices]
    assert routed.usage.completion_tokens == expected.usage.completion_tokens == 8
    assert routed.choices[0].finish_reason == "length"
    texts, usage = streamed(pd_router, **kwargs)
    assert texts == {0: expected.choices[0].text} and usage.completion_tokens == 8


def test_n_choices_through_pd(pd_router, colocated):
    kwargs = dict(model=MODEL, prompt="several choices", max_tokens=5, n=3, temperature=0, extra_body=IGNORE_EOS)
    expected = client(colocated).completions.create(**kwargs)
    routed = client(pd_router).completions.create(**kwargs)
    assert [(c.index, c.text) for c in routed.choices] == [(c.index, c.text) for c in expected.choices]
    texts, usage = streamed(pd_router, **kwargs)
    assert texts == {c.index: c.text for c in expected.choices} and usage.completion_tokens == 15


def test_echo_logprobs_through_pd_equal_colocated(pd_router, colocated):
    kwargs = dict(model=MODEL, prompt="echo these tokens", max_tokens=4, temperature=0, logprobs=2, echo=True,
                  extra_body=IGNORE_EOS)
    expected = client(colocated).completions.create(**kwargs).choices[0]
    routed = client(pd_router).completions.create(**kwargs).choices[0]
    assert routed.text == expected.text
    assert routed.logprobs.tokens == expected.logprobs.tokens
    assert routed.logprobs.token_logprobs[0] is None
    assert routed.logprobs.token_logprobs[1:] == pytest.approx(expected.logprobs.token_logprobs[1:], abs=1e-4)


def test_several_prompts_on_a_pd_pair_are_the_stages_400(pd_router):
    response = httpx.post(f"{pd_router.url}/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text


def test_a_colocated_router_counts_streamed_completions(colocated_router, colocated):
    before = metric(colocated_router.url, "epd_router_time_to_first_token_seconds_count")
    kwargs = dict(model=MODEL, prompt=["one", "two"], max_tokens=4, n=2, temperature=0, extra_body=IGNORE_EOS)
    expected = client(colocated).completions.create(**kwargs)
    texts, usage = streamed(colocated_router, **kwargs)
    assert texts == {c.index: c.text for c in expected.choices} and usage.completion_tokens == 16
    assert metric(colocated_router.url, "epd_router_time_to_first_token_seconds_count") == before + 1
    assert metric(colocated_router.url, "epd_router_time_per_output_token_seconds_count") >= 1
    document = httpx.get(f"{colocated_router.url}/openapi.json", timeout=10).json()
    stage = httpx.get(f"{colocated.url}/openapi.json", timeout=10).json()
    assert document["paths"]["/v1/completions"]["post"]["requestBody"] == \
        stage["paths"]["/v1/completions"]["post"]["requestBody"]
    assert "CompletionRequest" in document["components"]["schemas"]
