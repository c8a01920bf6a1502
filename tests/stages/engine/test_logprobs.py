"""Logprobs and prompt logprobs from the engine against Hugging Face's logits, in-process.

A greedy request's output logprobs are ``log_softmax`` of the reference model's logits at each
generated position (the output tokens fed back); its prompt logprobs the same at every prompt
position, whole, chunked (a small ``max_batched_tokens``) and with prefix caching on (the request
takes no hit, even with its prompt cached). The top k are the k most likely, most likely first.
A greedy request with bias and penalties picks the argmax of the reference's logits processed by
hand (vLLM's order), and its logprobs stay the raw ones.
On ``EPD_TEST_DEVICE`` (tests/support/devices.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.outputs import RequestOutput
from stages.engine.sampling_params import SamplingParams
from stages.loading import load_engine
from tests.support.generated_models import model_dir
from tests.support.devices import DEVICE
from tests.support.hf_reference import hf_inputs, load_reference, random_image

TOLERANCE = 1e-4
K = 5


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def setup(request):
    path = model_dir(request.param)
    config = EngineConfig(model=str(path), kv_cache_mib=16, device=DEVICE, max_batched_tokens=8192)
    engine, builder = load_engine(config, pixels=True)
    chunked, _ = load_engine(dataclasses.replace(config, max_batched_tokens=7), pixels=True)
    return engine, chunked, builder, load_reference(path)


def prompt_of(builder, text: str, image: bool = True):
    parts = ([{"type": "image"}] if image else []) + [{"type": "text", "text": text}]
    return builder.build([{"role": "user", "content": parts}], [random_image(64, 64, seed=3)] if image else [])


def run(engine: Engine, request_id: str, prompt, params: SamplingParams) -> list[RequestOutput]:
    engine.add_request(request_id, prompt, params)
    outputs = []
    for _ in range(200):
        if not engine.has_work():
            return outputs
        outputs += [o for o in engine.step() if o.request_id == request_id]
    raise AssertionError("the engine did not finish")


def reference_logits(reference, prompt, image_token_id: int, outputs: list[int]) -> torch.Tensor:
    """HF's float32 logits [prompt_len + len(outputs), vocab] over the prompt followed by ``outputs``."""
    inputs = hf_inputs(prompt, image_token_id)
    ids = torch.cat([inputs["input_ids"], torch.tensor([outputs], dtype=torch.long, device=DEVICE)], dim=1)
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    if "mm_token_type_ids" in inputs:
        inputs["mm_token_type_ids"] = (ids == image_token_id).int()
    with torch.inference_mode():
        return reference(**inputs).logits[0].float().cpu()


def reference_logprobs(reference, prompt, image_token_id: int, outputs: list[int]) -> torch.Tensor:
    return reference_logits(reference, prompt, image_token_id, outputs).log_softmax(-1)


def assert_entry(entry, token: int, expected: torch.Tensor, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - expected[token].item()) < TOLERANCE
    top = torch.topk(expected, k)
    assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=TOLERANCE)
    assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    for token_id, lp in entry.top:  # ids may swap only where values tie within the tolerance
        assert abs(expected[token_id].item() - lp) < TOLERANCE


def test_greedy_logprobs_equal_log_softmax_of_the_reference(setup):
    engine, _, builder, reference = setup
    prompt = prompt_of(builder, "Tell me something.")
    outputs = run(engine, "lp", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=K))
    tokens = [t for o in outputs for t in o.token_ids]
    assert all(o.logprobs is not None and len(o.logprobs) == len(o.token_ids) for o in outputs)
    entries = [e for o in outputs for e in o.logprobs or []]
    expected = reference_logprobs(reference, prompt, engine.adapter.image_token_id, tokens)
    start = len(prompt.token_ids) - 1
    for i, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        assert_entry(entry, token, expected[start + i], K)
        assert token == int(expected[start + i].argmax())  # greedy: the sampled token is the most likely
    assert all(o.prompt_logprobs is None for o in outputs)


