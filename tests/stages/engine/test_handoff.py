"""Prefill on one engine, copy the KV blocks, decode on another: same tokens as one engine alone.

The byte copy stands in for the transfer engine here (the real backends are tested elsewhere);
this pins down the engine side of disaggregation: hand-off blocks, reservation, add_prefilled.
"""

from __future__ import annotations

import pytest

from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.sampling_params import SamplingParams
from stages.engine.prefilled import FirstTokens, Prefilled
from stages.loading import load_engine
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image


def drain(engine: Engine, limit: int = 64) -> None:
    for _ in range(limit):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize(
    "variant, params",
    [
        ("qwen3_vl", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
        ("llava", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
        ("qwen2_vl", SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)),
    ],
    ids=["qwen3_vl-greedy", "llava-greedy", "qwen2_vl-seeded"],
)
def test_prefill_here_decode_there_equals_colocated(variant, params):
    config = EngineConfig(model=str(model_dir(variant)), kv_cache_mib=16, device=DEVICE)
    (prefill, prompts), (decode, _) = load_engine(config, pixels=True), load_engine(config, pixels=True)
    parts = [{"type": "image"}, {"type": "text", "text": "what is this?"}]
    build = lambda: prompts.build([{"role": "user", "content": parts}], [random_image(80, 64, seed=5)])

    colocated = prefill.add_request("colocated", build(), params)
    drain(prefill)

    prompt = build()
    decode_blocks = decode.reserve_blocks(prompt, params)
    handed = prefill.add_request("room-1", prompt, params, hand_off=True)
    drain(prefill)
    assert handed.finish_reason is not None and len(handed.output_ids) == 1
    local = handed.blocks
    assert prefill.allocator.num_used == len(local)  # held for the transfer, not freed
    decode.pool.tensor[decode_blocks[: len(local)]] = prefill.pool.tensor[local]
    prefill.free_blocks(local)
    assert prefill.allocator.num_used == 0

    first_tokens = FirstTokens(handed.output_ids[:1])
    prefilled = Prefilled("room-1", prompt, params, decode_blocks, first_tokens, handed.rope_delta)
    (first,) = decode.add_prefilled(prefilled)
    (request,) = decode.scheduler.running
    drain(decode)
    assert first.token_ids == colocated.output_ids[:1]
    assert request.output_ids == colocated.output_ids and len(request.output_ids) == 10
    assert decode.allocator.num_used == 0


@pytest.fixture(scope="module")
def loaded():
    return load_engine(EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=16, device=DEVICE), pixels=True)


@pytest.fixture(scope="module")
def engine(loaded):
    return loaded[0]


@pytest.fixture(scope="module")
def prompts(loaded):
    return loaded[1]


def test_a_failing_step_fails_its_requests_and_frees_their_blocks(engine, prompts, monkeypatch):
    good = prompts.build([{"role": "user", "content": "fine"}], [])
    params = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("first", good, params)
    engine.step()  # "first" is decoding now
    engine.add_request("second", good, params)

    def boom(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.runner, "forward", boom)
    outputs = {o.request_id: o for o in engine.step()}
    monkeypatch.undo()
    assert {o.error for o in outputs.values()} == {"RuntimeError: boom"} and set(outputs) == {"first", "second"}
    assert engine.allocator.num_used == 0 and not engine.has_work()
    engine.add_request("after", good, params)  # the engine still serves
    drain(engine)
    assert engine.allocator.num_used == 0


def test_placeholders_must_match_the_images(engine, prompts):
    prompt = prompts.build([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
                                  [random_image(64, 64, seed=1)])
    prompt.images.clear()
    with pytest.raises(ValueError, match="prompt has 1 images but 0 preprocessed images"):
        engine.add_request("broken", prompt, SamplingParams(max_tokens=4))
    assert not engine.has_work()


def test_prefilled_request_that_ends_at_once_frees_its_blocks(engine, prompts):
    prompt = prompts.build([{"role": "user", "content": "one token"}], [])
    params = SamplingParams(max_tokens=1, temperature=0.0)
    blocks = engine.reserve_blocks(prompt, params)
    (output,) = engine.add_prefilled(Prefilled("one", prompt, params, blocks, FirstTokens([7])))
    assert output.finished and output.completion_tokens == 1
    assert engine.allocator.num_used == 0 and not engine.has_work()
