"""``/v1/completions`` without a server: the bounded first pass of its body (``completion_schema``)
and the legacy logprobs object (``completion_bodies``)."""

from __future__ import annotations

import tracemalloc

import pytest

from stages.api.completion_bodies import FLOOR, joined, legacy_logprobs
from stages.api.completion_schema import MAX_PROMPTS, parse_completion_request
from stages.api.errors import APIError
from stages.engine.logprobs import TokenLogprob


def refusal(body: bytes) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_completion_request(body)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.unit
@pytest.mark.parametrize("body, prompts", [
    (b'{"prompt": "hi"}', ["hi"]), (b'{"prompt": ["a", "b"]}', ["a", "b"]), (b'{"prompt": [1, 2]}', [[1, 2]]),
    (b'{"prompt": [ [1], [2, 3]]}', [[1], [2, 3]]), (b'{"prompt": [4.0]}', [[4]]),
])
def test_every_prompt_form(body, prompts):
    assert parse_completion_request(body).prompts == prompts


@pytest.mark.unit
@pytest.mark.parametrize("body, param", [
    (b'{}', "prompt"), (b'{"prompt": []}', "prompt"), (b'{"prompt": [[]]}', "prompt[0]"),
    (b'{"prompt": [-1]}', "prompt[0]"), (b'{"prompt": [[1, [2]]]}', "prompt[0][1]"), (b'{"prompt": {"a": 1}}', "prompt"),
    (b'{"prompt": "x", "suffix": "y"}', "suffix"), (b'{"prompt": "x", "best_of": 2}', "best_of"),
    (b'{"prompt": "x", "logit_bias": {"1": [1]}}', "logit_bias"), (b'{"prompt": "x", "logprobs": 21}', "logprobs"),
])
def test_refusals_name_their_parameter(body, param):
    assert refusal(body).param == param


def test_lists_and_maps_are_counted_before_they_are_built():
    """Built first, either body costs ~170-190 MB and seconds; counted on the bytes, the refusal's peak is
    the depth check's fixed chunks (~30 MB for 4M brackets). A bound on memory, not on a busy machine's time."""
    many_lists = b'{"prompt": [' + b",".join([b"[1]"] * 2_000_000) + b"]}"
    many_biases = b'{"prompt": "x", "logit_bias": {' + b",".join(b'"%d": 1' % i for i in range(2_000_000)) + b"}}"
    for body, param, bound in ((many_lists, "prompt", MAX_PROMPTS), (many_biases, "logit_bias", 300)):
        tracemalloc.start()
        try:
            error = refusal(body)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert (error.param, f"<= {bound}" in error.message) == (param, True)
        assert peak < 64 << 20


@pytest.mark.unit
def test_legacy_logprobs_hold_the_chosen_token_and_offsets():
    texts = {1: "a", 2: "bc", 3: "d"}
    entries = [None, TokenLogprob(2, -0.5, [(3, -0.1), (2, -0.5)]), TokenLogprob(3, float("-inf"), [(1, -0.2)])]
    body = legacy_logprobs(entries, [1, 2, 3], lambda t: (texts[t], None), k=1, offset=5)
    assert body == {"tokens": ["a", "bc", "d"], "token_logprobs": [None, -0.5, FLOOR],
                    "top_logprobs": [None, {"d": -0.1, "bc": -0.5}, {"a": -0.2, "d": FLOOR}],
                    "text_offset": [5, 6, 8]}
    assert joined([body, body])["text_offset"] == [5, 6, 8, 5, 6, 8]


@pytest.mark.unit
def test_sampling_clamps_as_chat_does():
    """Completions and chat share one mapping: a denormal repetition_penalty is raised to 0.01 (it
    would scale the logits out of float range), echo with logprobs asks for the prompt's."""
    from stages.api.completion_prompts import sampling_params
    from stages.api.schema_types import MIN_REPETITION_PENALTY

    body = parse_completion_request(b'{"prompt": "x", "repetition_penalty": 1e-300, "temperature": 1e-9, '
                                    b'"logprobs": 3, "echo": true, "logit_bias": {"7": -100}}')
    params = sampling_params(body, vocab_size=100)
    assert (params.repetition_penalty, params.temperature) == (MIN_REPETITION_PENALTY, 0.01)
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs, params.logit_bias) == (16, 3, 3, ((7, -100),))
    with pytest.raises(APIError) as refused:
        sampling_params(parse_completion_request(b'{"prompt": "x", "logit_bias": {"100": 1}}'), vocab_size=100)
    assert refused.value.param == "logit_bias"