def test_no_logprobs_unless_asked_and_k_zero_gives_no_top(setup):
    engine, _, builder, _ = setup
    prompt = prompt_of(builder, "Hi", image=False)
    plain = run(engine, "plain", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in plain)
    zero = run(engine, "zero", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0))
    assert all(len(o.logprobs or []) == 1 and o.logprobs[0].top == [] for o in zero)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_the_reference_at_every_position(setup, chunked):
    whole, small, builder, reference = setup
    engine = small if chunked else whole
    prompt = prompt_of(builder, "A prompt of a few words, long enough to span chunks.")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=K, logprobs=2)
    outputs = run(engine, f"prompt-{chunked}", prompt, params)
    first, rest = outputs[0], outputs[1:]
    assert first.prompt_logprobs is not None and all(o.prompt_logprobs is None for o in rest)
    entries = first.prompt_logprobs
    assert len(entries) == len(prompt.token_ids) and entries[0] is None
    expected = reference_logprobs(reference, prompt, engine.adapter.image_token_id, [])
    for j in range(1, len(prompt.token_ids)):
        assert_entry(entries[j], prompt.token_ids[j], expected[j - 1], K)
    assert engine.allocator.num_used == 0


def test_prompt_logprobs_take_no_prefix_cache_hit(setup):
    engine, _, builder, reference = setup
    config = dataclasses.replace(engine.config, prefix_caching=True)
    cached, _ = load_engine(config, pixels=True)
    prompt = prompt_of(builder, "The same prompt twice, the second time with its blocks cached already. " * 3,
                       image=False)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run(cached, "warm", prompt, greedy)
    assert run(cached, "hit", prompt, greedy)[0].cached_tokens > 0  # the prompt is cached
    outputs = run(cached, "whole", prompt, dataclasses.replace(greedy, prompt_logprobs=1))
    assert outputs[0].cached_tokens == 0
    expected = reference_logprobs(reference, prompt, engine.adapter.image_token_id, [])
    entries = outputs[0].prompt_logprobs or []
    assert len(entries) == len(prompt.token_ids)
    for j in range(1, len(prompt.token_ids)):
        assert_entry(entries[j], prompt.token_ids[j], expected[j - 1], 1)


def test_a_hand_off_output_carries_logprobs_and_prompt_logprobs(setup):
    engine, _, builder, reference = setup
    prompt = prompt_of(builder, "Hand me over.")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    request = engine.add_request("room", prompt, params, hand_off=True)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    (output,) = outputs
    engine.free_blocks(request.blocks)
    expected = reference_logprobs(reference, prompt, engine.adapter.image_token_id, [])
    assert output.logprobs is not None and len(output.logprobs) == 1
    assert_entry(output.logprobs[0], output.token_ids[0], expected[-1], 3)
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt.token_ids)


def test_greedy_penalties_and_bias_pick_the_argmax_of_the_hand_processed_reference_logits(setup):
    engine, _, builder, reference = setup
    prompt = prompt_of(builder, "again and again and again", image=False)
    bias = ((int(prompt.token_ids[-1]), 3.0), (7, -2.0))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=bias, repetition_penalty=1.3,
                            frequency_penalty=0.5, presence_penalty=0.3, logprobs=1)
    outputs = run(engine, "penalized", prompt, params)
    tokens = [t for o in outputs for t in o.token_ids]
    logits = reference_logits(reference, prompt, engine.adapter.image_token_id, tokens)
    start = len(prompt.token_ids) - 1
    for i, token in enumerate(tokens):
        row = logits[start + i].clone()  # by hand, vLLM's order: bias, repetition, frequency, presence
        for t, b in bias:
            row[t] += b
        for t in set(prompt.token_ids) | set(tokens[:i]):
            row[t] = row[t] / 1.3 if row[t] > 0 else row[t] * 1.3
        for t in set(tokens[:i]):
            row[t] -= 0.5 * tokens[:i].count(t) + 0.3
        assert token == int(row.argmax()), f"step {i}"
        raw = logits[start + i].log_softmax(-1)[token].item()
        assert outputs[i].logprobs is not None and abs(outputs[i].logprobs[0].logprob - raw) < TOLERANCE
    plain = run(engine, "plain-greedy", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [t for o in plain for t in o.token_ids] != tokens  # the processing changed the answer
