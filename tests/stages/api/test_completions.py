"""``POST /v1/completions`` on a real colocated server (tiny generated model), driven by the official
openai client: prompts as a string, a list, token ids; n; stop; stream; echo with logprobs, whose
prompt and sampled logprobs equal Hugging Face's ``log_softmax`` within 1e-4; the 400s naming
``suffix``, ``best_of``, a token outside the vocabulary."""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from stages.engine.multimodal import Prompt
from tests.support.colocated_openai import MODEL, TOLERANCE, client, model_dir, server  # noqa: F401
from tests.support.hf_reference import hf_inputs, load_reference


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_a_string_prompt_answers_a_text_completion(client):
    answer = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-") and answer.model == MODEL
    (choice,) = answer.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert answer.usage.completion_tokens == 5 and answer.usage.prompt_tokens > 0


def test_default_max_tokens_is_16(client):
    answer = client.completions.create(model=MODEL, prompt="hello", temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 16 and answer.choices[0].finish_reason == "length"


def test_token_ids_equal_their_text(client, tokenizer):
    text = "The quick brown fox"
    ids = tokenizer(text)["input_ids"]
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)


def test_a_list_of_prompts_with_n_numbers_choices_by_prompt(client, tokenizer):
    prompts = ["first prompt", "a second, longer prompt"]
    answer = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=2, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert [c.text for c in answer.choices] == [alone[0], alone[0], alone[1], alone[1]]  # greedy: n alike
    assert answer.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert answer.usage.completion_tokens == 16
    lists = client.completions.create(model=MODEL, prompt=[tokenizer(p)["input_ids"] for p in prompts],
                                      max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in lists.choices] == alone


def test_seeded_sampling_repeats(client):
    kwargs = dict(model=MODEL, prompt="seeded", max_tokens=8, temperature=1.0, seed=7, n=3)
    first, second = (client.completions.create(**kwargs) for _ in range(2))
    assert [c.text for c in first.choices] == [c.text for c in second.choices]


def test_stop_ends_before_the_stop_string(client):
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[3:5] if len(full) > 5 else None
    if not stop or not stop.strip():
        pytest.skip(f"the greedy text {full!r} has no usable stop string")
    cut = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_stream_chunks_join_to_the_answer(client):
    kwargs = dict(model=MODEL, prompt=["one", "two"], max_tokens=6, temperature=0, n=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for piece in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        assert piece.object == "text_completion"
        if piece.usage is not None:
            assert piece.choices == []
            usage = piece.usage
        for c in piece.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {i: "length" for i in range(4)}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 24


def test_echo_with_logprobs_matches_hugging_face(client, tokenizer, model_dir):
    prompt = "Logprobs of every token"
    ids = tokenizer(prompt)["input_ids"]
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                       echo=True, extra_body={"ignore_eos": True})
    (choice,) = answer.choices
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    n = len(ids) + 4
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == n
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(logprobs.text_offset, logprobs.text_offset[1:], logprobs.tokens))
    sampled = tokenizer(choice.text[len(prompt):])["input_ids"]
    every = ids + sampled[:4]
    model = load_reference(model_dir)
    with torch.no_grad():
        logits = model(**hf_inputs(Prompt(token_ids=every), model.config.image_token_id)).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    for position in range(1, n):
        expected = reference[position - 1, every[position]].item()
        assert abs(logprobs.token_logprobs[position] - expected) < TOLERANCE, position
        top = logprobs.top_logprobs[position]
        assert 3 <= len(top) <= 4
        best = reference[position - 1].topk(3)
        assert abs(max(top.values()) - best.values[0].item()) < TOLERANCE, position


def test_logprobs_without_echo_cover_the_completion(client):
    answer = client.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True})
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == 5 and all(len(top) == 1 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert all(lp <= 0 for lp in logprobs.token_logprobs)


def test_echo_streams_the_prompt_first(client):
    chunks = list(client.completions.create(model=MODEL, prompt="echo me", max_tokens=3, temperature=0, echo=True,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text.startswith("echo me")
    whole = client.completions.create(model=MODEL, prompt="echo me", max_tokens=3, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3, "n": 2}, "best_of"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "n": 9}, "n"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({}, "prompt"),
])
def test_refusals_name_the_parameter(server, body, param):
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_logit_bias_forces_a_token(client, tokenizer):
    token = tokenizer(" zebra")["input_ids"][0]
    answer = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0,
                                       logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert tokenizer(answer.choices[0].text)["input_ids"][:1] == [token]


def metrics(server) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines() if line.startswith("epd_")}


def test_a_client_that_leaves_mid_stream_aborts_every_prompt(server):
    """Two prompts of two choices each, streamed; the client leaves after the first chunk: the request
    counts as aborted, with far fewer tokens than asked, nothing runs and no block is held."""
    aborted = 'epd_requests_total{finish_reason="abort"}'
    before = metrics(server)
    body = {"prompt": ["left", "behind"], "max_tokens": 400, "n": 2, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert next(line for line in response.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 15
    while True:
        after = metrics(server)
        if after["epd_running_requests"] == after["epd_kv_blocks_used"] == 0 and after.get(aborted, 0) > 0:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert after[aborted] == before.get(aborted, 0) + 1
    assert after["epd_generation_tokens_total"] - before["epd_generation_tokens_total"] < 4 * 400
